"""Process memory readings for /metrics and the periodic log line (Linux ``/proc``)."""
from __future__ import annotations

import os
from typing import Optional


def resident_memory_bytes(pid: Optional[int] = None) -> int:
    """Resident set size of process ``pid`` (default: this one) in bytes.

    Source: the second field of ``/proc/<pid>/statm`` (resident pages) times the page size,
    the figure ``ps``/``top`` report as RSS. Returns 0 where ``/proc`` is unavailable.
    """
    path = f"/proc/{pid if pid is not None else 'self'}/statm"
    try:
        with open(path) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def anon_resident_bytes() -> int:
    """This process's resident anonymous memory in bytes (``RssAnon`` of ``/proc/self/status``,
    proc(5); kB x 1024): heap and anonymous mmaps such as the KV cache, without file-backed pages.

    Raises:
        RuntimeError: the kernel reports no ``RssAnon`` (not Linux, or before 4.5).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def read_meminfo() -> dict[str, int]:
    """``/proc/meminfo`` (proc(5)) in bytes: ``{"MemTotal": ..., "MemAvailable": ..., ...}``
    (its ``kB`` figures x 1024); empty where the file is unavailable."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        return {}
    return out


def format_bytes(n: float) -> str:
    """``1.23 GiB`` / ``456.7 MiB`` (binary units)."""
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"


_ARENA_SPAN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: each thread arena reserves 64 MiB


def smaps_breakdown(pid: Optional[int] = None) -> dict[str, int]:
    """Resident bytes of process ``pid`` (default: this one) by kind of mapping, from
    ``/proc/<pid>/smaps`` (proc(5)), for finding where resident memory goes.

    Keys (bytes of ``Rss``): ``heap`` (glibc's main arena, ``[heap]``), ``arenas`` (anonymous
    mappings that glibc's thread arenas reserve, a 64 MiB-aligned span of at most 64 MiB),
    ``stacks`` (``[stack]`` and thread stacks: anonymous mappings right after a guard page),
    ``kv`` (anonymous mappings flagged ``nr`` and ``nh`` in ``VmFlags``: MAP_NORESERVE and
    MADV_NOHUGEPAGE, as ``worker.kv_memory.new_kv_cache`` maps the lazily committed KV caches),
    ``anon_other`` (other anonymous mappings: the caching CPU allocator's blocks, torch's and
    Python's large buffers), ``weights`` (``*.pwm`` mapped weight files and ``*.gguf`` /
    ``*.safetensors`` mappings), ``libs`` (``*.so*`` text and data), ``file_other`` (other
    file-backed pages), ``total`` (the sum, = VmRSS up to rounding). Heuristic by design: the
    kernel merges adjacent mappings of equal flags, so e.g. allocator blocks and large malloc
    chunks both land in ``anon_other``. Empty where the file is unavailable.
    """
    path = f"/proc/{pid if pid is not None else 'self'}/smaps"
    out = dict.fromkeys(("heap", "arenas", "stacks", "kv", "anon_other", "weights", "libs", "file_other"), 0)
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    maps: list[list] = []  # [start, end, perms, name, rss, vmflags]
    for line in lines:
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            a, _, b = head[0].partition("-")
            try:
                maps.append([int(a, 16), int(b, 16), head[1], head[5] if len(head) > 5 else "", 0, ""])
            except ValueError:
                continue
        elif line.startswith("Rss:") and maps:
            maps[-1][4] = int(line.split()[1]) * 1024
        elif line.startswith("VmFlags:") and maps:
            maps[-1][5] = line
    for i, (start, end, perms, name, rss, flags) in enumerate(maps):
        if not rss:
            continue
        prev = maps[i - 1] if i else None
        if name == "[heap]":
            key = "heap"
        elif name == "[stack]":
            key = "stacks"
        elif name.startswith("["):
            key = "file_other"
        elif name:
            base = name.rsplit("/", 1)[-1]
            if base.endswith((".pwm", ".gguf", ".safetensors")):
                key = "weights"
            elif ".so" in base:
                key = "libs"
            else:
                key = "file_other"
        elif " nr" in flags and " nh" in flags:
            key = "kv"
        elif start % _ARENA_SPAN == 0 and end - start <= _ARENA_SPAN and "rw" in perms:
            key = "arenas"
        elif prev is not None and prev[1] == start and prev[2].startswith("---") and prev[1] - prev[0] <= 64 << 10:
            key = "stacks"
        else:
            key = "anon_other"
        out[key] += rss
    out["total"] = sum(out.values())
    return out


