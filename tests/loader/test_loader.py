"""Loader tests: resolve, GGUF parsing/dequantization/name maps on synthetic files (fast), real GGUFs vs
transformers (slow), HF directory round trip."""

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch

from pagedllm.loader import LoadedModel, load_model, resolve_model_path
from pagedllm.loader.gguf_file import GGUFFile
from pagedllm.loader.gguf_loader import dequantize_tensor, hf_name

def _qtypes():
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType


# ---------------------------------------------------------------- resolve


def test_resolve_known_names_case_insensitive(smollm2_path):
    assert resolve_model_path("SmolLM2-135M-Instruct") == smollm2_path
    assert resolve_model_path("huggingfacetb/smollm2-135m-INSTRUCT") == smollm2_path
    assert smollm2_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(smollm2_path) == 98_362_432


def test_resolve_gemma(gemma3_path):
    assert resolve_model_path("gemma-3-270m") == gemma3_path
    assert resolve_model_path("Gemma3-270M") == gemma3_path
    assert os.path.getsize(gemma3_path) == 253_113_024


def test_resolve_paths_pass_through(tmp_path):
    g = tmp_path / "x.gguf"
    g.write_bytes(b"GGUF")
    assert resolve_model_path(str(g)) == str(g)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError) as ei:
        resolve_model_path("no-such-model-xyz")
    msg = str(ei.value)
    assert "no-such-model-xyz" in msg and "SmolLM2-135M-Instruct" in msg and "gemma-3-270m" in msg
    assert "installed:" in msg
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_path(str(f))


def test_not_gguf_file(tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(f))


# ---------------------------------------------------------------- synthetic GGUF


def _llamacpp_permute(w, n_head):
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, arch, tensors, n_head=4, n_kv=2, hidden=64, tied=True):
    """tensors: dict GGUF name -> (float32 array, qtype). Writes a 1-layer model GGUF with gguf-py."""
    import gguf
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(96)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    if arch == "llama":
        w.add_rope_dimension_count(hidden // n_head)
    else:
        w.add_key_length(hidden // n_head)
        w.add_value_length(hidden // n_head)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, (arr, qt) in tensors.items():
        data = arr if qt == _qtypes().F32 else quantize(arr, qt)
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_dequantize_all_simple_types_bitexact(tmp_path):
    """Every quant type gguf-py can quantize round-trips through our parser + chunked dequant exactly like
    gguf.quants.dequantize (the reference transformers uses)."""
    from gguf.quants import dequantize, quantize

    Q = _qtypes()
    rng = np.random.default_rng(0)
    types = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
    arrs = {f"t{i}.weight": (rng.standard_normal((40, 96)).astype(np.float32), qt) for i, qt in enumerate(types)}
    p = tmp_path / "m.gguf"
    _write_gguf(p, "llama", arrs)
    f = GGUFFile(str(p))
    assert f.architecture == "llama" and f.arch_get("block_count") == 1
    for name, (arr, qt) in arrs.items():
        info = f.tensors[name]
        assert info.shape == (40, 96) and info.ggml_type == qt
        ref = dequantize(quantize(arr, qt) if qt != Q.F32 else arr, qt).reshape(40, 96)
        got = dequantize_tensor(f, name)
        assert got.dtype == torch.float32 and got.shape == (40, 96)
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))), qt.name
        assert float((got - torch.from_numpy(arr)).abs().max()) < 0.5  # sane magnitude, not garbage
        bf = dequantize_tensor(f, name, torch.bfloat16)
        assert torch.equal(bf, got.to(torch.bfloat16))


