"""A fleet simulator: the real scheduler and block pool per replica, in simulated time.

Each replica is a real :class:`pagedllm.core.scheduler.Scheduler` over a real
:class:`pagedllm.core.kv_cache_manager.KVCacheManager` (prefix cache, chained block hashes, LRU
eviction, chunked prefill, preemption: the engine's own code, not a model of it). Only the forward
pass is replaced: a step takes ``StepModel.cost`` simulated seconds, and each request that reaches
the end of its tokens "samples" its next trace token (``TraceRequest.output_token_ids``, else a
filler token; EOS is ignored, a request stops at ``max_tokens``), exactly as the engine core's loop
does ``schedule() -> execute_model -> update_from_output``.

The loop is event driven: a heap of the busy replicas' step-end times and the sorted arrivals.
An idle replica costs nothing; an arrival is routed (:class:`Router`) and, if its replica is idle,
starts a step at once. Arrivals during a step join the next ``schedule()``, as in the engine.

Fast-forward (``simulate(fast_forward=True)``, the default): after a step, when a replica has
nothing waiting and every running request is a plain decode whose next steps allocate no block,
register no full block (the scheduler's own no-allocation path) and finish nothing, the longest
such run of steps (>= 2) is applied without calling the scheduler: in such a step the scheduler
only advances each request's ``num_computed_tokens`` and appends its sampled token, and nothing
the router reads (requests in flight, KV usage, KV events) changes. The run's step times are the
same ``StepModel`` calls and float sums as one step at a time, and one heap event marks its end.
An arrival routed to the replica during the run applies the steps that ended before it and hands
the step in flight to the real scheduler (the arrival joins the step after it, as without
fast-forward). ``tests/sim/test_fast_forward.py`` checks that both ways give the same steps,
token times and figures.

Routing policies (``--policy``), over the requests each replica has in flight (routed, not
finished), the notion the server's data-parallel front door uses:

- ``least-load``: fewest requests in flight, then lowest KV cache usage, then lowest index;
- ``round-robin``: replicas in turn;
- ``sticky``: a conversation's first request goes least-load, its later ones to the same replica
  (requests without a conversation id: least-load);
- ``prefix``: the replicas whose block pools hold the longest run of the request's leading block
  hashes (known from the replicas' KV events, "stored"/"removed", as a cache-aware router learns
  them), least-load among those; least-load when none holds its first block, or when the chosen
  replica has more than ``balance_abs_threshold`` requests in flight beyond the least loaded one.
"""
from __future__ import annotations

import gc
import heapq
from bisect import bisect_left
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import get_hash_fn, make_root_hash, update_block_hashes
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.router.index import leading_matches
from pagedllm.router.policy import POLICIES, PolicyConfig, Router as PolicyRouter
from pagedllm.sim.step_model import COEFFICIENTS, StepModel
from pagedllm.sim.trace import FILLER_TOKEN, TraceRequest

# ITL histogram: bins of 0.2% relative width (log-spaced), so percentiles are within 0.1%.
_ITL_BINS_PER_E = 500.0


@dataclass
class ReplicaConfig:
    """Engine settings of every simulated replica (``EngineArgs`` names and defaults)."""

    num_blocks: int = 4096
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    #: the block hash of the simulated prefix caches: xxhash (vLLM's ``--prefix-caching-hash-algo``
    #: value; a runtime dependency) is cheaper than the engine's default sha256 and, bar
    #: collisions, makes the same decisions.
    prefix_caching_hash_algo: str = "xxhash"


