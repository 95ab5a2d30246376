"""The GemmaDecision recipe exactly as its users run it on vLLM: the encoder directory written
by ``examples/export_gemma_encoder.py``, served with the recipe's command line, queried with
explicit token ids by the example client; the raw vectors are compared with transformers'
last hidden state of the same directory (fp32).

Tolerances: fp32 serving, elementwise ``|ours - ref| <= 1e-5 * |ref| + 1e-5 * max|ref|``. bf16
serving (the recipe's ``--dtype bfloat16``): transformers' own bf16 forward differs from its fp32
one by ~1.4% in relative L2 norm on these vectors (measured), so an elementwise 1e-3 is
unreachable for any bf16 engine; the check is on what the recipe's head consumes, the
L2-normalised vector: cosine distance ``1 - cos <= 1e-3`` (measured ~1e-4), and the raw norm
within 3% (the vector is not normalised: its norm is in the hundreds).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.slow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_loader import load_example  # noqa: E402

# The recipe's serve flags, verbatim (--gpu-memory-utilization is CUDA-only: accepted, ignored on CPU).
RECIPE_FLAGS = ["--runner", "pooling", "--convert", "embed", "--dtype", "bfloat16", "--pooler-config",
                '{"pooling_type":"LAST","use_activation":false}', "--max-model-len", "3072",
                "--gpu-memory-utilization", "0.20"]
TEXTS = [
    "State: The kettle is on the stove and the water is boiling.\nQuestion: What should be done next?\n"
    "Candidate: Pour the boiling water into the mug.",
    "State: A door is locked.\nQuestion: How to get in?\nCandidate: Use the key.",
    "Hi",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir: str, flags: list[str], log_path: str):
    port = _free_port()
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir,
                             *flags, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + open(log_path).read()[-4000:])
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start:\n" + open(log_path).read()[-4000:])


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def reference(gemma_encoder_dir):
    """(token-id lists, fp32 last hidden states [T, 640] per input) from transformers loading the
    exported directory itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_encoder_dir)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert all(i[0] == tok.bos_token_id for i in ids)
    hf = AutoModelForCausalLM.from_pretrained(gemma_encoder_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = [hf.model(torch.tensor([i])).last_hidden_state[0].float() for i in ids]
    del hf
    return ids, hs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_recipe_serve_command_returns_raw_vectors(gemma_encoder_dir, reference, dtype, tmp_path):
    ex = load_example("rank_with_gemma_encoder")
    ids, hs = reference
    flags = list(RECIPE_FLAGS)
    flags[flags.index("bfloat16")] = dtype
    proc, base = _serve(gemma_encoder_dir, flags + ["--disable-log-stats"], str(tmp_path / "server.log"))
    try:
        vecs = ex.embed_http(base, ids)  # explicit token ids, base64 float32
        assert vecs.dtype == torch.float32 and vecs.shape == (len(ids), 640)
        r = httpx.get(base + "/v1/models").json()["data"][0]
        assert r["max_model_len"] == 3072
        for v, h in zip(vecs, hs):
            ref = h[-1]
            assert float(ref.norm()) > 10  # a raw hidden state, far from unit norm
            if dtype == "float32":
                torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
            else:
                cos = float(F.cosine_similarity(v, ref, dim=0))
                assert 1 - cos <= 1e-3, (cos, dtype)
                assert abs(float(v.norm() / ref.norm()) - 1) <= 0.03
        # the client's head (fp32: L2-normalise, LayerNorm -> Linear -> GELU -> Linear) on the served
        # vectors against the same head on transformers' vectors
        head_path = str(tmp_path / "head.safetensors")
        ex.write_random_head(head_path, hidden=640, inner=64, seed=5)
        head = ex.load_head(head_path)
        got = ex.head_scores(vecs, head)
        want = ex.head_scores(torch.stack([h[-1] for h in hs]), head)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if dtype == "float32" else 5e-2)
    finally:
        _stop(proc)