def test_llama_unpermute_and_names(tmp_path):
    rng = np.random.default_rng(1)
    hidden, n_head, n_kv = 64, 4, 2
    q = rng.standard_normal((hidden, hidden)).astype(np.float32)
    k = rng.standard_normal((n_kv * 16, hidden)).astype(np.float32)
    norm = rng.standard_normal(hidden).astype(np.float32)
    F32 = _qtypes().F32
    tensors = {
        "token_embd.weight": (rng.standard_normal((32, hidden)).astype(np.float32), F32),
        "blk.0.attn_q.weight": (_llamacpp_permute(q, n_head), F32),
        "blk.0.attn_k.weight": (_llamacpp_permute(k, n_kv), F32),
        "blk.0.ffn_norm.weight": (norm, F32),
        "rope_freqs.weight": (np.ones(8, np.float32), F32),
    }
    p = tmp_path / "llama.gguf"
    _write_gguf(p, "llama", tensors, n_head, n_kv, hidden)
    from pagedllm.loader.gguf_loader import gguf_config, iter_gguf_weights

    f = GGUFFile(str(p))
    cfg = gguf_config(f)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size) == (4, 2, 16, 64)
    assert cfg.rope_parameters["rope_theta"] == 50000.0 and cfg.bos_token_id == 1 and cfg.eos_token_id == 2
    got = dict(iter_gguf_weights(f, cfg))
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.post_attention_layernorm.weight"}
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(got["model.layers.0.post_attention_layernorm.weight"], torch.from_numpy(norm))


def test_gemma3_norm_offset_and_names(tmp_path):
    rng = np.random.default_rng(2)
    F32 = _qtypes().F32
    norm = rng.standard_normal(64).astype(np.float32)
    q = rng.standard_normal((64, 64)).astype(np.float32)
    tensors = {
        "token_embd.weight": (rng.standard_normal((32, 64)).astype(np.float32), F32),
        "blk.0.attn_q.weight": (q, F32),
        "blk.0.ffn_norm.weight": (norm, F32),
        "blk.0.post_ffw_norm.weight": (norm, F32),
        "blk.0.attn_q_norm.weight": (norm[:16].copy(), F32),
        "output.weight": (rng.standard_normal((32, 64)).astype(np.float32), F32),
    }
    p = tmp_path / "g.gguf"
    _write_gguf(p, "gemma3", tensors, 4, 1, 64)
    from pagedllm.loader.gguf_loader import gguf_config, iter_gguf_weights

    f = GGUFFile(str(p))
    cfg = gguf_config(f)
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert cfg.tie_word_embeddings is False and cfg.head_dim == 16
    got = dict(iter_gguf_weights(f, cfg))
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))  # no permutation
    assert torch.equal(got["model.layers.0.pre_feedforward_layernorm.weight"], torch.from_numpy(norm - 1))
    assert torch.equal(got["model.layers.0.post_feedforward_layernorm.weight"], torch.from_numpy(norm - 1))
    assert torch.equal(got["model.layers.0.self_attn.q_norm.weight"], torch.from_numpy(norm[:16] - 1))
    assert "lm_head.weight" in got


def test_hf_name_map():
    assert hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.0.post_attention_norm.weight", "gemma3") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.1.attn_k.bias", "qwen2") == "model.layers.1.self_attn.k_proj.bias"
    assert hf_name("output.weight", "qwen3") == "lm_head.weight"
    assert hf_name("rope_freqs.weight", "llama") is None


# ---------------------------------------------------------------- light config vs transformers

# Every config attribute pagedllm reads (models, engine, pooling), present or not (getattr with a default).
_READ_ATTRS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
               "tie_word_embeddings", "architectures", "hidden_act", "hidden_activation", "attention_bias",
               "mlp_bias", "layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping",
               "attn_logit_softcapping", "id2label", "model_type", "num_labels", "name_or_path",
               "output_attentions"]
_MISSING = object()


