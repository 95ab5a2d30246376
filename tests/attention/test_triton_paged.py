"""Triton paged attention vs the torch backend (the oracle).

Without CUDA the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set only around the import of the backend and during this module's tests, so no other test sees it); with CUDA they are
compiled and run on the GPU (``benchmarks/gpu_check.sh`` runs this file there). Skipped when
triton is not importable.
"""
import importlib
import math
import os
import sys

import pytest
import torch

from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.attention.torch_paged import TorchPagedAttention, build_metadata

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _import_backend():
    """Import the Triton backend, under the interpreter when there is no GPU."""
    prev = os.environ.get("TRITON_INTERPRET")
    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton; CUDA torch pins it)")
        if DEVICE.type == "cpu" and type(triton.language.zeros).__name__ != "InterpretedFunction":
            # Imported earlier in compiled mode (transformers imports triton when installed):
            # import a fresh copy under the interpreter (earlier importers keep their own).
            stale = [m for m in sys.modules if (m == "triton" or m.startswith("triton."))
                     and not m.startswith("triton._C")]  # the C extension cannot be re-imported
            for name in stale + ["pagedllm.attention.triton_paged"]:
                sys.modules.pop(name, None)
            triton = importlib.import_module("triton")
        if DEVICE.type == "cpu" and type(triton.language.zeros).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (its helpers are compiled-mode); "
                        "run with TRITON_INTERPRET=1 in the environment", allow_module_level=True)
        # The triton package reads TRITON_INTERPRET when a kernel is decorated (module import):
        # reload a copy imported earlier in compiled mode.
        mod = sys.modules.get("pagedllm.attention.triton_paged")
        if mod is not None and DEVICE.type == "cpu" and type(mod._paged_attention_kernel).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)
        elif mod is None:
            mod = importlib.import_module("pagedllm.attention.triton_paged")
    finally:
        if prev is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = prev
    return mod


