"""Weights served from the mapped cache file (``pagedllm/loader/mapped_weights.py``, issue 30.3): the
same bits as the copied weights (logits of a quantized GGUF through ``LLM``, and the real SmolLM2 file),
a corrupt / truncated / stale cache file is never used but rewritten, an in-place write never reaches
the file, and the directory stays within ``PAGEDLLM_WEIGHT_CACHE_MAX``."""
from __future__ import annotations

import os

import gguf
import pytest
import torch
from arch_cases import PROMPTS, tiny_tokenizer
from test_gguf_archs import _hf, _our_logits, write_gguf
from torch import nn

from pagedllm import LLM, SamplingParams
from pagedllm.loader import mapped_weights as mw

Q = gguf.GGMLQuantizationType


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    d = tmp_path / "wcache"
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_DIR", str(d))
    monkeypatch.delenv("PAGEDLLM_WEIGHT_CACHE_MAX", raising=False)
    monkeypatch.delenv("PAGEDLLM_WEIGHT_MMAP", raising=False)
    return d


def _module(seed: int = 0, n: int = 3, rows: int = 64) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = nn.Module()
    for i in range(n):  # 64 KiB+ each: mapped (MIN_TENSOR_BYTES)
        m.register_parameter(f"w{i}", nn.Parameter(torch.randn(rows, 512, generator=g), requires_grad=False))
    m.register_parameter("q", nn.Parameter(torch.randint(-128, 127, (256, 512), generator=g, dtype=torch.int8),
                                           requires_grad=False))
    m.register_parameter("norm", nn.Parameter(torch.randn(16, generator=g), requires_grad=False))  # too small
    m.tied = m.w0  # the same Parameter twice: mapped once
    return m


def _in_mapping(t: torch.Tensor, res: mw.MappedWeights) -> bool:
    mm = res._mm[0]
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    return base <= t.data_ptr() < base + len(mm)