def _assert_same_config(mine, ref):
    """`mine` (TextConfig) has exactly `ref`'s (a transformers config) public instance attributes, with equal
    values of the same types, and reads the same for every attribute pagedllm uses."""
    from pagedllm.loader.text_config import TextConfig

    assert isinstance(mine, TextConfig)

    def public(c):
        return {k: v for k, v in vars(c).items() if not k.startswith("_")}

    assert public(mine) == public(ref)
    for k, v in public(ref).items():
        assert type(getattr(mine, k)) is type(v), k
    for a in _READ_ATTRS:
        assert getattr(mine, a, _MISSING) == getattr(ref, a, _MISSING), a
    assert getattr(mine, "_sliding_window_pattern", None) == getattr(ref, "_sliding_window_pattern", None)


def _ref_config(model_type, kwargs, architectures=None):
    from transformers import AutoConfig

    ref = AutoConfig.for_model(model_type, **copy.deepcopy(kwargs))
    if architectures is not None:
        ref.architectures = architectures
    return ref


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_config_equals_transformers_synthetic(tmp_path, arch, tied):
    from pagedllm.loader.gguf_loader import gguf_config, gguf_config_kwargs

    F32 = _qtypes().F32
    tensors = {"token_embd.weight": (np.zeros((32, 64), np.float32), F32)}
    if not tied:
        tensors["output.weight"] = (np.zeros((32, 64), np.float32), F32)
    p = tmp_path / f"{arch}.gguf"
    _write_gguf(p, arch, tensors, 4, 2, 64)
    f = GGUFFile(str(p))
    model_type, hf_arch, kwargs = gguf_config_kwargs(f)
    cfg = gguf_config(f)
    assert cfg.model_type == model_type and cfg.architectures == [hf_arch] and cfg.tie_word_embeddings is tied
    _assert_same_config(cfg, _ref_config(model_type, kwargs, [hf_arch]))


@pytest.mark.parametrize("model_type,kwargs", [
    ("llama", {}),
    ("llama", {"hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5, "num_key_value_heads": None}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               "rope_theta": 5e5, "max_position_embeddings": 131072}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "head_dim": 32}),
    ("llama", {"partial_rotary_factor": 0.5, "unk_token_id": 0, "eos_token_id": [2, 3]}),
    ("gemma3_text", {}),
    ("gemma3_text", {"num_hidden_layers": 13, "sliding_window": 512, "rope_theta": 1e6,
                     "rope_local_base_freq": 2e4, "final_logit_softcapping": 30.0}),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 4}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 20, "head_dim": 64, "num_key_value_heads": None}),
    ("qwen3", {"rope_theta": 1e6, "attention_bias": True}),
])
def test_text_config_equals_transformers(model_type, kwargs):
    from pagedllm.loader.text_config import TextConfig

    cfg = TextConfig(model_type, **copy.deepcopy(kwargs))
    _assert_same_config(cfg, _ref_config(model_type, kwargs))


def test_text_config_errors_and_to_transformers():
    from pagedllm.loader.text_config import TextConfig

    with pytest.raises(ValueError, match="not supported"):
        TextConfig("mistral")
    with pytest.raises(ValueError, match="not a multiple"):
        TextConfig("llama", hidden_size=65, num_attention_heads=4)
    cfg = TextConfig("gemma3_text", num_hidden_layers=6, sliding_window=512)
    cfg.architectures = ["Gemma3ForCausalLM"]
    ref = cfg.to_transformers()
    assert type(ref).__name__ == "Gemma3TextConfig" and ref.architectures == ["Gemma3ForCausalLM"]
    _assert_same_config(cfg, ref)
    assert cfg.to_dict() == ref.to_dict() and cfg.to_dict()["model_type"] == "gemma3_text"


