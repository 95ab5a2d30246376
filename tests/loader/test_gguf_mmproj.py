"""GGUF text model + llama.cpp ``mmproj`` GGUF (pagedllm/loader/gguf_mmproj.py) on a tiny random Gemma 3
image-text model: its text part written as llama.cpp's ``convert_hf_to_gguf.py`` writes a Gemma 3 text GGUF
(norms as ``1 + w``), its SigLIP tower and projector as the ``--mmproj`` file (``general.architecture``
"clip", ``clip.projector_type`` "gemma3", ``v.*`` / ``mm.*`` names, ``mm.soft_emb_norm`` as ``1 + w``,
``mm.input_projection`` F16, embeddings F32), both with gguf-py. The GGUF engine's prompt ids, greedy tokens
and logprobs equal transformers' and the safetensors engine's on the same weights and image; Q8_0 text blocks
stay quantized; auto-detection beside the model; mismatched / text-only mmproj files are refused (one-line
preflight error, ``ValueError``), an image for a GGUF without one is an input error; one openai-client
request through ``pagedllm serve``."""
from __future__ import annotations

import base64
import os
import re
import shutil
import sys

import gguf
import numpy as np
import pytest
import transformers as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "multimodal"))
sys.path.insert(0, os.path.dirname(HERE))
from arch_cases import COMMON, VOCAB, build_hf  # noqa: E402
from mm_helpers import CHAT_TEMPLATE, hf_greedy_mm, image, png_bytes, tiny_mm_tokenizer  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.input_processor import InputValidationError  # noqa: E402
from pagedllm.loader.gguf_mmproj import check_mmproj_arg, find_mmproj, hf_vision_name, open_mmproj  # noqa: E402

Q = gguf.GGMLQuantizationType
N = 6
TEXT = "w5 w7 <start_of_image> w9 w20 w31"
_TEXT_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# llama.cpp gguf-py tensor_mapping.py: SigLIP (HF vision_model.*) -> MODEL_TENSOR.V_* names
_VISION_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}
_VISION = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
           "post_layernorm": "v.post_ln"}


def _config(hidden=64):
    # what a Gemma 3 text GGUF expresses: query_pre_attn_scalar and the 5:1 sliding pattern are the defaults
    text = tf.Gemma3TextConfig(**{**COMMON, "hidden_size": hidden, "num_hidden_layers": 6}, num_key_value_heads=1,
                               head_dim=32, sliding_window=5, rms_norm_eps=1e-6)
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                           image_token_id=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)


def _q(arr, qtype):
    from gguf.quants import quantize

    ok = qtype != Q.F32 and arr.ndim >= 2 and arr.shape[-1] % 32 == 0
    return (quantize(arr, qtype), qtype) if ok else (arr, Q.F32)


