"""The hit-rate ceiling and floor of a recorded multi-turn chat trace (no simulation): what share of
its prompt tokens a policy can serve from the prefix cache if every later turn lands on the replica
holding its history (the ceiling), if none does (the shared system prompt only: the floor), and the
linear mix for a share p of later turns on their history's replica (no evictions).

    python benchmarks/router_ceiling.py [TRACE]   # default: run E's trace (router_bench --save-trace)
"""
import sys

from pagedllm.sim.trace import load_trace

path = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/router-chat-trace-2026-12-01-16conv.jsonl"
tr = load_trace(path)
bs = 16
by = {}
for r in tr:
    by.setdefault(r.conversation_id, []).append(r)
tot = hist_hit = sys_hit = 0
def common_blocks(a, b):
    k = 0
    while (k + 1) * bs <= min(len(a), len(b)) and a[k * bs:(k + 1) * bs] == b[k * bs:(k + 1) * bs]:
        k += 1
    return k
first = [v[0].prompt_token_ids for v in by.values()]
# system prompt: the common block prefix of all first turns
sp = min(common_blocks(first[0], f) for f in first[1:])
n_turns = 0
for turns in by.values():
    turns.sort(key=lambda r: int(r.request_id.rsplit("-",1)[1]))
    for k, r in enumerate(turns):
        p = r.prompt_token_ids
        cap = (len(p) - 1) // bs  # the engine recomputes at least the last token
        tot += len(p)
        n_turns += 1
        s = min(sp, cap)
        sys_hit += s * bs
        if k == 0:
            hist_hit += s * bs
        else:
            prev = turns[k-1]
            full = list(prev.prompt_token_ids) + list(prev.output_token_ids or [])
            hist_hit += max(s, min(common_blocks(p, full), cap)) * bs
print(f"turns {n_turns}, prompt tokens {tot}, system prompt {sp} blocks ({sp*bs} tokens)")
print(f"ceiling (every turn on its history's replica, system prompt hit on every first turn): {hist_hit/tot:.3f}")
print(f"floor (no turn finds its history; system prompt only): {sys_hit/tot:.3f}")
for p in (0.5, 0.55, 0.6, 0.62, 0.7):
    ll = p*hist_hit/tot + (1-p)*sys_hit/tot
    print(f"least-load if a share {p} of later turns lands on the history's replica (no evictions): {ll:.3f}; ceiling/that = {hist_hit/tot/ll:.2f}")