class _SimSamplingParams:
    """What the scheduler and KV cache manager read of a ``SamplingParams`` (greedy, EOS ignored)."""

    __slots__ = ("max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "prompt_logprobs")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = 0
        self.stop_token_ids = None
        self.ignore_eos = True
        self.prompt_logprobs = None


class Replica:
    """One simulated engine: a Scheduler + KVCacheManager, its clock, and its counters."""

    def __init__(self, index: int, cfg: ReplicaConfig, hash_seed: str, kv_events: bool) -> None:
        self.index = index
        self.mgr = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                  cfg.prefix_caching_hash_algo, hash_seed=hash_seed,
                                  max_model_len=cfg.max_model_len)
        self.pool = self.mgr.block_pool
        if kv_events:
            self.pool.enable_kv_events(cfg.block_size)
        self.sched = Scheduler(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, self.mgr,
                               long_prefill_token_threshold=cfg.long_prefill_token_threshold, debug=False)
        self.busy = False
        self.current: Any = None  # the SchedulerOutput in flight
        #: a fast-forwarded run of decode steps in flight (``_Window``), else None
        self.window: Optional[_Window] = None
        self.gen = 0  # the heap entry of this replica that is current (older ones are stale)
        self.runner_out = ModelRunnerOutput()  # (refilled each step: no allocation)
        self.step_start = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        self.usage_time = 0.0  # integral of KV usage over busy time
        self.peak_usage = 0.0
        self.num_requests = 0
        self.num_output_tokens = 0
        self.added_since_step: list[str] = []
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.itl_hist: dict[int, int] = {}


class _Window:
    """A run of ``k`` pure-decode steps of one replica applied without calling the scheduler.

    ``times[0]`` is when the first of them starts, ``times[j]`` when the j-th ends (the same float
    sums as stepping one at a time) and ``dts[j - 1]`` its step time; ``reqs`` are the running requests in batch order, ``live``
    their simulator state, ``u`` the pool's (unchanging) usage."""

    __slots__ = ("times", "dts", "reqs", "live", "u", "k")

    def __init__(self, times: list[float], dts: list[float], reqs: list, live: list, u: float) -> None:
        self.times = times
        self.dts = dts
        self.reqs = reqs
        self.live = live
        self.u = u
        self.k = len(times) - 1


