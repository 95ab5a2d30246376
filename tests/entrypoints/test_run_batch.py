"""``pagedllm run-batch`` (the OpenAI batch file format, vLLM's ``run-batch``): per-line results in
input order, per-line errors as the server writes them (a bad line never stops the batch),
resumption of a half-written output file (torn last line dropped, finished custom_ids skipped);
on a tiny random Llama with SmolLM2's tokenizer in-process, and end to end through the CLI on
the real SmolLM2."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.run_batch import read_existing_output, run_batch

KW = dict(dtype="float32", kv_cache_memory=32 * 1024**2, num_threads=1, max_model_len=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path):
    """A tiny random Llama (hidden 64, 2 layers) with SmolLM2's tokenizer and chat template."""
    import transformers as tf

    from pagedllm.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    d = str(tmp_path_factory.mktemp("batch_tiny"))
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    torch.manual_seed(3)
    tf.LlamaForCausalLM(cfg).float().eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _lines():
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_completion_tokens": 5, "temperature": 0}
    return [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The sky is", "max_tokens": 6, "temperature": 0}},
        "this line is not JSON",
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
        {"custom_id": "d", "method": "POST", "url": "/v1/images", "body": {}},
        {"custom_id": "e", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 2, "stream": True}},
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "dup"}},
        {"custom_id": "f", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no id"}},
        {"custom_id": "g", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "model": "nope"}},
    ]


def _write(path, lines):
    with open(path, "w") as f:
        for x in lines:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")


def _records(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def _run(model_dir, inp, out):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **KW))
    ns = argparse.Namespace(input_file=str(inp), output_file=str(out), output_tmp_dir=None, progress=False,
                            served_model_name=["tiny"], disable_log_requests=True, disable_log_stats=True)
    try:
        return asyncio.run(run_batch(engine, ns))
    finally:
        engine.shutdown()


def _check(recs, ref_b):
    assert [r["custom_id"] for r in recs] == ["a", "b", None, "c", "d", "e", "a", "f", None, "g"]
    status = [r["response"]["status_code"] for r in recs]
    assert status == [200, 200, 400, 400, 400, 400, 400, 400, 400, 404]
    for r in recs:
        assert r["id"].startswith("pagedllm-") and r["response"]["request_id"].startswith("pagedllm-batch-")
        assert (r["error"] is None) == (r["response"]["body"] is not None)
    a, b = recs[0]["response"]["body"], recs[1]["response"]["body"]
    assert a["object"] == "chat.completion" and a["usage"]["completion_tokens"] == 5
    assert b["object"] == "text_completion" and b["choices"][0]["text"] == ref_b
    params = [r["error"]["error"]["param"] for r in recs[2:]]
    assert params == [None, "max_tokens", "url", "stream", "custom_id", "model", "custom_id", "model"], params
    assert "not valid JSON" in recs[2]["error"]["error"]["message"]
    assert "does not exist" in recs[9]["error"]["error"]["message"]  # as the server answers it
    assert recs[3]["error"]["error"]["type"] == "BadRequestError"


def test_run_batch_records_and_resume(tiny_dir, tmp_path):
    from pagedllm import LLM, SamplingParams

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, _lines())
    ref_b = LLM(tiny_dir, **KW).generate("The sky is", SamplingParams(max_tokens=6, temperature=0),
                                         use_tqdm=False)[0].outputs[0].text
    counts = _run(tiny_dir, inp, out)
    assert counts == {"total": 10, "skipped": 0, "ok": 2, "errors": 8}
    recs = _records(out)
    _check(recs, ref_b)

    # a run killed while writing its 5th line: the first four kept as they are, the torn one redone
    with open(out) as f:
        full = f.readlines()
    with open(out, "w") as f:
        f.writelines(full[:4])
        f.write(full[4][:17])
    kept, done, nulls = read_existing_output(str(out))
    assert len(kept) == 4 and done == {"a": 1, "b": 1, "c": 1} and nulls == 1
    counts = _run(tiny_dir, inp, out)
    assert counts == {"total": 10, "skipped": 4, "ok": 0, "errors": 6}
    again = _records(out)
    _check(again, ref_b)
    assert [r["id"] for r in again[:4]] == [r["id"] for r in recs[:4]]  # not rerun
    # a finished file: nothing runs
    assert _run(tiny_dir, inp, out)["skipped"] == 10 and len(_records(out)) == 10
    # a record missing from the middle (and another's line moved): the rerun one goes back to its
    # input position, the file ends in input order
    with open(out) as f:
        full = f.readlines()
    with open(out, "w") as f:
        f.writelines(full[:4] + full[5:])
    counts = _run(tiny_dir, inp, out)
    assert counts == {"total": 10, "skipped": 9, "ok": 0, "errors": 1}
    third = _records(out)
    _check(third, ref_b)
    assert [r["id"] for i, r in enumerate(third) if i != 4] == [r["id"] for i, r in enumerate(again) if i != 4]


@pytest.mark.slow
def test_run_batch_cli_real_model(tmp_path):
    """``pagedllm run-batch`` on the default SmolLM2 with a bad line, then resumed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [
        {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is 2+2?"}],
                  "max_completion_tokens": 12, "temperature": 0}},
        '{"custom_id": "broken", "method": "POST", "url": ',
        {"custom_id": "q2", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}},
        {"custom_id": "q3", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 8, "temperature": -1}},
    ])
    env = dict(os.environ, PAGEDLLM_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(inp), "-o", str(out),
           "--model", "SmolLM2-135M-Instruct", "--max-model-len", "512", "--kv-cache-memory", str(64 * 1024**2)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Running batch" in p.stderr  # the progress bar
    recs = _records(out)
    assert [r["custom_id"] for r in recs] == ["q1", None, "q2", "q3"]
    assert [r["response"]["status_code"] for r in recs] == [200, 400, 200, 400]
    assert recs[0]["response"]["body"]["choices"][0]["message"]["content"].strip()
    assert "Paris" in recs[2]["response"]["body"]["choices"][0]["text"]
    assert recs[3]["error"]["error"]["param"] == "temperature"
    with open(out, "a") as f:  # torn extra line
        f.write('{"id": "pagedllm-x", "custom_')
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "0 request(s) written" in p.stdout and "4 already there" in p.stdout, p.stdout
    assert _records(out) == recs
    p = subprocess.run(cmd[:-6] + ["-i", str(tmp_path / "missing.jsonl")], env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "no such file" in p.stderr
