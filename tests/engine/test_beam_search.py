"""Beam search (issue 37.3): ``LLM.beam_search`` against transformers' ``generate(num_beams=...)``
on the same random weights (``ignore_eos`` and a fixed ``max_tokens``, where both definitions
agree), against a reference of vLLM's algorithm with EOS (length penalties), block sharing
through the prefix cache, errors, and ``use_beam_search`` on /v1/completions and
/v1/chat/completions."""
from __future__ import annotations

import os
import sys

import copy

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_llama_ckpt import write_tiny_llama  # noqa: E402

EOS = 2
PROMPTS = [[1, 5, 6, 7, 8], [1] + list(range(20, 60)), [1, 200, 201]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers model, LLM) of one tiny random Llama, float32."""
    from pagedllm import LLM

    d = str(tmp_path_factory.mktemp("beam_tiny"))
    hf = write_tiny_llama(d, seed=0)
    llm = LLM(d, kv_cache_memory="16MiB", dtype="float32", block_size=16)
    return d, hf, llm


def _hf_beams(hf, prompt, bw, n, lp, early_stopping):
    # NOTE: transformers' way of ignore_eos: no EOS, so no hypothesis ends early. On a copy of the
    # generation config: ``hf`` may be the session's shared transformers reference (hf_smollm2),
    # whose other users' greedy references must keep ending at EOS.
    cfg = copy.deepcopy(hf.generation_config)
    cfg.eos_token_id = None
    g = hf.generate(torch.tensor([prompt]), generation_config=cfg, num_beams=bw, num_return_sequences=bw, do_sample=False,
                    max_new_tokens=n, min_new_tokens=n, length_penalty=lp, early_stopping=early_stopping,
                    output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    seqs = [s[len(prompt):].tolist() for s in g.sequences]
    if bw == 1:  # NOTE: transformers runs greedy search then (its scores: the logits of each step)
        return seqs, [sum(float(torch.log_softmax(sc[0].float(), -1)[t]) for sc, t in zip(g.scores, seqs[0]))]
    # transformers divides by the generated length: its score x n**lp is the cumulative logprob
    cums = [float(x) * n ** lp for x in g.sequences_scores]
    return seqs, cums


@pytest.mark.parametrize("bw,n,lp,early_stopping", [(2, 6, 1.0, True), (3, 8, 0.0, False), (4, 5, 2.0, "never"),
                                                    (1, 7, 1.0, True)])
def test_ignore_eos_equals_transformers(tiny, bw, n, lp, early_stopping):
    from pagedllm import BeamSearchOutput, BeamSearchParams, BeamSearchSequence

    _, hf, llm = tiny
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=bw, max_tokens=n, ignore_eos=True, length_penalty=lp))
    assert len(outs) == len(PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert isinstance(o, BeamSearchOutput) and len(o.sequences) == bw
        assert all(isinstance(s, BeamSearchSequence) for s in o.sequences)
        seqs, cums = _hf_beams(hf, p, bw, n, lp, early_stopping)
        assert [s.tokens[len(p):] for s in o.sequences] == seqs
        assert all(s.tokens[:len(p)] == p for s in o.sequences)
        assert [s.cum_logprob for s in o.sequences] == pytest.approx(cums, abs=2e-4)
        for s in o.sequences:
            assert len(s.logprobs) == n and all(len(d) >= 2 * bw for d in s.logprobs)
            assert s.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(s.logprobs, s.tokens[len(p):])))
            assert s.text == llm.get_tokenizer().decode(s.tokens)
            assert s.finish_reason == "length"


def _reference(hf, prompt, bw, n, lp, ignore_eos, eos=EOS):
    """vLLM's beam search on transformers' logits (full forward per beam, no cache)."""
    beams, done = [(list(prompt), 0.0)], []
    with torch.no_grad():
        for _ in range(n):
            cands = []
            for toks, cum in beams:
                lps = torch.log_softmax(hf(torch.tensor([toks])).logits[0, -1].float(), -1)
                top = torch.topk(lps, 2 * bw)
                for t, v in zip(top.indices.tolist(), top.values.tolist()):
                    (done if t == eos and not ignore_eos else cands).append((toks + [t], cum + v))
            beams = sorted(cands, key=lambda x: -x[1])[:bw]
            if not beams:
                break

    def score(x):
        toks, cum = x
        return cum / ((len(toks) - (toks[-1] == eos)) ** lp)
    return sorted(done + beams, key=score, reverse=True)[:bw]


@pytest.fixture(scope="module")
def eosy(tmp_path_factory):
    """A tiny model whose EOS logit is boosted (beams finish early)."""
    from pagedllm import LLM

    d = str(tmp_path_factory.mktemp("beam_eos"))
    hf = write_tiny_llama(d, seed=1, eos_boost=6.0)
    return hf, LLM(d, kv_cache_memory="16MiB", dtype="float32")


@pytest.mark.parametrize("lp", [0.0, 1.0, 2.5])
def test_with_eos_equals_vllm_algorithm(eosy, lp):
    from pagedllm import BeamSearchParams

    hf, llm = eosy
    bw, n = 3, 6
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=bw, max_tokens=n, length_penalty=lp))
    ended = 0
    for p, o in zip(PROMPTS, outs):
        ref = _reference(hf, p, bw, n, lp, ignore_eos=False)
        assert [s.tokens for s in o.sequences] == [t for t, _ in ref]
        assert [s.cum_logprob for s in o.sequences] == pytest.approx([c for _, c in ref], abs=2e-4)
        for s in o.sequences:
            if s.tokens[-1] == EOS:
                ended += 1
                assert s.finish_reason == "stop" and s.stop_reason == EOS
    assert ended > 0  # the EOS path was taken


def test_prompt_blocks_shared_through_prefix_cache(tiny):
    """Each step's beam requests hit the prompt's full blocks in the prefix cache."""
    from pagedllm import BeamSearchParams

    _, _, llm = tiny
    llm.reset_prefix_cache()
    sched = llm.llm_engine.core.scheduler
    q0, h0 = sched.prefix_cache_queries, sched.prefix_cache_hits
    prompt = [1] + list(range(10, 60))  # 51 tokens: 3 full blocks of 16
    bw, n = 3, 4
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=bw, max_tokens=n, ignore_eos=True))
    hits = sched.prefix_cache_hits - h0
    # step 1: one request (no hit); steps 2..n: bw requests each, each hitting the 3 full blocks
    assert hits >= (n - 1) * bw * 48, (hits, sched.prefix_cache_queries - q0)


def test_beam_search_inputs_and_errors(tiny):
    from pagedllm import BeamSearchParams

    _, _, llm = tiny
    a = llm.beam_search("w1 w2 w3", BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    ids = llm.get_tokenizer()("w1 w2 w3")["input_ids"]
    b = llm.beam_search([ids], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert [s.tokens for s in a[0].sequences] == [s.tokens for s in b[0].sequences]
    with pytest.raises(ValueError, match="beam_width: 11 needs 22 candidate logprobs"):
        llm.beam_search(["w1"], BeamSearchParams(beam_width=11, max_tokens=2))
    for bad in (dict(beam_width=0, max_tokens=2), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=2, temperature=-1.0)):
        with pytest.raises(ValueError, match=next(iter(k for k in ("beam_width", "max_tokens", "temperature")
                                                       if bad.get(k, 1) in (0, -1.0)))):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="prompt index 1"):
        llm.beam_search(["w1", {"prompt_token_ids": [999]}], BeamSearchParams(beam_width=2, max_tokens=2))


# ------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def client(tiny):
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    d = tiny[0]
    args = make_arg_parser().parse_args([])
    args.api_key, args.disable_log_requests, args.disable_log_stats = None, True, True
    engine = AsyncLLM(EngineArgs(model=d, kv_cache_memory="16MiB", dtype="float32",
                                 chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"))
    with TestClient(build_app(engine, args)) as c:
        yield c
    engine.shutdown()


def test_completions_use_beam_search_equals_offline(tiny, client):
    from pagedllm import BeamSearchParams

    _, _, llm = tiny
    tok = llm.get_tokenizer()
    prompt = "w5 w6 w7 w8"
    for lp in (1.0, 0.5):
        r = client.post("/v1/completions", json={"prompt": prompt, "use_beam_search": True, "n": 3, "max_tokens": 5,
                                                 "temperature": 0, "ignore_eos": True, "length_penalty": lp,
                                                 "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        off = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=lp))
        plen = len(tok(prompt)["input_ids"])
        assert [c["token_ids"] for c in body["choices"]] == [s.tokens[plen:] for s in off[0].sequences]
        assert [c["text"] for c in body["choices"]] == [tok.decode(s.tokens[plen:]) for s in off[0].sequences]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"]["completion_tokens"] == 15


def test_completions_beam_search_stream_and_eos(client):
    base = {"prompt": "w5 w6 w7 w8", "use_beam_search": True, "n": 2, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=base).json()
    with client.stream("POST", "/v1/completions", json={**base, "stream": True}) as r:
        assert r.status_code == 200
        import json as _json
        chunks = [_json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got = {}
    for ch in chunks:
        for c in ch["choices"]:
            got[c["index"]] = got.get(c["index"], "") + c["text"]
    assert [got[i] for i in sorted(got)] == [c["text"] for c in plain["choices"]]


def test_chat_use_beam_search(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1 w2"}],
                                                  "use_beam_search": True, "n": 2, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"]
    assert len(ch) == 2 and ch[0]["message"]["content"] != ch[1]["message"]["content"]
    assert all(c["finish_reason"] == "length" for c in ch)


def test_beam_search_server_errors(client):
    r = client.post("/v1/completions", json={"prompt": "w1", "use_beam_search": True, "n": 11, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = client.post("/v1/completions", json={"prompt": "w1", "use_beam_search": True, "n": 2, "max_tokens": 2,
                                             "structured_outputs": {"choice": ["w1", "w2"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


@pytest.mark.slow
def test_real_smollm2_equals_transformers(smollm2_llm, hf_smollm2):
    """SmolLM2 (float32, the GGUF dequantized: transformers' weights), ignore_eos: the same beams
    as transformers' beam search."""
    from pagedllm import BeamSearchParams

    hf, tok = hf_smollm2
    prompt = tok("The capital of France is")["input_ids"]
    bw, n = 3, 6
    out = smollm2_llm.beam_search([{"prompt_token_ids": prompt}],
                                  BeamSearchParams(beam_width=bw, max_tokens=n, ignore_eos=True))[0]
    seqs, cums = _hf_beams(hf, prompt, bw, n, 1.0, True)
    assert [s.tokens[len(prompt):] for s in out.sequences] == seqs
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(cums, abs=1e-3)
