"""Shared fixtures. Real models and their transformers references load once per session."""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("PAGEDLLM_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PAGEDLLM_WEIGHT_CACHE_DIR" not in os.environ:
    # NOTE: the mapped-weight cache (loader/mapped_weights.py) of every GGUF a test loads goes to a
    # per-session directory (servers started by tests inherit it), not to the user's ~/.cache
    import atexit
    import shutil
    import tempfile

    os.environ["PAGEDLLM_WEIGHT_CACHE_DIR"] = tempfile.mkdtemp(prefix="pagedllm-weights-")
    atexit.register(shutil.rmtree, os.environ["PAGEDLLM_WEIGHT_CACHE_DIR"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

#: CPU flags that select a kernel path, in the order the summary lists them.
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_paths() -> list[tuple[str, bool, str]]:
    """The CPU kernel paths the suite can exercise: (name, available here, why / what it needs).

    A path is available when the C++ extension built it for this CPU (``-march=native``) and the
    CPU has the flags it needs; ISA-gated tests skip with the same reason when it is not."""
    from pagedllm.kernels.cpu_ops import get_ops
    from pagedllm.kernels.onednn import pack_bf16_weight

    flags = _cpu_flags()
    from pagedllm.kernels.cpu_ops import get_intdot_ops

    ops = get_ops()
    idot = get_intdot_ops()
    bf16 = torch.empty(1, 1, 64, dtype=torch.bfloat16)
    built = ops is not None
    return [
        ("C++ kernels (portable + -march=native)", built, "needs a C++ compiler at first use"),
        ("AVX2/FMA group GEMM (GGUF blocks)", built and {"avx2", "fma", "f16c"} <= flags, "needs avx2, fma, f16c"),
        ("AVX512-VNNI packed int8 GEMM (W8A8)", built and ops.int8_gemm_supported(), "needs avx512_vnni, avx512bw"),
        ("AVX512-BF16 prefill attention", built and ops.prefill_supported(bf16), "needs avx512_bf16"),
        ("AVX512-BF16 fp8 KV-cache kernels", built and hasattr(ops, "kv_fp8_supported") and ops.kv_fp8_supported(bf16),
         "needs avx512_bf16"),
        ("oneDNN bf16 weight prepack", pack_bf16_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None,
         "needs avx512bw/vl/dq or avx_ne_convert"),
        *[(f"integer-dot GGUF GEMM, {name} path", idot is not None and idot.intdot_isa_supported(i), f"needs {need}")
          for i, name, need in ((1, "AVX2", "avx2, fma"), (2, "AVX512-VNNI", "avx512_vnni, avx512bw"))],
        ("AMX tiles (oneDNN bf16/int8)", bool({"amx_bf16", "amx_int8"} & flags), "needs amx_bf16 / amx_int8"),
    ]


def _isa_lines() -> list[str]:
    import platform as _platform

    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                 _platform.processor()) if os.path.exists("/proc/cpuinfo") else _platform.processor()
    flags = _cpu_flags()
    lines = [f"CPU: {model}; ISA-gated kernel paths whose tests run or skip here; flags: {' '.join(f for f in _ISA_FLAGS if f in flags) or 'none of ' + '/'.join(_ISA_FLAGS)}"]
    for name, ok, why in isa_paths():
        lines.append(f"  {'runs ' if ok else 'skips'} {name}" + ("" if ok else f" ({why}: not on this CPU)"))
    return lines


# The slowest test files, longest first (seconds per file summed from the junit times of the full run
# under xdist, 2026-12-01 23:00, less what this list's commit saved): pytest-xdist's --dist loadfile hands
# files to the workers in collection order (with --loadscope-reorder off, see pytest_configure), so the long
# ones go first and none starts last to run alone at the end (longest-first scheduling). The first file
# builds both transformers references (hf_smollm2, hf_gemma3: 10 s, 28 s); the other files that use them
# (loader, pooling_real, real_parity, lora_real, sampling_real) come after the next five long ones, so a
# worker loads the saved reference instead of waiting on the lock while the other builds it (that wait
# was 36 s of one worker doing nothing).
SLOW_FILES_FIRST = [
    "tests/engine/test_generate_real.py", "tests/distributed/test_tensor_parallel.py",
    "tests/distributed/test_real_parallel.py", "tests/spec_decode/test_spec_real.py",
    "tests/entrypoints/test_chat_cli_real.py", "tests/engine/test_memory_soak.py", "tests/loader/test_loader.py",
    "tests/distributed/test_ray_two_nodes.py", "tests/structured_output/test_structured_real.py",
    "tests/engine/test_lazy_kv.py", "tests/engine/test_prefix_caching_real.py", "tests/quantization/test_gguf_blocks.py",
    "tests/pooling/test_pooling_real.py", "tests/entrypoints/test_structured_server_real.py",
    "tests/pooling/test_gemma_recipe_served.py", "tests/entrypoints/test_p2p_disagg_server.py",
    "tests/quantization/test_checkpoint_formats.py", "tests/distributed/test_server_parallel.py",
    "tests/entrypoints/test_router.py", "tests/examples/test_examples.py", "tests/entrypoints/test_cli_errors.py",
    "tests/lora/test_lora_real.py", "tests/entrypoints/test_run_local_real.py",
    "tests/entrypoints/test_tools_server_real.py", "tests/engine/test_intdot_schedules_real.py",
    "tests/engine/test_sampling_real.py", "tests/engine/test_workspace_bound.py",
    "tests/distributed/test_tensor_parallel_archs.py", "tests/entrypoints/test_run_batch.py",
    "tests/multimodal/test_mm_server.py", "tests/entrypoints/test_ollama_server_real.py",
    "tests/entrypoints/test_dp_serve.py", "tests/spec_decode/test_mtp_eagle3_server.py",
    "tests/spec_decode/test_mtp_eagle3_engine.py", "tests/kernels/test_cpu_allocator.py",
    "tests/spec_decode/test_spec_server.py", "tests/models/test_real_parity.py",
    "tests/entrypoints/test_web_chat_browser.py", "tests/entrypoints/test_server_real.py",
    "tests/distributed/test_ray.py", "tests/entrypoints/test_hub_serve_real.py", "tests/multimodal/test_vlm_server.py",
]


# Files whose tests start processes (a ``pagedllm serve`` or CLI subprocess, TP/PP ranks, data-parallel
# replicas, a Ray cluster, example scripts): marked ``slow`` at collection, with the real-model tests
# (their own ``pytestmark``), so ``-m "not slow"`` is the quick in-process tier (README, "Tests").
PROCESS_FILES = frozenset([
    "tests/distributed/test_tensor_parallel.py", "tests/distributed/test_tensor_parallel_archs.py",
    "tests/distributed/test_server_parallel.py", "tests/distributed/test_ray.py",
    "tests/engine/test_llm_data_parallel.py", "tests/entrypoints/test_dp_serve.py",
    "tests/entrypoints/test_kv_tiers_server.py", "tests/entrypoints/test_p2p_disagg_server.py",
    "tests/entrypoints/test_router.py", "tests/entrypoints/test_cli_errors.py", "tests/lora/test_lora_server.py",
    "tests/multimodal/test_mm_server.py", "tests/multimodal/test_vlm_server.py", "tests/loader/test_gguf_mmproj.py",
    "tests/spec_decode/test_mtp_eagle3_server.py", "tests/spec_decode/test_gemma4_target.py",
    "tests/examples/test_examples.py",
])
# Single tests that start processes in files that are otherwise in-process ("file::function").
PROCESS_TESTS = frozenset([
    "tests/engine/test_sleep_mode.py::test_sleep_two_tensor_parallel_ranks",
    "tests/kernels/test_cpu_allocator.py::test_engine_installs_it_unless_disabled",
    "tests/lora/test_lora_engine.py::test_worker_in_another_process",
    "tests/loader/test_loader.py::test_gguf_load_skips_heavy_imports",
])


def pytest_configure(config):
    """Keep the collection order under pytest-xdist's --dist loadfile: its default
    ``--loadscope-reorder`` sorts the files by their number of tests (most first), which put the
    long files with few tests (real servers, TP, Ray) last and undid ``SLOW_FILES_FIRST``."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # NOTE: before ``-m`` deselects, so the marks below count
def pytest_collection_modifyitems(session, config, items):
    """Mark the tests of ``PROCESS_FILES`` and ``PROCESS_TESTS`` slow, and order the collected tests so the files of
    ``SLOW_FILES_FIRST`` come first (in that order); every file's tests stay together and in their
    own order."""
    rank = {f: i for i, f in enumerate(SLOW_FILES_FIRST)}

    def rel(item):
        return os.path.relpath(str(item.path), str(config.rootpath)).replace(os.sep, "/")

    for item in items:
        f = rel(item)
        if f in PROCESS_FILES or f"{f}::{getattr(item, 'originalname', item.name)}" in PROCESS_TESTS:
            item.add_marker(pytest.mark.slow)
    items[:] = sorted(items, key=lambda item: rank.get(rel(item), len(rank)))  # stable: others keep pytest's order


def pytest_report_header(config):
    """Name the CPU and the ISA paths the suite exercises at the top of the run."""
    try:
        return _isa_lines()
    except Exception as e:  # the header must never stop a run
        return [f"ISA paths: unknown ({e})"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Repeat the ISA paths at the end, with the ISA-gated tests that skipped for a missing flag."""
    try:
        lines = _isa_lines()
    except Exception as e:
        lines = [f"ISA paths: unknown ({e})"]
    words = ("avx", "vnni", "bf16", "amx", "onednn cannot pack")
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if any(w in str(getattr(r, "longrepr", "")).lower() for w in words)]
    terminalreporter.section("CPU kernel paths (ISA)")
    for ln in lines:
        terminalreporter.write_line(ln)
    terminalreporter.write_line(f"ISA-gated tests skipped for a missing CPU feature: {len(skipped)}")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from pagedllm.loader import get_smollm2_gguf_path
    return get_smollm2_gguf_path()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from pagedllm.loader import get_gemma3_gguf_path
    return get_gemma3_gguf_path()


@contextlib.contextmanager
def _one_gguf_parse():
    """While active, transformers reads each GGUF's metadata once instead of once per use.

    ``from_pretrained(gguf_file=...)`` of a model and then of its tokenizer calls
    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` three times (config, tensors,
    tokenizer), each building a new ``gguf.GGUFReader`` (its Python walk over the vocabulary
    arrays: ~80% of the reference build, ~10 s per pass for Gemma 3's 262k tokens) and parsing every
    field again. Here one reader per file is shared and the metadata-only result
    (``return_tensors=False``) is parsed once and handed out as deep copies: the same transformers
    code on the same bytes, so the reference model and tokenizer are unchanged."""
    import copy

    import gguf
    import numpy as np
    import transformers.modeling_gguf_pytorch_utils as mgu

    reader_cls, load = gguf.GGUFReader, mgu.load_gguf_checkpoint

    class _ArrayReader(reader_cls):
        """``gguf.GGUFReader`` whose mapped file is a plain ``ndarray`` view of its ``np.memmap``:
        the same bytes and the same parsing code, but every one of the ~10M small slices its
        field walk takes is a C-level ndarray index instead of a ``memmap`` subclass object with a
        Python ``__array_finalize__`` (Gemma 3: 3.6 s instead of 11-12 s per reader)."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value
    readers: dict = {}
    metadata: dict = {}

    def reader(path, *a, **kw):
        key = (os.path.realpath(path), a, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = _ArrayReader(path, *a, **kw)
        return readers[key]

    def load_checkpoint(path, return_tensors=False, *a, **kw):
        if return_tensors or a or kw:
            return load(path, return_tensors, *a, **kw)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = load(path, False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, mgu.load_gguf_checkpoint = reader, load_checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, mgu.load_gguf_checkpoint = reader_cls, load


def _hf_from_gguf(path: str, shared_dir=None):
    """(transformers model fp32 in eval mode, tokenizer) read from the GGUF at ``path``.

    Under pytest-xdist (``shared_dir``: the run's directory all workers share) the first worker to
    need a reference builds it from the GGUF and pickles it there; the others load that pickle
    (~2 s instead of 15-40 s of transformers' GGUF parsing, which is mostly its Python reading of
    the vocabulary): the same tensors, config and tokenizer, built once per test session."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def build():
        d, f = os.path.dirname(path), os.path.basename(path)
        with _one_gguf_parse():
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
            model.eval()
            return model, AutoTokenizer.from_pretrained(d, gguf_file=f)

    if shared_dir is None:
        return build()
    from filelock import FileLock

    cached = os.path.join(str(shared_dir), "hf-ref-" + os.path.basename(path) + ".pt")
    with FileLock(cached + ".lock"):
        if os.path.exists(cached):
            return torch.load(cached, weights_only=False)
        ref = build()
        torch.save(ref, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
        return ref


@pytest.fixture(scope="session")
def _xdist_shared_dir(tmp_path_factory):
    """The directory every pytest-xdist worker of this run shares, or None when not under xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return tmp_path_factory.getbasetemp().parent


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    """transformers' tokenizer of the SmolLM2 GGUF (skips when the GGUF is not installed)."""
    from transformers import AutoTokenizer

    if not os.path.exists(smollm2_path):
        pytest.skip("SmolLM2 GGUF not available")
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path, _xdist_shared_dir):
    """(transformers LlamaForCausalLM fp32, tokenizer) from the SmolLM2 GGUF (~15 s; built once per run)."""
    return _hf_from_gguf(smollm2_path, _xdist_shared_dir)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path, _xdist_shared_dir):
    """(transformers Gemma3ForCausalLM fp32, tokenizer) from the Gemma 3 GGUF (~40 s; built once per run)."""
    return _hf_from_gguf(gemma3_path, _xdist_shared_dir)


@pytest.fixture(scope="session")
def smollm2_llm():
    """A float32 SmolLM2 LLM shared by the real-model engine tests: the Q4_1 file dequantized at load
    (``quantization="none"``), the same float32 weights transformers uses (the default, native
    blocks, is covered by tests/quantization/test_gguf_blocks.py)."""
    from pagedllm import LLM
    return LLM("SmolLM2-135M-Instruct", dtype="float32", kv_cache_memory=256 * 1024**2,
               max_num_batched_tokens=512, seed=0, quantization="none")


@pytest.fixture(scope="session")
def tiny_smollm2_llama_dir(tmp_path_factory, smollm2_path) -> str:
    """A tiny random Llama checkpoint (``tiny_models.save_tiny_llama``, seed 5, untied head) with
    SmolLM2's tokenizer (vocab 49152), written once per session; tests only read it."""
    from tiny_models import save_tiny_llama

    from pagedllm.loader.tokenizer import load_tokenizer

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_smollm2_llama")), load_tokenizer(smollm2_path), 5)


def make_tiny_llama(tie: bool, dtype: torch.dtype = torch.float32, std: float = 0.02):
    """A 2-layer random pagedllm Llama (vocab 512, hidden 128, GQA 4/2) with fixed weights:
    norms 1, embeddings N(0, 1), other matrices N(0, std); built in ``dtype``."""
    from transformers import LlamaConfig

    from pagedllm.models.llama import LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 1.0 if "embed" in name else (std if p.dim() > 1 else 0.0))
    return model.eval()


@pytest.fixture
def tiny_llama():
    """Factory fixture: ``tiny_llama(tie, dtype=torch.float32, std=0.02)`` (see ``make_tiny_llama``)."""
    return make_tiny_llama


@pytest.fixture(scope="module", autouse=True)
def _gguf_float_activations(request):
    """For a test module that sets ``GGUF_FLOAT_ACTIVATIONS = True``: GGUF layers run with float
    activations (``group_gemm``, as ``PAGEDLLM_GGUF_INTDOT=0``) for the whole module, whatever the
    environment says. Like with like: such modules compare the GGUF file kept in its blocks token for
    token with the same weights dequantized to float32 (transformers), exact only with float
    activations; the integer-dot path (int8 activations) has its own checks in
    tests/engine/test_intdot_schedules_real.py. Module scope, so it holds before the module's
    reference fixtures."""
    if not getattr(request.module, "GGUF_FLOAT_ACTIVATIONS", False):
        yield
        return
    from pagedllm.quantization import group_quant as gq

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gq, "INTDOT", False)
        yield