# ---------------------------------------------------------------- HF directory


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "the"] + [f"w{i}" for i in range(58)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _tiny_llama_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)  # safetensors + config.json + generation_config.json
    _tiny_tokenizer().save_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_dir_round_trip(tmp_path):
    ref = _tiny_llama_dir(tmp_path)
    lm = load_model(str(tmp_path))
    assert isinstance(lm, LoadedModel) and lm.source == "hf" and lm.model_path == str(tmp_path)
    assert lm.hf_config.architectures == ["LlamaForCausalLM"] and lm.hf_config.num_hidden_layers == 2
    got = dict(lm.weights())
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    assert dict(lm.weights()).keys() == got.keys()  # weights() is re-iterable
    assert lm.tokenizer("hello world").input_ids == [3, 4]
    assert isinstance(lm.generation_config, dict) and "_from_model_config" in lm.generation_config
    bf = dict(load_model(str(tmp_path), dtype=torch.bfloat16).weights())
    assert all(t.dtype == torch.bfloat16 for t in bf.values())
    assert torch.equal(bf["lm_head.weight"], ref["lm_head.weight"].to(torch.bfloat16))


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ValueError, match=r"missing config.json and \*.safetensors"):
        load_model(str(tmp_path))
    _tiny_llama_dir(tmp_path)
    with pytest.raises(ValueError, match="excluded by ignore_patterns"):
        load_model(str(tmp_path), ignore_patterns=["model*.safetensors"])
    os.remove(tmp_path / "config.json")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_model(str(tmp_path))


# ---------------------------------------------------------------- real GGUFs (slow)

_CFG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "model_type"]
_GEMMA_FIELDS = ["sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation", "attention_bias",
                 "final_logit_softcapping", "attn_logit_softcapping"]
_LLAMA_FIELDS = ["hidden_act", "attention_bias", "mlp_bias"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_config_matches_transformers(which, request):
    path = request.getfixturevalue(f"{which}_path")
    lm = load_model(path)
    ref = request.getfixturevalue(f"hf_{which}")[0].config  # transformers' GGUF config (root conftest reference)
    fields = _CFG_FIELDS + (_GEMMA_FIELDS if which == "gemma3" else _LLAMA_FIELDS)
    for f in fields:
        assert getattr(lm.hf_config, f) == getattr(ref, f), f
    if which == "smollm2":
        c = lm.hf_config
        assert c.architectures == ["LlamaForCausalLM"]
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 576, 9, 3, 64)
        assert c.rope_parameters["rope_theta"] == 100000.0 and c.tie_word_embeddings
    else:
        c = lm.hf_config
        assert c.architectures == ["Gemma3ForCausalLM"] and c.sliding_window == 512 and c.query_pre_attn_scalar == 256
        assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
        assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_gguf_config_equals_transformers_config(which, request):
    """The light config of each real GGUF has every attribute (and to_dict) of the transformers config built from
    the same GGUF metadata, the config our loader built before it stopped importing transformers for it."""
    from pagedllm.loader.gguf_loader import gguf_config, gguf_config_kwargs

    f = GGUFFile(request.getfixturevalue(f"{which}_path"))
    model_type, hf_arch, kwargs = gguf_config_kwargs(f)
    cfg = gguf_config(f)
    ref = _ref_config(model_type, kwargs, [hf_arch])
    _assert_same_config(cfg, ref)
    assert cfg.to_dict() == ref.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_gguf_load_skips_heavy_imports(which, request):
    """Loading a GGUF model (config, tokenizer, weights) must not import transformers' config / modeling
    machinery, which drags in torch.distributed.tensor and sympy (~1.5 s of start-up)."""
    import subprocess
    import sys

    path = request.getfixturevalue(f"{which}_path")
    code = (
        "import sys\n"
        "from pagedllm.loader import load_model\n"
        f"lm = load_model({path!r})\n"
        "next(iter(lm.weights()))\n"
        "lm.tokenizer('Hi')\n"
        "heavy = [m for m in ('sympy', 'torch.distributed.tensor', 'transformers.modeling_utils',\n"
        "         'transformers.models.llama.configuration_llama',\n"
        "         'transformers.models.gemma3.configuration_gemma3') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout


def _check_weights(path, hf_state, n_expected):
    lm = load_model(path)
    got = {}
    for name, t in lm.weights():
        assert t.dtype == torch.float32
        got[name] = t
    assert len(got) == n_expected and "lm_head.weight" not in got
    for name, t in got.items():
        assert torch.equal(t, hf_state[name]), name  # bit-exact, incl. un-permuted q/k and gemma norms
    assert torch.equal(hf_state["lm_head.weight"], got["model.embed_tokens.weight"])


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_path, hf_smollm2_state):
    _check_weights(smollm2_path, hf_smollm2_state, 272)


