"""Wall time of one simulation (``benchmarks/sim_scale.py``'s workload): python benchmarks/sim_speed.py REPLICAS POLICY [timers]
prints one JSON line (with ``timers``: the scheduler's microseconds a call). NOFREEZE=1: without gc.freeze()."""
import gc
import json
import os
import sys
import time

import pagedllm
from pagedllm.sim.simulator import ReplicaConfig, simulate
from pagedllm.sim.step_model import StepModel
from pagedllm.sim.trace import synthetic_trace

if os.environ.get("NOFREEZE"):
    gc.freeze = lambda: None
n, pol, timers = int(sys.argv[1]), sys.argv[2], len(sys.argv) > 3
model = StepModel.load(os.path.join(os.path.dirname(os.path.abspath(pagedllm.__file__)), "sim", "step_model_default.json"))
eng = model.engine
cfg = ReplicaConfig(num_blocks=int(eng["num_blocks"]), block_size=int(eng["block_size"]),
                    max_num_seqs=int(eng["max_num_seqs"]), max_num_batched_tokens=int(eng["max_num_batched_tokens"]),
                    max_model_len=int(eng["max_model_len"]))
t0 = time.perf_counter()
tr = synthetic_trace("multi-turn", rate=0.1 * n, duration_s=600, seed=0)
gen = time.perf_counter() - t0
acc = {"schedule": [0.0, 0], "update_from_output": [0.0, 0]}
if timers:
    from pagedllm.core.scheduler import Scheduler
    pc = time.perf_counter
    for name in acc:
        orig = getattr(Scheduler, name)
        def wrap(self, *a, _o=orig, _c=acc[name]):
            t = pc()
            r = _o(self, *a)
            _c[0] += pc() - t
            _c[1] += 1
            return r
        setattr(Scheduler, name, wrap)
s = simulate(tr, n, pol, model, cfg, per_replica=False).summary
out = {"code": os.path.dirname(os.path.dirname(pagedllm.__file__)), "replicas": n, "policy": pol, "requests": len(tr),
       "steps": s["num_steps"], "wall_s": s["wall_s"], "gen_s": round(gen, 2), "hit": round(s["prefix_cache_hit_rate"], 4),
       "ttft_mean": s["ttft_ms"]["mean"], "load": os.getloadavg()[0], "nofreeze": bool(os.environ.get("NOFREEZE"))}
if timers:
    out.update({f"{k}_us_per_call": round(v[0] / max(v[1], 1) * 1e6, 2) for k, v in acc.items()})
    out.update({f"{k}_s": round(v[0], 2) for k, v in acc.items()})
print(json.dumps(out), flush=True)
