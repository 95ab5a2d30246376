"""``run-batch`` lines for the pooling endpoints (/v1/embeddings, /v1/score, /rerank) on a tiny
embedding model: each record's body is what the server answers for the same request (the
embeddings equal the offline ``LLM.embed`` vectors), a generation-only url is an error record."""
from __future__ import annotations

import argparse
import asyncio
import json

import torch

from pagedllm import LLM
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.run_batch import run_batch

KW = dict(dtype="float32", kv_cache_memory=16 * 1024**2, num_threads=1, max_model_len=64, runner="pooling",
          convert="embed")


def test_run_batch_embeddings_and_score(tiny_llama_causal, tmp_path):
    texts = ["red apples", "green pears and oranges"]
    lines = [
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": texts}},
        {"custom_id": "s", "method": "POST", "url": "/v1/score", "body": {"text_1": texts[0], "text_2": texts}},
        {"custom_id": "r", "method": "POST", "url": "/rerank", "body": {"query": texts[0], "documents": texts}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ref = [o.outputs.data for o in LLM(tiny_llama_causal, **KW).embed(texts, use_tqdm=False)]
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama_causal, **KW))
    ns = argparse.Namespace(input_file=str(inp), output_file=str(out), output_tmp_dir=None, progress=False,
                            served_model_name=["tiny"], disable_log_requests=True, disable_log_stats=True)
    try:
        counts = asyncio.run(run_batch(engine, ns))
    finally:
        engine.shutdown()
    assert counts["ok"] == 3 and counts["errors"] == 2
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in recs] == ["e", "s", "r", "c", "bad"]
    emb = recs[0]["response"]["body"]["data"]
    for d, v in zip(emb, ref):
        torch.testing.assert_close(torch.tensor(d["embedding"]), v.float(), rtol=1e-4, atol=1e-5)
    scores = [d["score"] for d in recs[1]["response"]["body"]["data"]]
    cos = [float(torch.nn.functional.cosine_similarity(ref[0], v, dim=0)) for v in ref]
    assert abs(scores[0] - cos[0]) < 1e-4 and abs(scores[1] - cos[1]) < 1e-4
    assert [x["index"] for x in recs[2]["response"]["body"]["results"]][0] == 0  # itself ranks first
    assert recs[3]["response"]["status_code"] == 400 and recs[3]["error"]["error"]["param"] == "model"
    assert recs[4]["response"]["status_code"] == 400 and recs[4]["response"]["body"] is None