@pytest.mark.slow
def test_gemma3_weights_match_transformers(gemma3_path, hf_gemma3_state):
    _check_weights(gemma3_path, hf_gemma3_state, 236)


_TEXTS = ["Hello world", "The capital of France is Paris.\n  indented\ttab", "ünïcødé 🤗 <|im_start|>x<|im_end|>",
          "<start_of_turn>user\nhi<end_of_turn>\n"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_tokenizer_matches_transformers(which, request):
    from pagedllm.loader.tokenizer import load_gguf_tokenizer

    path = request.getfixturevalue(f"{which}_path")
    ref = request.getfixturevalue(f"hf_{which}")[1]  # the session's transformers tokenizer (root conftest)
    tok = load_gguf_tokenizer(path)  # cached if a previous run converted it
    tok2 = load_gguf_tokenizer(path)  # certainly from the cache
    for t in (tok, tok2):
        for s in _TEXTS:
            assert t(s).input_ids == ref(s).input_ids, s
        assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
        assert t.add_bos_token == ref.add_bos_token
        assert t.chat_template == ref.chat_template
    if which == "smollm2":
        assert (tok2.bos_token_id, tok2.eos_token_id, tok2.add_bos_token) == (1, 2, False)
        assert tok2("Hi").input_ids[0] != 1
        text = tok2.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert (tok2.bos_token_id, tok2.eos_token_id, tok2.add_bos_token) == (2, 1, True)
        assert tok2("Hi").input_ids[0] == 2
        assert tok2.chat_template is None
        assert tok2.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]


def _assert_same_tokenizer_state(a, b, b_json=None):
    """``b_json``: ``b``'s Rust tokenizer serialization when the caller already has it."""
    assert type(a) is type(b)
    va, vb = vars(a), vars(b)
    assert set(va) == set(vb)
    for k, v in va.items():
        if k == "_tokenizer":  # the Rust tokenizer: compare its full serialization
            assert v.to_str() == (b_json if b_json is not None else vb[k].to_str())
        else:
            assert v == vb[k], k


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_tokenizer_cache_snapshot(which, request, tmp_path, monkeypatch):
    """Cache reloads (from the saved files, then from the pickle snapshot, then after a corrupt snapshot) all give
    the object AutoTokenizer gives for the saved files: same class, same state, same ids and chat prompt."""
    from transformers import AutoTokenizer

    from pagedllm.loader import tokenizer as T

    path = request.getfixturevalue(f"{which}_path")
    session_cache = T.gguf_tokenizer_cache_path(path)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    cached = T.gguf_tokenizer_cache_path(path)
    if os.path.isfile(os.path.join(session_cache, "tokenizer.json")):
        # NOTE: the conversion itself ran in this session already (any earlier load of the file);
        # start from its saved files, without the snapshot, to test the reload steps below.
        shutil.copytree(session_cache, cached, ignore=shutil.ignore_patterns("snapshot-*"))
    else:
        T.load_gguf_tokenizer(path)  # converts and saves the files
    snap = T._snapshot_path(cached)
    assert cached.startswith(str(tmp_path)) and not os.path.exists(snap)
    ref = AutoTokenizer.from_pretrained(cached, **T._load_bos_eos_flags(cached))
    # NOTE: ours drop the Python vocab / merges lists transformers built the Rust model from (issue 30.4)
    had_lists = [n for n in T._BUILD_LISTS if isinstance(vars(ref).get(n), (dict, list))]
    assert had_lists == (["_vocab", "_merges"] if which == "gemma3" else [])
    ref = T.drop_build_lists(ref)
    from_files = T.load_gguf_tokenizer(path)  # reloads the files, writes the snapshot
    assert os.path.isfile(snap)
    from_snap = T.load_gguf_tokenizer(path)
    with open(snap, "wb") as fh:
        fh.write(b"not a pickle")
    after_corrupt = T.load_gguf_tokenizer(path)  # ignores the broken snapshot, rewrites it
    assert os.path.getsize(snap) > 1000 and os.path.isfile(os.path.join(cached, "tokenizer.json"))
    msgs = [{"role": "user", "content": "Hi"}]
    ref_json = ref._tokenizer.to_str()
    for tok in (from_files, from_snap, after_corrupt, T.load_gguf_tokenizer(path)):
        _assert_same_tokenizer_state(tok, ref, ref_json)
        for s in _TEXTS:
            ids = ref(s).input_ids
            assert tok(s).input_ids == ids and tok.decode(ids) == ref.decode(ids)
        if ref.chat_template is not None:
            assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                    == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    if which == "smollm2":  # TokenizersBackend is loaded directly, without AutoTokenizer's model table
        assert T._tokenizer_class(cached).__name__ == "TokenizersBackend"
    else:
        assert type(from_snap).__name__ == "GemmaTokenizer" and T._tokenizer_class(cached) is AutoTokenizer