def write_text_gguf(hf, path, qtype=Q.F32):
    """The text half as convert_hf_to_gguf.py's Gemma3Model writes it (arch "gemma3")."""
    c = hf.config.get_text_config()
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        name = name.replace("model.language_model.", "model.")
        if not name.startswith("model.") or "vision_tower" in name or "multi_modal_projector" in name:
            continue
        if name == "model.embed_tokens.weight":
            key = "token_embd.weight"
        elif name == "model.norm.weight":
            key, a = "output_norm.weight", a + 1
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
            key = f"blk.{m.group(1)}.{_TEXT_LAYER[m.group(2)]}.weight"
            if key.endswith("norm.weight"):
                a = a + 1
        arr, qt = _q(a, qtype) if key != "token_embd.weight" else (a, Q.F32)
        w.add_tensor(key, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_mmproj(hf, path, qtype=Q.F16, projection_dim=None):
    """The vision half as convert_hf_to_gguf.py --mmproj's Gemma3VisionModel writes it."""
    cfg = hf.config
    v = cfg.vision_config
    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(projection_dim or cfg.text_config.hidden_size)
    w.add_vision_image_size(v.image_size)
    w.add_vision_patch_size(v.patch_size)
    w.add_vision_embedding_length(v.hidden_size)
    w.add_vision_feed_forward_length(v.intermediate_size)
    w.add_vision_block_count(v.num_hidden_layers)
    w.add_vision_head_count(v.num_attention_heads)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_clip_projector_type("gemma3")
    w.add_vision_attention_layernorm_eps(v.layer_norm_eps)
    w.add_vision_use_gelu(True)
    w.add_vision_projector_scale_factor((v.image_size // v.patch_size) // int(cfg.mm_tokens_per_image ** 0.5))
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy().copy()
        if "multi_modal_projector." in name:
            if name.endswith("mm_input_projection_weight"):
                w.add_tensor("mm.input_projection.weight", a.astype(np.float16), raw_dtype=Q.F16)
            else:
                w.add_tensor("mm.soft_emb_norm.weight", a + 1)
            continue
        if "vision_tower." not in name or ".head." in name:  # llama.cpp drops SigLIP's unused pooling head
            continue
        rest = name.split("vision_tower.", 1)[1].removeprefix("vision_model.")
        base, _, kind = rest.rpartition(".")
        m = re.match(r"encoder\.layers\.(\d+)\.(.+)$", base)
        key = f"v.blk.{m.group(1)}.{_VISION_LAYER[m.group(2)]}.{kind}" if m else f"{_VISION[base]}.{kind}"
        if ".embeddings." in name or a.ndim < 2:
            w.add_tensor(key, a)
        elif qtype == Q.F16:
            w.add_tensor(key, a.astype(np.float16), raw_dtype=Q.F16)
        else:
            arr, qt = _q(a, qtype)
            w.add_tensor(key, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mmproj")
    hf = build_hf(_config(), "Gemma3ForConditionalGeneration")
    ckpt = d / "ckpt"
    hf.save_pretrained(ckpt)
    tok = tiny_mm_tokenizer()
    proc = tf.Gemma3Processor(image_processor=tf.Gemma3ImageProcessor(size={"height": 28, "width": 28}),
                              tokenizer=tok, image_seq_length=4, chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(ckpt)
    tok.save_pretrained(d / "tok")
    (d / "f32").mkdir()
    (d / "q8").mkdir()
    return {"hf": hf, "proc": proc, "dir": d, "ckpt": str(ckpt), "tok": str(d / "tok"),
            "text": write_text_gguf(hf, str(d / "f32" / "tiny-f32.gguf")),
            "mmproj": write_mmproj(hf, str(d / "mmproj-tiny-f16.gguf")),
            "text_q8": write_text_gguf(hf, str(d / "q8" / "tiny-q8_0.gguf"), Q.Q8_0)}


def _greedy():
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=0)


def _run(llm, prompt):
    o = llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    return o.prompt_token_ids, list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]


def _llm(model, **kw):
    return LLM(model, dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=16, **kw)


def test_names_follow_llama_cpp():
    assert hf_vision_name("v.blk.3.attn_q.weight") == \
        "model.vision_tower.encoder.layers.3.self_attn.q_proj.weight"
    assert hf_vision_name("v.patch_embd.bias") == "model.vision_tower.embeddings.patch_embedding.bias"
    assert hf_vision_name("mm.input_projection.weight") == "model.multi_modal_projector.mm_input_projection_weight"
    assert hf_vision_name("v.blk.0.unknown.weight") is None


@pytest.fixture(scope="module")
def gguf_llm(files):
    return _llm(files["text"], mmproj=files["mmproj"], tokenizer=files["tok"])


def test_gguf_mmproj_matches_transformers_and_safetensors(files, gguf_llm):
    hf, proc = files["hf"], files["proc"]
    img = image(1)
    ids, ref, ref_lp = hf_greedy_mm(hf, proc, TEXT, [img], N)
    llm = gguf_llm
    assert llm.llm_engine.core.hf_config.architectures == ["Gemma3ForConditionalGeneration"]
    p_ids, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert p_ids == ids and toks == ref
    assert lps == pytest.approx(ref_lp, abs=1e-4)
    # the same weights from safetensors: the same prompt and answer
    st = _llm(files["ckpt"])
    s_ids, s_toks, s_lps = _run(st, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert (s_ids, s_toks) == (p_ids, toks) and s_lps == pytest.approx(lps, abs=1e-4)
    # chat with an image part through the tokenizer's template
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image(4)},
                                          {"type": "text", "text": "w40 w41"}]}]
    a, b = llm.chat(msgs, _greedy(), use_tqdm=False)[0], st.chat(msgs, _greedy(), use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_quantized_text_blocks_kept_and_autodetect(files, caplog, monkeypatch):
    # Like with like against transformers' float forward: the GGUF text layers with float activations
    # (PAGEDLLM_GGUF_INTDOT=0). The default integer-dot path's int8 activations on this random
    # 64-wide model (two 32-blocks per row) moved the logprobs by up to 1.48 nats (measured
    # 2026-12-02); its accuracy is checked on real models in tests/quantization/test_gguf_blocks.py.
    from pagedllm.quantization import group_quant as gq

    monkeypatch.setattr(gq, "INTDOT", False)
    d = files["dir"]
    # an mmproj*.gguf beside the model file is picked up without --mmproj (Q8_0 vision tensors, dequantized)
    write_mmproj(files["hf"], str(d / "q8" / "mmproj-tiny-Q8_0.gguf"), Q.Q8_0)
    assert find_mmproj(files["text_q8"]) == str(d / "q8" / "mmproj-tiny-Q8_0.gguf")
    llm = _llm(files["text_q8"], tokenizer=files["tok"])
    from pagedllm.quantization.gguf import GGUFConfig

    loaded = llm.llm_engine.core.loaded
    assert isinstance(loaded.quant_config, GGUFConfig) and loaded.quant_config.has_quantized_tensors()
    assert loaded.mmproj is not None and loaded.mmproj.path.endswith("mmproj-tiny-Q8_0.gguf")
    img = image(2)
    _, ref, ref_lp = hf_greedy_mm(files["hf"], files["proc"], TEXT, [img], N)
    _, toks, lps = _run(llm, {"prompt": TEXT, "multi_modal_data": {"image": img}})
    assert lps == pytest.approx(ref_lp, abs=0.1)  # Q8_0 rounding of every matrix (0.034 seen)
    assert toks[:2] == ref[:2]
    # "none" turns the detection off: text only, an image is an input error
    text_only = _llm(files["text_q8"], tokenizer=files["tok"], mmproj="none")
    with pytest.raises(InputValidationError):
        text_only.generate({"prompt": TEXT, "multi_modal_data": {"image": img}}, _greedy(), use_tqdm=False)


def test_mismatched_and_text_only_mmproj_refused(files, tmp_path):
    bad = write_mmproj(files["hf"], str(tmp_path / "other.gguf"), projection_dim=128)
    with pytest.raises(ValueError, match="hidden size is 64"):
        check_mmproj_arg(files["text"], bad)
    with pytest.raises(ValueError, match="not an mmproj file"):
        check_mmproj_arg(files["text"], files["text_q8"])
    with pytest.raises(ValueError, match="not a file"):
        open_mmproj(str(tmp_path / "missing.gguf"))
    from pagedllm.loader import load_model

    with pytest.raises(ValueError, match="hidden size 64"):
        load_model(files["text"], tokenizer=files["tok"], mmproj=bad)
    # a mismatched file found beside the model is skipped: text only
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(files["text"], d / "t.gguf")
    shutil.copy(bad, d / "mmproj-other.gguf")
    lm = load_model(str(d / "t.gguf"), tokenizer=files["tok"])
    assert lm.mmproj is None and lm.hf_config.architectures == ["Gemma3ForCausalLM"]


def test_cli_mismatched_mmproj_exits_2(files, tmp_path):
    import subprocess

    bad = write_mmproj(files["hf"], str(tmp_path / "other.gguf"), projection_dim=128)
    from server_helpers import free_port

    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", files["text"], "--mmproj", bad,
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and "--mmproj" in err[0] and "hidden size is 64" in err[0]


def test_openai_client_image_through_server(files, gguf_llm):
    openai = pytest.importorskip("openai")
    from server_helpers import serve

    b64 = base64.b64encode(png_bytes(image(7))).decode()
    with serve([files["text"], "--mmproj", files["mmproj"], "--tokenizer", files["tok"], "--dtype", "float32",
                "--max-model-len", "64", "--served-model-name", "tiny", "--block-size", "4",
                "--disable-log-stats"]) as (base, _):
        c = openai.OpenAI(base_url=base + "/v1", api_key="x")
        content = [{"type": "text", "text": "w40 w41"},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}]
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                      max_tokens=N, temperature=0)
        assert r.choices[0].message.content and r.usage.prompt_tokens > 4
    # the offline GGUF engine gives the same greedy answer (and equals the safetensors one: the test above)
    ref = gguf_llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=N, temperature=0),
                        use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.outputs[0].text


