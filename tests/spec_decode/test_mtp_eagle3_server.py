"""`pagedllm serve --speculative-config '{"method": "mtp" | "eagle3", ...}'` on the tiny Gemma 3
target with random drafters: greedy completions equal the offline non-speculative engine's,
/metrics carries the per-method acceptance gauges, and a drafter that does not fit the target
stops start-up with a message naming the field."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from server_helpers import serve

from pagedllm import LLM, SamplingParams

from spec_helpers import write_eagle3_head, write_mtp_head

PROMPTS = ["w5 w9 w11 w5 w9 w11 w5", "w40 w41 w7 w3 w40 w41"]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_serve_completions_equal_offline_and_metrics(tiny_gemma3_dir, tmp_path, method):
    write = write_mtp_head if method == "mtp" else write_eagle3_head
    kw = {} if method == "mtp" else {"aux": (0, 2, 3)}
    head = write(str(tmp_path / method), tiny_gemma3_dir, seed=8, **kw)
    spec = {"method": method, "model": head, "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    base = LLM(tiny_gemma3_dir, dtype="float32", num_threads=1, max_model_len=256)
    ref = [o.outputs[0].text for o in base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True), use_tqdm=False)]
    with serve([tiny_gemma3_dir, "--dtype", "float32", "--max-model-len", "256", "--disable-log-stats",
                "--speculative-config", json.dumps(spec)]) as (url, _):
        for p, want in zip(PROMPTS, ref):
            r = httpx.post(url + "/v1/completions", json={"model": tiny_gemma3_dir, "prompt": p, "max_tokens": 24,
                                                         "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        text = httpx.get(url + "/metrics").text
    m = re.search(rf'^pagedllm:spec_decode_method_mean_acceptance_length{{.*method="{method}".*}} (\S+)$', text, re.M)
    assert m and float(m.group(1)) >= 1.0
    assert float(re.search(r"^pagedllm:spec_decode_num_drafts_total\{.*\} (\S+)$", text, re.M).group(1)) > 0


def test_bad_drafter_stops_start_up(tiny_gemma3_dir, tmp_path):
    head = write_mtp_head(str(tmp_path / "bad"), tiny_gemma3_dir, seed=9)
    with open(f"{head}/config.json") as f:
        cfg = json.load(f)
    cfg["backbone_hidden_size"] = 48
    with open(f"{head}/config.json", "w") as f:
        json.dump(cfg, f)
    spec = json.dumps({"method": "mtp", "model": head, "num_speculative_tokens": 2})
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_gemma3_dir, "--dtype",
                           "float32", "--speculative-config", spec], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "backbone_hidden_size" in proc.stdout + proc.stderr