tp = _import_backend()
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    """The interpreter also reads TRITON_INTERPRET when a kernel calls a helper: keep it set
    while this module's tests run (and only then)."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_case(block_size, hq, hkv, d, reqs_spec, dtype=torch.float32, seed=0):
    """Random q/k/v for ``reqs_spec`` [(start_pos, num_new)], a cache holding random earlier context
    in scattered blocks (plus junk in unused blocks), and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((s + n) / block_size) for s, n in reqs_spec) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    reqs = []
    for s, n in reqs_spec:
        nb = math.ceil((s + n) / block_size)
        reqs.append((s, n, perm[:nb]))
        perm = perm[nb:]
    t = sum(n for _, n in reqs_spec)
    cache = torch.randn(num_blocks, 2, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    return q, k, v, cache, build_metadata(reqs, block_size)


def check(block_size, hq, hkv, d, reqs_spec, window=None, cap=None, dtype=torch.float32, seed=0):
    q, k, v, cache, meta = make_case(block_size, hq, hkv, d, reqs_spec, dtype, seed)
    scale = d ** -0.5
    ref_cache = cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_cache, meta, scale, window, cap)

    dev_cache = cache.to(DEVICE)
    qd, kd, vd = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)
    qsl, seq_lens, bt, slots = tp.device_tensors(meta, DEVICE)
    tp.reshape_and_cache(kd, vd, dev_cache, slots)
    assert torch.equal(dev_cache.cpu(), ref_cache), "cache written differs from the torch backend's"
    out = torch.full_like(qd, float("nan"))  # poisoned: every row must be written
    tp.paged_attention(qd, dev_cache, qsl, seq_lens, bt, meta.num_reqs, scale, window, cap, out=out)
    out = out.cpu()
    assert not out.isnan().any(), f"rows not written: {out.isnan().any(-1).any(-1).nonzero().flatten().tolist()}"
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)

    # The AttentionImpl entry point (metadata on CPU, moved by the backend) gives the same.
    cache2 = cache.to(DEVICE)
    out2 = tp.TritonPagedAttention().forward(qd, kd, vd, cache2, meta_copy(meta), scale, window, cap)
    assert out2.device == qd.device and out2.dtype == dtype
    torch.testing.assert_close(out2.cpu().float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(cache2.cpu(), ref_cache)


def meta_copy(meta):
    import dataclasses
    return dataclasses.replace(meta)


# Decodes first, then prefill chunks with and without earlier context, crossing block boundaries.
MIXED = [(5, 1), (0, 1), (17, 1), (0, 7), (9, 6), (3, 13)]


@pytest.mark.parametrize("block_size,hq,hkv,d", [
    (16, 4, 4, 16),   # MHA
    (16, 6, 2, 32),   # GQA 3 (padded group)
    (8, 8, 1, 64),    # MQA, head_dim 64 (SmolLM2)
    (32, 4, 2, 16),
    (4, 4, 2, 8),     # head_dim below the dot minimum (padded)
])
def test_mixed_batch(block_size, hq, hkv, d):
    check(block_size, hq, hkv, d, MIXED + [(30, 20)])


@pytest.mark.parametrize("window,cap", [(3, None), (8, 5.0), (None, 2.0), (1, None)])
def test_sliding_window_and_soft_cap(window, cap):
    check(16, 4, 2, 16, MIXED + [(20, 3), (40, 1 + 1)], window, cap, seed=7)


def test_head_dim_256_gemma_like():
    check(16, 4, 1, 256, [(20, 1), (0, 5), (14, 4)], window=6, cap=None, seed=3)


def test_decode_only_long_context_and_bf16():
    check(16, 8, 2, 32, [(70, 1), (33, 1), (0, 1), (15, 1)], seed=1)
    check(16, 4, 2, 32, MIXED, window=5, dtype=torch.bfloat16, seed=2)


def test_padding_slots_skipped_and_empty_rows():
    q, k, v, cache, meta = make_case(4, 4, 2, 16, [(0, 6)])
    meta.slot_mapping[2] = -1
    ref_cache = cache.clone()
    TorchPagedAttention().forward(q, k, v, ref_cache, meta, 0.25, None, None)
    dev_cache = cache.to(DEVICE)
    tp.reshape_and_cache(k.to(DEVICE), v.to(DEVICE), dev_cache, meta.slot_mapping.to(DEVICE))
    assert torch.equal(dev_cache.cpu(), ref_cache)
    # A padded decode row (seq_len 0, as CUDA-graph padding makes) yields zeros, not NaN.
    meta = build_metadata([(3, 1, [0]), (0, 1, [1])], 4)
    meta.seq_lens[1] = 0
    qd = torch.randn(2, 4, 16, device=DEVICE)
    out = torch.full_like(qd, float("nan"))
    qsl, sl, bt, _ = tp.device_tensors(meta, DEVICE)
    tp.paged_attention(qd, dev_cache, qsl, sl, bt, 2, 0.25, None, None, out=out)
    assert torch.equal(out[1].cpu(), torch.zeros(4, 16)) and not out[0].isnan().any()


# ----------------------------------------------------------------------------- whole model
def _tiny_pair(arch):
    import transformers as tf

    from pagedllm.models.registry import get_model_class

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64)
    if arch == "LlamaForCausalLM":
        config = tf.LlamaConfig(**common, num_key_value_heads=2, rms_norm_eps=1e-5,
                                rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    else:
        config = tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, num_key_value_heads=1, head_dim=32,
                                     sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                                     final_logit_softcapping=10.0,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(0)
    hf = getattr(tf, arch)(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15)
    sd = hf.state_dict()
    models = []
    for dev in (torch.device("cpu"), DEVICE):
        m = get_model_class([arch])(config, torch.float32)
        m.load_weights(sd.items())
        models.append(m.to(dev).eval())
    return models


class PagedRunner:
    """Drives one model through the paged path with a given backend (blocks handed out reversed)."""

    def __init__(self, model, impl, device, block_size=4, num_blocks=32):
        n_layers, hkv, d = model.get_kv_cache_spec()
        self.model, self.impl, self.device, self.bs = model, impl, device, block_size
        self.caches = [torch.zeros(num_blocks, 2, block_size, hkv, d, device=device) for _ in range(n_layers)]
        self.free = list(range(num_blocks))
        self.blocks, self.pos = {}, {}

    def step(self, chunks):
        reqs, ids, positions = [], [], []
        for rid, toks in chunks:
            start = self.pos.get(rid, 0)
            blocks = self.blocks.setdefault(rid, [])
            while len(blocks) * self.bs < start + len(toks):
                blocks.append(self.free.pop())
            reqs.append((start, len(toks), list(blocks)))
            ids += toks
            positions += range(start, start + len(toks))
            self.pos[rid] = start + len(toks)
        ctx = ForwardContext(build_metadata(reqs, self.bs), self.caches, self.impl)
        with torch.no_grad(), set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device))
            return self.model.compute_logits(hidden).float().cpu()