def test_processor_from_mmproj_metadata_and_a_plain_vocabulary(files):
    """A GGUF vocabulary has the image markers as tokens but not transformers' named boi / eoi / image
    tokens: the processor names them, and expands the marker as the checkpoint's own processor does."""
    from arch_cases import tiny_tokenizer

    from pagedllm.loader import load_model

    plain = tiny_tokenizer(VOCAB - 3)
    plain.add_tokens(["<end_of_image>", "<start_of_image>", "<image_soft_token>"], special_tokens=True)
    assert getattr(plain, "boi_token", None) is None
    proj = open_mmproj(files["mmproj"])
    assert (proj.projector_type, proj.tokens_per_image, proj.vision_config["image_size"]) == ("gemma3", 4, 28)
    proc = proj.hf_processor(plain)
    img = image(3)
    ours, ref = proc(text=TEXT, images=[img], return_tensors="pt"), files["proc"](text=TEXT, images=[img],
                                                                                   return_tensors="pt")
    assert ours["input_ids"].tolist() == ref["input_ids"].tolist()
    assert (ours["pixel_values"] - ref["pixel_values"]).abs().max().item() == 0.0
    proj.file.close()
    # a vocabulary without the markers (a text-only Gemma 3, e.g. 270M / 1B) is refused
    tok = files["dir"] / "plain-tok"
    tiny_tokenizer().save_pretrained(tok)
    with pytest.raises(ValueError, match="no '<start_of_image>'"):
        load_model(files["text"], tokenizer=str(tok), mmproj=files["mmproj"])


def test_mmproj_needs_a_gguf_model(files):
    from pagedllm.loader import load_model

    with pytest.raises(ValueError, match="needs a GGUF text model"):
        load_model(files["ckpt"], mmproj=files["mmproj"])
    with pytest.raises(ValueError, match="needs a GGUF text model"):
        check_mmproj_arg(files["ckpt"], files["mmproj"])
