"""Hub ids resolved from a Hugging Face cache laid out as huggingface_hub lays it out (``HF_HUB_OFFLINE=1``),
revisions, clear errors for missing repos / revisions, sharded checkpoints with a stray shard, load formats,
``hf_overrides``, refused custom code, and the serve flags."""
from __future__ import annotations

import json
import os

import pytest
import torch
from arch_cases import make_checkpoint, tiny_tokenizer
from hub_cache import add_snapshot

from pagedllm import LLM, SamplingParams
from pagedllm.loader import load_model
from pagedllm.loader.hub import parse_model_ref, resolve_hub_model

REPO = "tiny-org/tiny-llama"
PROMPT = [5, 17, 3, 88, 42, 9, 61, 23]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline HF cache in tmp_path; returns its directory."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(cache)


def _llm(model, **kw):
    return LLM(model, dtype="float32", block_size=4, kv_cache_memory=2 * 1024**2, **kw)


def _greedy(llm, prompt=PROMPT):
    out = llm.generate([{"prompt_token_ids": prompt}], SP, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_parse_model_ref():
    assert parse_model_ref("org/name") == ("org/name", None, None)
    assert parse_model_ref("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == ("unsloth/Qwen3-0.6B-GGUF", None, "Q4_K_M")
    assert parse_model_ref("org/name/sub/f-Q8_0.gguf") == ("org/name", "sub/f-Q8_0.gguf", None)
    for bad in ("name", "/abs/path", "a/b/c", "org/na me", "../x", "org/name:"):
        assert parse_model_ref(bad) is None, bad


def test_repo_id_and_revisions_from_the_offline_cache(tmp_path, hub):
    main_dir, v2_dir = str(tmp_path / "main"), str(tmp_path / "v2")
    make_checkpoint("llama", main_dir, seed=0)
    make_checkpoint("llama", v2_dir, seed=1)
    snap = add_snapshot(hub, REPO, main_dir)
    v2 = add_snapshot(hub, REPO, v2_dir, refs=("v2",))
    commit = os.path.basename(v2)
    lm = load_model(REPO)
    assert lm.model_path == snap and lm.repo_id == REPO and lm.load_format == "safetensors"
    by_id = _llm(REPO)
    assert _greedy(by_id) == _greedy(_llm(main_dir))
    assert by_id.llm_engine.core.loaded.model_path == snap
    want_v2 = _greedy(_llm(v2_dir))
    assert _greedy(_llm(REPO, revision="v2")) == want_v2 != _greedy(by_id)
    assert _greedy(_llm(REPO, revision=commit)) == want_v2


def test_missing_repo_or_revision_names_it(tmp_path, hub):
    with pytest.raises(ValueError, match=r"'tiny-org/nope'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        load_model("tiny-org/nope")
    make_checkpoint("llama", str(tmp_path / "src"))
    add_snapshot(hub, REPO, str(tmp_path / "src"))
    with pytest.raises(ValueError, match=r"revision 'no-such-branch' of 'tiny-org/tiny-llama'"):
        load_model(REPO, revision="no-such-branch")
    with pytest.raises(ValueError, match=r"tiny-org/nope"):
        LLM("tiny-org/nope")
    with pytest.raises(ValueError, match=r"has no \.bin/\.pt weight files"):
        resolve_hub_model(REPO, load_format="pt")


def _sharded_with_stray(path):
    """A checkpoint in 3+ safetensors shards + index, and a stray ``consolidated.safetensors`` (not in
    the index) holding a conflicting copy of one tensor and a tensor the model does not have."""
    from safetensors.torch import save_file

    hf = make_checkpoint("llama", path)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    hf.save_pretrained(path, max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as fh:
        shards = set(json.load(fh)["weight_map"].values())
    assert len(shards) >= 3
    save_file({"model.norm.weight": torch.zeros(64), "model.bogus.weight": torch.ones(3)},
              os.path.join(path, "consolidated.safetensors"))
    return hf, shards


def test_sharded_index_ignores_a_stray_file(tmp_path, hub):
    from pagedllm.loader.hf_loader import safetensors_files

    src = str(tmp_path / "sharded")
    hf, shards = _sharded_with_stray(src)
    add_snapshot(hub, "tiny-org/sharded", src)
    ref = hf(torch.tensor([PROMPT])).logits[0, -1]
    for model in (src, "tiny-org/sharded"):
        llm = _llm(model)  # the stray file would fail the checkpoint checks (bogus and duplicate tensors)
        files = safetensors_files(llm.llm_engine.core.loaded.model_path)
        assert sorted(os.path.basename(f) for f in files) == sorted(shards)
        assert _greedy(llm)[0][0] == int(ref.argmax())
    os.remove(os.path.join(src, sorted(shards)[1]))
    with pytest.raises(ValueError, match=sorted(shards)[1]):
        load_model(src)


def test_load_formats(tmp_path):
    st, pt = str(tmp_path / "st"), str(tmp_path / "pt")
    hf = make_checkpoint("llama", st)
    os.makedirs(pt)  # NOTE: transformers 5 saves safetensors only: write the PyTorch file by hand
    torch.save({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(pt, "pytorch_model.bin"))
    hf.config.save_pretrained(pt)
    tiny_tokenizer().save_pretrained(pt)
    assert os.path.isfile(os.path.join(pt, "pytorch_model.bin")) and not any(
        f.endswith(".safetensors") for f in os.listdir(pt))
    want = _greedy(_llm(st))
    assert _greedy(_llm(pt)) == want
    assert load_model(pt).load_format == "pt"
    with pytest.raises(ValueError, match="safetensors"):
        load_model(pt, load_format="safetensors")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_model(st, load_format="gguf")
    with pytest.raises(ValueError, match="load_format"):
        load_model(st, load_format="npz")
    dummy = _llm(st, load_format="dummy")
    w = dummy.llm_engine.core.model.model.layers[0].mlp.down_proj.weight
    assert w.abs().max() <= 1e-3 and w.abs().max() > 0
    toks, _ = _greedy(dummy)
    assert len(toks) == 8


def test_hf_overrides(tmp_path):
    d = str(tmp_path / "m")
    make_checkpoint("llama", d)
    llm = _llm(d, hf_overrides={"max_position_embeddings": 24})
    assert llm.llm_engine.max_model_len == 24
    mm = str(tmp_path / "mm")
    make_checkpoint("gemma3-mm", mm)
    cfg = load_model(mm, hf_overrides={"text_config": {"sliding_window": 3}}).hf_config
    assert cfg.sliding_window == 3 and cfg.architectures == ["Gemma3ForConditionalGeneration"]


def test_custom_code_is_refused(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "acme"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "acme_lm", "architectures": ["AcmeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig",
                     "AutoModelForCausalLM": "modeling_acme.AcmeForCausalLM"}}))
    (d / "configuration_acme.py").write_text("raise SystemExit('custom code ran')\n")
    save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
    tiny_tokenizer().save_pretrained(d)
    with pytest.raises(ValueError, match=r"configuration_acme.AcmeConfig.*never executes"):
        LLM(str(d), trust_remote_code=True)


def test_tokenizer_and_config_from_hub_ids(tmp_path, hub):
    d = str(tmp_path / "m")
    make_checkpoint("llama", d)
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)
    add_snapshot(hub, "tiny-org/tok", str(tok_dir))
    add_snapshot(hub, REPO, d)
    lm = load_model(d, tokenizer="tiny-org/tok", hf_config_path=REPO)
    assert lm.tokenizer("w5 w7").input_ids == [5, 7]
    assert lm.hf_config.architectures == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="tiny-org/no-tok"):
        load_model(d, tokenizer="tiny-org/no-tok")


def test_serve_flags_reach_engine_args():
    from pagedllm.entrypoints.openai.api_server import engine_args_from_namespace
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    ns = make_arg_parser().parse_args([
        "org/name:Q4_K_M", "--revision", "v2", "--tokenizer", "org/tok", "--tokenizer-revision", "t1",
        "--download-dir", "/tmp/x", "--load-format", "gguf", "--hf-config-path", "org/cfg",
        "--hf-overrides", '{"max_position_embeddings": 4096}', "--trust-remote-code", "--model-impl", "transformers",
        "--served-model-name", "my-model", "--enable-expert-parallel"])
    a = engine_args_from_namespace(ns)
    assert (a.model, a.revision, a.tokenizer, a.tokenizer_revision, a.download_dir, a.load_format) == (
        "org/name:Q4_K_M", "v2", "org/tok", "t1", "/tmp/x", "gguf")
    assert a.hf_overrides == {"max_position_embeddings": 4096} and a.hf_config_path == "org/cfg"
    assert a.trust_remote_code and a.model_impl == "transformers" and a.served_model_name == ["my-model"]
    assert a.enable_expert_parallel
    d = engine_args_from_namespace(make_arg_parser().parse_args([]))
    assert d.load_format == "auto" and d.hf_overrides is None and d.model_impl == "auto" and not d.trust_remote_code


def test_gguf_repo_quant_and_file_selection(tmp_path, hub):
    from gguf import GGMLQuantizationType as Q
    from test_gguf_archs import _hf, write_gguf

    src = tmp_path / "gguf-repo"
    src.mkdir()
    hf = _hf("qwen3_moe")
    write_gguf(hf, "qwen3_moe", str(src / "tiny-qwen3moe-F32.gguf"))
    write_gguf(hf, "qwen3_moe", str(src / "tiny-qwen3moe-Q8_0.gguf"), Q.Q8_0)
    tok = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok)
    add_snapshot(hub, "tiny-org/tiny-GGUF", str(src))
    lm = load_model("tiny-org/tiny-GGUF:q8_0", tokenizer=str(tok))
    assert lm.model_path.endswith("tiny-qwen3moe-Q8_0.gguf") and lm.load_format == "gguf"
    assert lm.hf_config.architectures == ["Qwen3MoeForCausalLM"] and lm.repo_id == "tiny-org/tiny-GGUF"
    f32 = load_model("tiny-org/tiny-GGUF/tiny-qwen3moe-F32.gguf", tokenizer=str(tok))
    assert f32.model_path.endswith("tiny-qwen3moe-F32.gguf")
    with pytest.raises(ValueError, match=r"several GGUF files.*tiny-org/tiny-GGUF:QUANT"):
        load_model("tiny-org/tiny-GGUF", tokenizer=str(tok))
    with pytest.raises(ValueError, match=r"no GGUF file for quantization 'Q5_K'"):
        load_model("tiny-org/tiny-GGUF:Q5_K", tokenizer=str(tok))
    llm = _llm("tiny-org/tiny-GGUF:Q8_0", tokenizer=str(tok))
    assert len(_greedy(llm)[0]) == 8