class Router:
    """Picks a replica per request (module docstring); tracks in-flight counts and KV usage."""

    def __init__(self, policy: str, num_replicas: int, balance_abs_threshold: int = 8,
                 router_rules: Optional[PolicyConfig] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy: expected one of {list(POLICIES)}, got {policy!r}")
        self.policy = policy
        # The server router's own policy object (``pagedllm.router.policy``) when its rules decide.
        self.rules: Optional[PolicyRouter] = None if router_rules is None else PolicyRouter(policy, router_rules)
        self._all = list(range(num_replicas))
        self.n = num_replicas
        self.balance_abs_threshold = balance_abs_threshold
        self.in_flight = [0] * num_replicas
        self.usage = [0.0] * num_replicas
        # buckets[k]: replicas with k requests in flight; min_load: the lowest non-empty k.
        self.buckets: list[set[int]] = [set(range(num_replicas))]
        self.min_load = 0
        self.index: dict[bytes, set[int]] = {}  # block hash -> replicas holding it (prefix)
        self._rr = 0
        self.sticky: dict[str, int] = {}
        self.num_prefix_routed = 0  # routed by a prefix match (prefix policy)

    # ---- load bookkeeping ----------------------------------------------------------------
    def inc(self, i: int) -> None:
        k = self.in_flight[i]
        b = self.buckets
        b[k].discard(i)
        if len(b) == k + 1:
            b.append(set())
        b[k + 1].add(i)
        self.in_flight[i] = k + 1
        if k == self.min_load and not b[k]:
            self.min_load = k + 1

    def dec(self, i: int) -> None:
        k = self.in_flight[i]
        self.buckets[k].discard(i)
        self.buckets[k - 1].add(i)
        self.in_flight[i] = k - 1
        if k - 1 < self.min_load:
            self.min_load = k - 1

    def least_loaded(self, among: Optional[set[int]] = None) -> int:
        """Fewest in flight, then lowest KV usage, then lowest index (``among``: a subset)."""
        usage = self.usage
        if among is not None and len(among) <= 8:
            inf = self.in_flight
            return min(among, key=lambda i: (inf[i], usage[i], i))
        for k in range(self.min_load, len(self.buckets)):
            b = self.buckets[k]
            if among is not None:
                b = b & among
            if b:
                if k == 0:  # nothing in flight: no blocks held, usage 0 everywhere
                    return min(b)
                return min(b, key=lambda i: (usage[i], i))
        raise AssertionError("no replica")

    # ---- KV events -------------------------------------------------------------------------
    def apply_kv_events(self, i: int, events: list[tuple]) -> None:
        index = self.index
        for ev in events:
            kind = ev[0]
            if kind == "stored":
                for h in ev[1]:
                    s = index.get(h)
                    if s is None:
                        index[h] = {i}
                    else:
                        s.add(i)
            elif kind == "removed":
                for h in ev[1]:
                    s = index.get(h)
                    if s is not None:
                        s.discard(i)
                        if not s:
                            del index[h]
            elif kind == "cleared":
                for h in [h for h, s in index.items() if i in s]:
                    index[h].discard(i)
                    if not index[h]:
                        del index[h]

    # ---- routing ---------------------------------------------------------------------------
    def route(self, block_hashes: Sequence[bytes], conversation_id: Optional[str]) -> int:
        """The replica for a request whose full prompt blocks hash to ``block_hashes``."""
        if self.rules is not None:
            return self._route_by_router_rules(block_hashes, conversation_id)
        p = self.policy
        if p == "round-robin":
            i = self._rr
            self._rr = (i + 1) % self.n
            return i
        if p == "sticky":
            if conversation_id is None:
                return self.least_loaded()
            i = self.sticky.get(conversation_id, -1)
            if i < 0:
                i = self.sticky[conversation_id] = self.least_loaded()
            return i
        if p == "prefix" and block_hashes:
            index = self.index
            cand = index.get(block_hashes[0])
            if cand:
                for h in block_hashes[1:]:
                    s = index.get(h)
                    if not s:
                        break
                    if cand <= s:  # (the usual case: the same holders)
                        continue
                    nxt = cand & s
                    if not nxt:
                        break
                    cand = nxt
                i = self.least_loaded(cand)
                if self.in_flight[i] - self.min_load <= self.balance_abs_threshold:
                    self.num_prefix_routed += 1
                    return i
        return self.least_loaded()

    def prefix_matches(self, block_hashes: Sequence[bytes]) -> dict[int, int]:
        """Replica -> the leading blocks of ``block_hashes`` it holds (as ``PrefixIndex.match``)."""
        return leading_matches(self.index.get, block_hashes)

    def _route_by_router_rules(self, block_hashes: Sequence[bytes], conversation_id: Optional[str]) -> int:
        # NOTE: O(replicas) a request (the server router's rule over every eligible replica): meant
        # for the router's fleet sizes, not for 1,000 simulated replicas.
        assert self.rules is not None
        matches = self.prefix_matches(block_hashes) if self.policy == "prefix" else None
        d = self.rules.choose(self._all, self.in_flight, matches=matches, prompt_blocks=len(block_hashes),
                              session=conversation_id)
        if d.reason == "prefix":
            self.num_prefix_routed += 1
        return d.replica


@dataclass
class SimResult:
    """What :func:`simulate` returns (``to_json`` for ``--output-json``)."""

    summary: dict
    replicas: list[dict]
    steps: Optional[list[tuple]] = field(default=None, repr=False)
    #: request id -> emission time (simulated s) of each of its tokens (``record_token_times``)
    token_times: Optional[dict[str, list[float]]] = field(default=None, repr=False)
    #: the run's Router and Replica objects (for inspection; not serialized).
    router: Any = field(default=None, repr=False)
    replica_objects: list = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        return {"summary": self.summary, "replicas": self.replicas}


def _common_blocks(a: Sequence[int], b: Sequence[int], nb: int, bs: int) -> int:
    """The number of leading ``bs``-token blocks that ``a`` and ``b`` share, at most ``nb``."""
    k = 0
    while k < nb and a[k * bs:(k + 1) * bs] == b[k * bs:(k + 1) * bs]:
        k += 1
    return k


def _percentiles(values: list[float], ps: Sequence[float] = (50, 90, 99)) -> dict:
    if not values:
        return {"mean": None, **{f"p{p:g}": None for p in ps}}
    v = sorted(values)
    out = {"mean": sum(v) / len(v)}
    for p in ps:
        out[f"p{p:g}"] = v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]
    return out


def _hist_percentiles(hist: dict[int, int], ps: Sequence[float] = (50, 90, 99)) -> dict:
    total = sum(hist.values())
    if not total:
        return {"mean": None, **{f"p{p:g}": None for p in ps}}
    keys = sorted(hist)
    out: dict[str, Any] = {"mean": sum(math.exp((k + 0.5) / _ITL_BINS_PER_E) * hist[k] for k in keys) / total}
    for p in ps:
        target = max(1, math.ceil(p / 100 * total))
        acc = 0
        for k in keys:
            acc += hist[k]
            if acc >= target:
                out[f"p{p:g}"] = math.exp((k + 0.5) / _ITL_BINS_PER_E)
                break
    return out