# A step whose scheduled tokens exceed its requests by this many (a prefill chunk, not decode or
# a few speculative tokens) leaves a prefill-sized workspace in the allocator's cache.
WORKSPACE_BIG_STEP_TOKENS = 256
# What the caching CPU allocator may keep after the first decode-sized step that follows a
# prefill-sized one (largest blocks go first): decode reuses blocks of its own size.
WORKSPACE_KEEP_BYTES = 32 << 20


class WorkspaceTrimmer:
    """Bound the resident workspace a long prompt leaves behind (issue 30.4).

    A prefill chunk of ``max_num_batched_tokens`` tokens frees tens to hundreds of MiB of
    temporaries (projections, MLP activations, attention blocks) into the caching CPU allocator
    (``kernels/csrc/cpu_allocator.cpp``, up to ``PAGEDLLM_CPU_ALLOCATOR_CACHE``) and glibc's heap.
    Those stay useful while prefill chunks follow one another (no page faults between chunks),
    but once the batch is decode-only they are dead weight until the next long prompt. ``step``
    is told each step's token counts; on the first decode-sized step after a prefill-sized one it
    trims the allocator's free blocks to ``WORKSPACE_KEEP_BYTES`` (largest first) and returns
    glibc's free heap (``malloc_trim``). Cost: the next prefill chunk re-faults its workspace
    once (~0.4 s/GB of page faults; ~30 ms for SmolLM2's ~80 MiB at 2,048 tokens).

    Bound: between prompts, the allocator's cache holds at most ``WORKSPACE_KEEP_BYTES`` plus
    what the decode steps since the trim freed (``pagedllm:cpu_allocator_cached_bytes``);
    during prefill it is bounded by one chunk's workspace (``max_num_batched_tokens``), not by
    the prompt's length. ``PAGEDLLM_CPU_ALLOCATOR=0`` (torch's allocator): only the heap trim.
    """

    def __init__(self, big_step_tokens: int = WORKSPACE_BIG_STEP_TOKENS,
                 keep_bytes: int = WORKSPACE_KEEP_BYTES) -> None:
        self.big_step_tokens = int(big_step_tokens)
        self.keep_bytes = int(keep_bytes)
        self.dirty = False  # a prefill-sized step ran since the last trim
        self.trims = 0
        #: bytes of free allocator blocks the trims have given back so far (a running total)
        self.trimmed_bytes = 0

    def step(self, num_tokens: int, num_requests: int) -> bool:
        """Record a finished step of ``num_tokens`` scheduled tokens over ``num_requests``
        requests; trim when it is decode-sized and a prefill-sized step came before. Returns
        whether it trimmed."""
        if num_tokens - num_requests >= self.big_step_tokens:
            self.dirty = True
            return False
        if not self.dirty:
            return False
        self.dirty = False
        self.trim()
        return True

    def trim(self, keep_bytes: Optional[int] = None) -> None:
        """Trim the caching CPU allocator's free blocks to ``keep_bytes`` (default: this trimmer's
        ``keep_bytes``; 0 = all of them, as when a server's batch empties) and glibc's heap now."""
        from pagedllm.kernels.cpu_ops import cpu_allocator_stats, get_ops
        from pagedllm.platforms import trim_heap

        keep = self.keep_bytes if keep_bytes is None else max(0, int(keep_bytes))
        st = cpu_allocator_stats()
        if st and st.get("cached_bytes", 0) > keep:
            ops = get_ops()
            # NOTE: install_cpu_allocator on an installed allocator only sets its limits, and
            # lowering the cap frees cached blocks down to it (largest first); the cap is then
            # restored so decode keeps reusing its own blocks.
            huge = bool(st.get("huge_pages", 0))
            ops.install_cpu_allocator(int(st["min_bytes"]), keep, huge)
            ops.install_cpu_allocator(int(st["min_bytes"]), int(st["max_cached_bytes"]), huge)
            self.trimmed_bytes += max(0, int(st["cached_bytes"]) - int(cpu_allocator_stats().get("cached_bytes", 0)))
        trim_heap()
        self.trims += 1