def test_written_then_hit_then_rebuilt_after_corruption(cache, tmp_path):
    src = tmp_path / "ckpt.bin"
    src.write_bytes(b"x" * 100)
    ref = {k: v.clone() for k, v in _module().state_dict().items()}
    m = _module()
    res = mw.map_model_weights(m, [str(src)], {"dtype": "float32"})
    assert res.status == "written" and res.path and os.path.dirname(res.path) == str(cache)
    assert res.mapped_bytes == 3 * 64 * 512 * 4 + 256 * 512 and res.copied_bytes == 16 * 4
    assert all(_in_mapping(getattr(m, n), res) for n in ("w0", "w1", "w2", "q")) and m.tied is m.w0
    assert not _in_mapping(m.norm, res)
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref[k]), k
    # the pages are the file's: resident in this process through the mapping once read
    assert float(m.w1.sum()) == float(ref["w1"].sum())
    assert mw.mapped_file_resident_bytes(res.path) >= 64 * 512 * 4

    m2 = _module()
    res2 = mw.map_model_weights(m2, [str(src)], {"dtype": "float32"})
    assert res2.status == "hit" and res2.path == res.path

    # one flipped byte in the data of the last tensor: compared, rejected, rewritten
    size = os.path.getsize(res.path)
    with open(res.path, "r+b") as f:
        f.seek(size - 5)
        b = f.read(1)
        f.seek(size - 5)
        f.write(bytes([b[0] ^ 0xFF]))
    m3 = _module()
    res3 = mw.map_model_weights(m3, [str(src)], {"dtype": "float32"})
    assert res3.status == "rebuilt"
    for k, v in m3.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert mw.map_model_weights(_module(), [str(src)], {"dtype": "float32"}).status == "hit"

    # truncated (a torn write from another tool), then garbage where the header should be
    with open(res.path, "r+b") as f:
        f.truncate(size // 2)
    m4 = _module()
    assert mw.map_model_weights(m4, [str(src)], {"dtype": "float32"}).status == "rebuilt"
    assert torch.equal(m4.q, ref["q"])
    with open(res.path, "r+b") as f:
        f.write(b"\0" * 64)
    assert mw.map_model_weights(_module(), [str(src)], {"dtype": "float32"}).status == "rebuilt"
    assert not [n for n in os.listdir(cache) if ".tmp." in n]


def test_stale_cache_from_other_weights_is_rebuilt(cache, tmp_path):
    """Same key (same checkpoint file and options) but other loaded values, e.g. a changed converter:
    the byte comparison catches it."""
    src = tmp_path / "ckpt.bin"
    src.write_bytes(b"x")
    res = mw.map_model_weights(_module(seed=1), [str(src)], {})
    m = _module(seed=2)
    want = m.w2.clone()
    res2 = mw.map_model_weights(m, [str(src)], {})
    assert res2.status == "rebuilt" and res2.path == res.path and torch.equal(m.w2, want)
    # a newer checkpoint file (size / mtime) is another key: its own file
    src.write_bytes(b"xy")
    assert mw.map_model_weights(_module(seed=2), [str(src)], {}).path != res.path


def test_in_place_write_stays_private(cache, tmp_path):
    src = tmp_path / "ckpt.bin"
    src.write_bytes(b"x")
    m = _module()
    want = m.w0.clone()
    mw.map_model_weights(m, [str(src)], {})
    m.w0.data.add_(1.0)  # copy-on-write: this process's page only
    m2 = _module()
    assert mw.map_model_weights(m2, [str(src)], {}).status == "hit"
    assert torch.equal(m2.w0, want)


def test_cache_directory_bound(cache, tmp_path, monkeypatch):
    """Past PAGEDLLM_WEIGHT_CACHE_MAX the least recently used files go; a model larger than the bound
    is not cached (its weights stay copies)."""
    one = 3 * 64 * 512 * 4 + 256 * 512 + 5 * 4096  # a file: data + header page + alignment
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_MAX", str(2 * one))
    paths = []
    for i in range(4):
        src = tmp_path / f"ckpt{i}.bin"
        src.write_bytes(b"x")
        res = mw.map_model_weights(_module(), [str(src)], {})
        assert res.status == "written"
        os.utime(res.path, (1_000_000 + i, 1_000_000 + i))  # distinct LRU order
        paths.append(res.path)
        assert res.cache_bytes <= 2 * one
    left = sorted(os.path.join(cache, n) for n in os.listdir(cache))
    assert left == sorted(paths[-2:]) and sum(os.path.getsize(p) for p in left) <= 2 * one
    # bigger than the bound: skipped, nothing written, the parameters untouched
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_MAX", "64KiB")
    src = tmp_path / "big.bin"
    src.write_bytes(b"x")
    m = _module()
    ptr = m.w0.data_ptr()
    res = mw.map_model_weights(m, [str(src)], {})
    assert res.status.startswith("skipped") and res.path is None and m.w0.data_ptr() == ptr
    assert len(os.listdir(cache)) == 2
    monkeypatch.setenv("PAGEDLLM_WEIGHT_MMAP", "0")
    assert mw.map_model_weights(_module(), [str(src)], {}).status == "off"


def test_unwritable_cache_keeps_copies(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("PAGEDLLM_WEIGHT_CACHE_DIR", str(blocker / "sub"))  # a file where a directory must be
    m = _module()
    want = m.w1.clone()
    res = mw.map_model_weights(m, [str(blocker)], {})
    assert res.status.startswith("skipped: cannot write") and torch.equal(m.w1, want)


def _greedy_and_logits(path, tok):
    llm = LLM(path, tokenizer=tok, dtype="float32", block_size=4, kv_cache_memory=2 * 1024**2, max_model_len=64)
    core = llm.llm_engine.core
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    got = [(list(o.outputs[0].token_ids), [{k: v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs])
           for o in outs]
    logits = _our_logits(core.executor.driver_worker.model, PROMPTS[0])
    info = (core.weight_mapped_bytes, core.weight_mapped_path, core.loaded.quant_config)
    del llm
    return got, logits, info


def test_mapped_gguf_same_logits_as_copies(cache, tmp_path, monkeypatch):
    """A Q4_0 / Q8_0 GGUF (kept in its blocks): mapped weights give bit-identical logits and greedy
    logprobs to the copied ones (PAGEDLLM_WEIGHT_MMAP=0), on the write and on the hit."""
    hf = _hf("granite")
    tok = str(tmp_path / "tok")
    tiny_tokenizer().save_pretrained(tok)
    for qt in (Q.Q4_0, Q.Q8_0):
        path = write_gguf(hf, "granite", str(tmp_path / f"{qt.name}.gguf"), qt)
        monkeypatch.setenv("PAGEDLLM_WEIGHT_MMAP", "0")
        ref, ref_logits, info = _greedy_and_logits(path, tok)
        assert info[0] == 0 and info[1] is None and info[2] is not None  # blocks kept
        monkeypatch.delenv("PAGEDLLM_WEIGHT_MMAP")
        for _ in range(2):  # written, then hit
            got, logits, info = _greedy_and_logits(path, tok)
            assert info[0] > 0 and os.path.exists(info[1])
            assert got == ref and torch.equal(logits, ref_logits)
        assert all(len(t) == 8 for t, _ in got)


@pytest.mark.slow
def test_mapped_smollm2_same_logits(smollm2_path, cache, monkeypatch):
    """The real SmolLM2-135M Q4_1 file: the mapped weights (~86 MiB of ~88 MiB; float16 scales and
    mins) give the copied weights' logits bit for bit."""
    from pagedllm.attention.backend import ForwardContext, set_forward_context
    from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345]
    out = []
    for mode in ("0", "1"):
        monkeypatch.setenv("PAGEDLLM_WEIGHT_MMAP", mode)
        llm = LLM(smollm2_path, dtype="float32", kv_cache_memory=8 * 1024**2, max_model_len=64)
        core = llm.llm_engine.core
        model = core.executor.driver_worker.model
        n_layers, hkv, d = model.get_kv_cache_spec()
        caches = [torch.zeros(4, 2, 4, hkv, d) for _ in range(n_layers)]
        ctx = ForwardContext(build_metadata([(0, len(ids), [3, 2])], 4), caches, TorchPagedAttention())
        with torch.no_grad(), set_forward_context(ctx):
            out.append(model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))))
        out.append(core.weight_mapped_bytes)
        del llm, model
    assert out[1] == 0 and out[3] > 80 * 2**20
    assert torch.equal(out[0], out[2])


def test_safetensors_mapped_with_all(cache, tmp_path, monkeypatch):
    """PAGEDLLM_WEIGHT_MMAP=all maps a safetensors model's parameters too: the same greedy logprobs
    as the copies; the default leaves safetensors models as copies."""
    from arch_cases import CASES, build_hf

    hf = build_hf(CASES["llama"][1](), CASES["llama"][0])
    d = str(tmp_path / "tiny-llama")
    hf.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    got = {}
    for mode in ("0", "1", "all"):
        monkeypatch.setenv("PAGEDLLM_WEIGHT_MMAP", mode)
        out, _, info = _greedy_and_logits(d, d)
        got[mode] = (out, info[0])
    assert got["0"][1] == 0 and got["1"][1] == 0 and got["all"][1] > 0
    assert got["all"][0] == got["0"][0]