def _to_ms(d: dict) -> dict:
    return {k: (None if v is None else round(v * 1e3, 3)) for k, v in d.items()}


def simulate(trace: Sequence[TraceRequest], num_replicas: int, policy: str, step_model: StepModel,
             cfg: Optional[ReplicaConfig] = None, *, seed: int = 0, balance_abs_threshold: int = 8,
             record_steps: bool = False, per_replica: bool = True, closed_loop: bool = False,
             router_rules: Optional[PolicyConfig] = None, fast_forward: bool = True,
             record_token_times: bool = False) -> SimResult:
    """Run ``trace`` through ``num_replicas`` simulated replicas behind ``policy``.

    Args:
        trace: requests sorted by ``arrival_s``.
        num_replicas: >= 1.
        policy: one of ``POLICIES``.
        step_model: seconds per step from the batch's shape.
        cfg: replica engine settings (default ``ReplicaConfig()``).
        seed: seeds the shared prefix-cache root hash (the run is deterministic given the trace).
        balance_abs_threshold: prefix policy's load guard (requests in flight).
        record_steps: keep, per step, ``(replica, start_s, ids added before it, [(req_id, num_tokens)])``
            (``SimResult.steps``; tests compare it with the real engine's steps).
        per_replica: include per-replica figures (percentiles too) in the result.
        closed_loop: a conversation's later turns (same ``conversation_id``, in trace order) are
            sent ``think_time_s`` (else the gap between the two turns' ``arrival_s``) after its
            previous turn finished, as a chat client does; its first turn at its ``arrival_s``.
            TTFT and E2E count from the send time.
        router_rules: route with the server router's policy (``pagedllm.router.policy.Router``:
            ``prefix``'s cost rule, ``least-load``'s ties in turn, ``sticky``'s rendezvous hash)
            and these knobs, instead of the simulator's own rules; O(replicas) a request.
        fast_forward: apply runs of pure-decode steps without calling the scheduler for each
            (module docstring, "Fast-forward"); the result is the same as stepping one at a time
            (``False``), which ``tests/sim`` checks, except that ``SimResult.steps`` lists a
            fast-forwarded replica's steps when they are applied (each replica's in order).
        record_token_times: keep, per request id, the simulated time of each emitted token
            (``SimResult.token_times``).

    Returns:
        a :class:`SimResult`. A request that cannot fit (prompt + max_tokens > max_model_len) is
        rejected (counted in ``summary["num_rejected"]``), as a server would answer 400.
    """
    if num_replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {num_replicas}")
    cfg = cfg or ReplicaConfig()
    wall0 = time.perf_counter()
    hash_seed = f"pagedllm-sim-{seed}"
    hash_fn = get_hash_fn(cfg.prefix_caching_hash_algo)
    root = make_root_hash(hash_fn, hash_seed)
    want_hashes = policy == "prefix" and cfg.enable_prefix_caching
    replicas = [Replica(i, cfg, hash_seed, want_hashes) for i in range(num_replicas)]
    router = Router(policy, num_replicas, balance_abs_threshold, router_rules)
    bs = cfg.block_size
    heap: list[tuple[float, int, int]] = []  # (step end, replica, its gen when pushed)
    heappush, heappop = heapq.heappush, heapq.heappop
    steps: Optional[list[tuple]] = [] if record_steps else None
    token_times: Optional[dict[str, list[float]]] = {} if record_token_times else None
    # rid -> [arrival_s, last emission time or None, the trace's output tokens or None, prompt length]
    live: dict[str, list] = {}
    ttft_all: list[float] = []
    e2e_all: list[float] = []
    itl_all: dict[int, int] = {}
    num_rejected = 0
    total_out = 0
    log = math.log
    ITL_K = _ITL_BINS_PER_E
    usage = router.usage
    step_seconds = step_model.step_seconds
    decode_seconds = step_model.decode_seconds

    def start_step(rep: Replica, t: float) -> None:
        so = rep.sched.schedule()
        flat = getattr(so, "cached_req_ids", None)  # (the scheduler's flat form of a pure decode step)
        if flat and so.is_flat:
            dt = decode_seconds(len(flat), sum(so.cached_start_pos) + len(flat))
        elif so.is_empty and not rep.sched.running:
            # Nothing can run (cannot happen for requests that fit): stay idle until an arrival.
            rep.busy = False
            return
        else:
            dt = step_seconds(so.scheduled)
        u = rep.pool.get_usage()
        rep.usage_time += u * dt
        if u > rep.peak_usage:
            rep.peak_usage = u
        usage[rep.index] = u
        rep.busy_s += dt
        rep.num_steps += 1
        if steps is not None:
            steps.append((rep.index, t, rep.added_since_step, [(sr.req_id, sr.num_tokens) for sr in so.scheduled]))
            rep.added_since_step = []
        rep.current = so
        rep.busy = True
        g = rep.gen = rep.gen + 1
        heappush(heap, (t + dt, rep.index, g))

    def end_step(rep: Replica, t: float) -> int:
        """Apply the step that ends at ``t``; returns the tokens it emitted."""
        so = rep.current
        sched = rep.sched
        mro = rep.runner_out
        sampled = mro.sampled_token_ids
        sampled.clear()
        flat = getattr(so, "cached_req_ids", None)
        if flat and so.is_flat:
            for rid, s in zip(flat, so.cached_start_pos):
                st = live.get(rid)
                if st is not None:
                    outs = st[2]
                    k = s + 1 - st[3]  # the output tokens so far
                    sampled[rid] = [outs[k] if outs is not None and k < len(outs) else FILLER_TOKEN]
        else:
            for sr in so.scheduled:
                if sr.is_last_chunk:
                    rid = sr.req_id
                    st = live.get(rid)
                    if st is None:
                        continue
                    outs = st[2]
                    k = len(sr.token_ids) - sr.prompt_len  # the output tokens so far
                    sampled[rid] = [outs[k] if outs is not None and k < len(outs) else FILLER_TOKEN]
        outputs = sched.update_from_output(so, mro)
        hist = rep.itl_hist if per_replica else itl_all
        n_out = 0
        last_d = -1.0
        key = 0
        for o in outputs:
            st = live[o.req_id]
            new = o.new_token_ids
            if new:
                n_out += len(new)
                prev = st[1]
                if prev is None:
                    v = t - st[0]
                    ttft_all.append(v)
                    if per_replica:
                        rep.ttft.append(v)
                elif t > prev:
                    d = t - prev
                    if d != last_d:  # (a decode batch: every row has the same gap)
                        last_d = d
                        key = int(log(d) * ITL_K)
                    hist[key] = hist.get(key, 0) + 1
                st[1] = t
                if token_times is not None:
                    token_times.setdefault(o.req_id, []).extend([t] * len(new))
            if o.finish_reason is not None:
                v = t - st[0]
                e2e_all.append(v)
                if per_replica:
                    rep.e2e.append(v)
                del live[o.req_id]
                router.dec(rep.index)
                if follow is not None:
                    nxt = follow.get(o.req_id)
                    if nxt is not None:
                        heappush(sent, (t + nxt[1], nxt[0].arrival_s, nxt[0].request_id, nxt[0]))
        rep.num_output_tokens += n_out
        if want_hashes:
            ev = rep.pool.take_kv_events()
            if ev:
                router.apply_kv_events(rep.index, ev)
        rep.current = None
        if sched.has_unfinished_requests():
            if not (fast_forward and start_window(rep, t)):
                start_step(rep, t)
        else:
            rep.busy = False
            usage[rep.index] = rep.pool.get_usage()
        return n_out

    budget = cfg.max_num_batched_tokens
    max_len = cfg.max_model_len
    caching_on = cfg.enable_prefix_caching

    def start_window(rep: Replica, t: float) -> bool:
        """Start a fast-forward window at ``t`` if the next steps are pure decodes (none waiting,
        every running request one token behind, no block to allocate or register, none to
        finish) for at least 2 steps; False (nothing changed) otherwise."""
        sched = rep.sched
        if sched.waiting:
            return False
        running = sched.running
        n = len(running)
        if not n or n > budget:
            return False
        mgr = rep.mgr
        rtb = mgr.req_to_blocks
        ncb = mgr.num_cached_block
        k = 1 << 30
        ctx = 0
        for req in running:
            c = req.num_computed_tokens
            ln = len(req.all_token_ids)
            # NOTE: the scheduler's KEPT fast path holds for the step starting at c + j while
            # c + j + 1 <= held blocks * bs and (c + j + 1) // bs <= registered blocks; a step
            # that emits the max_tokens-th output token or reaches max_model_len finishes it.
            if c + 1 != ln or req.spec_token_ids or c < len(req.prompt_token_ids):
                return False
            rid = req.request_id
            m = len(rtb[rid]) * bs - c
            if caching_on:
                m2 = (ncb[rid] + 1) * bs - 1 - c
                if m2 < m:
                    m = m2
            f = req.max_tokens - len(req.output_token_ids) - 1
            if f < m:
                m = f
            f = max_len - ln - 1
            if f < m:
                m = f
            if m < k:
                k = m
                if k < 2:
                    return False
            ctx += c
        times = [t]
        dts = []
        tt = t
        for j in range(1, k + 1):
            dt = decode_seconds(n, ctx + j * n)
            dts.append(dt)
            tt = tt + dt
            times.append(tt)
        u = rep.pool.get_usage()
        if u > rep.peak_usage:
            rep.peak_usage = u
        usage[rep.index] = u
        rep.window = _Window(times, dts, list(running), [live[r.request_id] for r in running], u)
        rep.busy = True
        g = rep.gen = rep.gen + 1
        heappush(heap, (tt, rep.index, g))
        return True

    def apply_window(rep: Replica, m: int) -> int:
        """Apply the first ``m`` steps of ``rep``'s window (what ``schedule()`` and
        ``update_from_output`` do to a pure decode step, and the simulator's own counters);
        returns the tokens emitted."""
        w = rep.window
        if not m:
            return 0
        times = w.times
        dts = w.dts
        u = w.u
        ut, bt = rep.usage_time, rep.busy_s
        for dt in dts[:m]:  # (the same float sums, in the same order, as one step at a time)
            ut += u * dt
            bt += dt
        rep.usage_time, rep.busy_s = ut, bt
        rep.num_steps += m
        sched = rep.sched
        if sched.finished_req_ids:  # (the first step's schedule() hands them to the runner)
            sched.finished_req_ids = set()
        t_end = times[m]
        t1 = times[1]
        hist = rep.itl_hist if per_replica else itl_all
        rids = []
        for req, st in zip(w.reqs, w.live):
            out_ids = req.output_token_ids
            o = len(out_ids)
            outs = st[2]
            new = outs[o:o + m] if outs is not None else []
            if len(new) < m:
                new = new + [FILLER_TOKEN] * (m - len(new))
            out_ids.extend(new)
            req.all_token_ids.extend(new)
            req.num_computed_tokens += m
            prev = st[1]
            if t1 > prev:
                key = int(log(t1 - prev) * ITL_K)
                hist[key] = hist.get(key, 0) + 1
            st[1] = t_end
            if token_times is not None:
                token_times.setdefault(req.request_id, []).extend(times[1:m + 1])
            if steps is not None:
                rids.append(req.request_id)
        n = len(w.reqs)
        last_d = -1.0
        key = 0
        for j in range(2, m + 1):
            d = times[j] - times[j - 1]
            if d != last_d:
                last_d = d
                key = int(log(d) * ITL_K)
            hist[key] = hist.get(key, 0) + n
        if steps is not None:
            for j in range(m):
                steps.append((rep.index, times[j], rep.added_since_step if j == 0 else [], [(r, 1) for r in rids]))
            rep.added_since_step = []
        rep.num_output_tokens += n * m
        return n * m

    def interrupt_window(rep: Replica, t_arr: float) -> int:
        """An arrival at ``t_arr`` joins ``rep``: apply the window's steps that ended before it,
        and start the one in flight at ``t_arr`` through the scheduler (the arrival joins the
        step after it, as one step at a time); returns the tokens emitted."""
        times = rep.window.times
        j = bisect_left(times, t_arr, 1)  # the step in flight: the first to end at or after t_arr
        n_out = apply_window(rep, j - 1)
        rep.window = None
        start_step(rep, times[j - 1])
        return n_out

    def end_window(rep: Replica, t: float) -> int:
        n_out = apply_window(rep, rep.window.k)
        rep.window = None
        if not start_window(rep, t):
            start_step(rep, t)
        return n_out

    # Closed loop: request id -> (the conversation's next turn, its think time); ``sent``: a heap
    # of (send time, trace arrival, id, request) of the turns whose previous turn has finished.
    follow: Optional[dict[str, tuple[TraceRequest, float]]] = None
    sent: list[tuple[float, float, str, TraceRequest]] = []
    arrivals: Sequence[TraceRequest] = trace
    if closed_loop:
        follow, last, arrivals = {}, {}, []
        for tr in trace:
            prev = last.get(tr.conversation_id) if tr.conversation_id is not None else None
            if prev is None:
                arrivals.append(tr)
            else:
                follow[prev.request_id] = (tr, tr.think_time_s if tr.think_time_s is not None
                                           else max(0.0, tr.arrival_s - prev.arrival_s))
            if tr.conversation_id is not None:
                last[tr.conversation_id] = tr
    t_now = 0.0
    max_model_len = cfg.max_model_len
    gc_threshold = gc.get_threshold()
    # NOTE: fewer young-generation collections: a run allocates a few objects per step and keeps
    # few; the default (700) makes the collector a measurable share of a 1,000-replica run.
    gc.set_threshold(max(gc_threshold[0], 20000), *gc_threshold[1:])
    # the prompt blocks the router looks up: the cacheable ones (the simulator's rules), or every
    # full block (the server router's ``chain_hashes``)
    route_last = router_rules is not None

    caching = cfg.enable_prefix_caching
    conv_last: dict[str, Request] = {}  # conversation id -> its latest turn's Request
    conv_replica: dict[str, int] = {}  # conversation id -> the replica of its latest turn
    affinity = [0, 0]  # later turns; of those, routed to the replica of the previous turn

    window_out = [0]  # tokens of the windows that arrivals cut short

    def arrive(tr: TraceRequest, t_arr: float) -> bool:
        """Route ``tr`` at ``t_arr``; False when it is rejected."""
        if len(tr.prompt_token_ids) + tr.max_tokens > max_model_len:
            return False
        req = Request(tr.request_id, tr.prompt_token_ids, sampling_params=_SimSamplingParams(tr.max_tokens),
                      arrival_time=t_arr)
        cid = tr.conversation_id
        if caching and cid is not None:
            # NOTE: the hashes of the leading blocks this prompt shares with the conversation's
            # previous turn (its prompt and answer so far) are that turn's: the same function of
            # the same tokens. The rest are hashed by the engine's code (update_block_hashes).
            prev = conv_last.get(cid)
            if prev is not None:
                toks, ph = tr.prompt_token_ids, prev.block_hashes
                nb = min(len(ph), len(toks) // bs)
                ptoks = prev.all_token_ids
                if nb and toks[:nb * bs] != ptoks[:nb * bs]:
                    nb = _common_blocks(toks, ptoks, nb, bs)
                if nb:
                    req.block_hashes = ph[:nb]
            conv_last[cid] = req
        if want_hashes:
            update_block_hashes(req, bs, hash_fn, root)
            i = router.route(req.block_hashes if route_last else req.block_hashes[:(req.num_tokens - 1) // bs],
                             tr.conversation_id)
        else:
            i = router.route((), tr.conversation_id)
        if cid is not None:
            j = conv_replica.get(cid)
            if j is not None:
                affinity[0] += 1
                affinity[1] += j == i
            conv_replica[cid] = i
        rep = replicas[i]
        if rep.window is not None:
            window_out[0] += interrupt_window(rep, t_arr)
        rep.sched.add_request(req)
        rep.num_requests += 1
        if steps is not None:
            rep.added_since_step.append(tr.request_id)
        live[tr.request_id] = [t_arr, None, tr.output_token_ids, len(tr.prompt_token_ids)]
        router.inc(i)
        if not rep.busy:
            start_step(rep, t_arr)
        return True

    try:
        if follow is None:
            for tr in arrivals:
                t_arr = tr.arrival_s
                while heap and heap[0][0] < t_arr:  # (a step ending with an arrival: the arrival first)
                    t, i, g = heappop(heap)
                    rep = replicas[i]
                    if g == rep.gen:  # (else a window cut short by an arrival: stale)
                        t_now = t
                        total_out += end_step(rep, t) if rep.window is None else end_window(rep, t)
                t_now = t_arr
                if not arrive(tr, t_arr):
                    num_rejected += 1
        else:
            k = 0
            inf = math.inf
            while True:
                t_a = arrivals[k].arrival_s if k < len(arrivals) else inf
                t_s = sent[0][0] if sent else inf
                t_arr = t_a if t_a <= t_s else t_s
                if heap and heap[0][0] < t_arr:  # (a step's end may send a turn: one at a time)
                    t, i, g = heappop(heap)
                    rep = replicas[i]
                    if g == rep.gen:
                        t_now = t
                        total_out += end_step(rep, t) if rep.window is None else end_window(rep, t)
                    continue
                if t_arr == inf:
                    break
                if t_a <= t_s:
                    tr = arrivals[k]
                    k += 1
                else:
                    tr = heappop(sent)[3]
                t_now = t_arr
                if not arrive(tr, t_arr):
                    num_rejected += 1
                    nxt = follow.get(tr.request_id)  # (its conversation goes on)
                    if nxt is not None:
                        heappush(sent, (t_arr + nxt[1], nxt[0].arrival_s, nxt[0].request_id, nxt[0]))
        while heap:
            t, i, g = heappop(heap)
            rep = replicas[i]
            if g == rep.gen:
                t_now = t
                total_out += end_step(rep, t) if rep.window is None else end_window(rep, t)
        total_out += window_out[0]
    finally:
        gc.set_threshold(*gc_threshold)
    n_arr = len(trace)
    if per_replica:
        for r in replicas:
            for k, v in r.itl_hist.items():
                itl_all[k] = itl_all.get(k, 0) + v

    makespan = t_now
    wall = time.perf_counter() - wall0
    q = sum(r.mgr.prefix_cache_stats.queries for r in replicas)
    h = sum(r.mgr.prefix_cache_stats.hits for r in replicas)
    n_done = len(e2e_all)
    summary = {
        "num_replicas": num_replicas, "policy": policy, "num_requests": n_arr, "num_completed": n_done,
        "num_rejected": num_rejected, "num_output_tokens": total_out,
        "simulated_s": round(makespan, 6),
        "output_throughput_tok_s": total_out / makespan if makespan > 0 else 0.0,
        "request_throughput_req_s": n_done / makespan if makespan > 0 else 0.0,
        "ttft_ms": _to_ms(_percentiles(ttft_all)), "itl_ms": _to_ms(_hist_percentiles(itl_all)),
        "e2e_ms": _to_ms(_percentiles(e2e_all)),
        "prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": h / q if q else 0.0,
        "kv_usage_mean": (sum(r.usage_time for r in replicas) / (makespan * num_replicas)) if makespan > 0 else 0.0,
        "kv_usage_peak": max(r.peak_usage for r in replicas),
        "num_steps": sum(r.num_steps for r in replicas),
        "num_preemptions": sum(r.sched.num_preemptions_total for r in replicas),
        "prefix_routed": router.num_prefix_routed,
        "same_replica_as_previous_turn": affinity[1] / affinity[0] if affinity[0] else None,
        "wall_s": round(wall, 3),
        "config": {**cfg.__dict__, "balance_abs_threshold": balance_abs_threshold, "seed": seed,
                   "step_model": {k: getattr(step_model, k) for k in COEFFICIENTS}},
    }
    reps: list[dict] = []
    if per_replica:
        for r in replicas:
            st = r.mgr.prefix_cache_stats
            reps.append({
                "replica": r.index, "num_requests": r.num_requests, "num_output_tokens": r.num_output_tokens,
                "num_steps": r.num_steps, "busy_fraction": r.busy_s / makespan if makespan > 0 else 0.0,
                "ttft_ms": _to_ms(_percentiles(r.ttft)), "itl_ms": _to_ms(_hist_percentiles(r.itl_hist)),
                "e2e_ms": _to_ms(_percentiles(r.e2e)),
                "prefix_cache_hit_rate": st.hit_rate, "prefix_cache_queries": st.queries,
                "kv_usage_mean": r.usage_time / makespan if makespan > 0 else 0.0, "kv_usage_peak": r.peak_usage,
                "num_preemptions": r.sched.num_preemptions_total})
    return SimResult(summary, reps, steps, token_times, router, replicas)