PROMPT = [5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 31, 2]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_tiny_model_forward_matches_torch_backend(arch):
    cpu_model, dev_model = _tiny_pair(arch)
    ref = PagedRunner(cpu_model, TorchPagedAttention(), torch.device("cpu"))
    tri = PagedRunner(dev_model, tp.TritonPagedAttention(), DEVICE)
    tol = 1e-4 if DEVICE.type == "cpu" else 2e-3
    steps = [
        [("a", PROMPT[:7])],                        # prefill chunk
        [("a", PROMPT[7:]), ("b", PROMPT[:9])],     # chunk with context + new prefill
        [("a", [11]), ("b", PROMPT[9:])],           # decode + chunk
        [("a", [50]), ("b", [93])],                 # decodes
    ]
    for chunks in steps:
        torch.testing.assert_close(tri.step(chunks), ref.step(chunks), atol=tol, rtol=tol)


def test_selector(monkeypatch):
    from pagedllm.attention import selector

    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    assert selector.get_attn_backend_name("cpu") == "torch"
    assert selector.get_attn_backend_name("cuda") == "triton"
    assert type(selector.get_attn_backend("cpu")).__name__ == "TorchPagedAttention"
    monkeypatch.setenv(selector.ENV_VAR, "triton")
    assert selector.get_attn_backend_name("cuda") == "triton"
    assert selector.get_attn_backend_name("cuda", override="torch") == "torch"  # the argument wins
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        selector.get_attn_backend_name("cpu")
    with pytest.raises(ValueError, match="must be one of"):
        selector.get_attn_backend_name("cpu", override="bogus")
    if not selector.flashinfer_available():
        with pytest.raises(ValueError, match="flashinfer"):
            selector.get_attn_backend_name("cuda", override="flashinfer")


def test_cuda_graph_sizes_and_cpu_noop():
    from pagedllm.worker.cuda_graphs import CudaGraphRunner, capture_sizes

    assert capture_sizes(1) == [1] and capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8] and capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35
    r = CudaGraphRunner(torch.nn.Identity(), None, [], 16, 4, 16, torch.device("cpu"))
    assert r.capture() == 0.0 and not r.can_run(build_metadata([(3, 1, [1])], 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager():
    from pagedllm.worker.cuda_graphs import CudaGraphRunner

    _, model = _tiny_pair("Gemma3ForCausalLM")
    eager = PagedRunner(model, tp.TritonPagedAttention(), DEVICE)
    graph = PagedRunner(model, tp.TritonPagedAttention(), DEVICE)
    g = CudaGraphRunner(model, graph.impl, graph.caches, 8, 8, graph.bs, DEVICE)
    g.capture()
    prompts = {f"r{i}": PROMPT[: 5 + i] for i in range(3)}
    for r in (eager, graph):
        r.step(list(prompts.items()))
    for tok in (11, 50, 93):
        chunks = [(rid, [tok]) for rid in prompts]
        ref = eager.step(chunks)
        # the same step through the graph: build metadata as PagedRunner does, then replay
        reqs = []
        for rid, toks in chunks:
            start = graph.pos[rid]
            blocks = graph.blocks[rid]
            while len(blocks) * graph.bs < start + 1:
                blocks.append(graph.free.pop())
            reqs.append((start, 1, list(blocks)))
            graph.pos[rid] = start + 1
        meta = build_metadata(reqs, graph.bs)
        assert g.can_run(meta)
        ids = torch.tensor([tok] * 3, device=DEVICE)
        pos = torch.tensor([s for s, _, _ in reqs], device=DEVICE)
        with torch.inference_mode():  # as the model runner does: the graph's output is an inference tensor
            hidden = g.run(ids, pos, meta)
            out = model.compute_logits(hidden).float().cpu()
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