@pytest.mark.slow
def test_load_model_smollm2_end_to_end(smollm2_path):
    lm = load_model("SmolLM2-135M-Instruct")
    assert lm.source == "gguf" and lm.model_path == smollm2_path and lm.generation_config == {}
    shapes = {n: tuple(t.shape) for n, t in lm.weights()}
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert sum(np.prod(s) for s in shapes.values()) == 134_515_008
    # The weights iterator keeps the GGUFFile; its vocabulary lists were dropped once the config
    # and the tokenizer were built (issue 30.4: 4.9 MiB here, 22.7 MiB for Gemma 3), scalars kept.
    gf = next(c.cell_contents for c in lm.weights.__closure__ if isinstance(c.cell_contents, GGUFFile))
    assert not [k for k in gf.metadata if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")]
    assert "tokenizer.ggml.eos_token_id" in gf.metadata and lm.hf_config.vocab_size == 49152
    assert lm.tokenizer.decode(lm.tokenizer("Hello world")["input_ids"]) == "Hello world"


def test_mapped_safetensors_reader_equals_safe_open(tmp_path):
    """The mapped safetensors reader (no host copy: views of one private mmap) yields what safe_open
    does, every dtype and shape, in the same order; a writable view never reaches the file; a file
    it cannot read (a bad header) goes through safe_open's error instead."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pagedllm.loader.hf_loader import iter_safetensors_weights, mapped_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"b.w": torch.randn(7, 33, generator=g).to(torch.bfloat16), "a.f16": torch.randn(5, generator=g).half(),
               "c.i64": torch.arange(12).reshape(3, 4), "d.u8": torch.arange(9, dtype=torch.uint8),
               "e.bool": torch.tensor([True, False, True]), "f.empty": torch.empty(0, 4),
               "g.fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn), "h.scalar": torch.tensor(3.5)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    got = list(mapped_safetensors(path))
    with safe_open(path, framework="pt") as fh:
        want = [(k, fh.get_tensor(k)) for k in fh.keys()]
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), k
    before = open(path, "rb").read()
    dict(got)["b.w"].add_(1)  # copy-on-write: private to this process
    assert open(path, "rb").read() == before
    conv = dict(iter_safetensors_weights([path], torch.float32))
    assert conv["b.w"].dtype == torch.float32 and torch.equal(conv["b.w"], tensors["b.w"].float())
    assert conv["c.i64"].dtype == torch.int64
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(Exception):
        list(iter_safetensors_weights([str(bad)]))
