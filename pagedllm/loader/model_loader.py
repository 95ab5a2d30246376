"""Build a runnable model for one rank, as explicit, ordered steps (vLLM's ``build -> load_weights ->
process_weights_after_loading`` shape).

    built = build_model(args, parallel, device, dtype, kv_cache_dtype)
    built.model, built.loaded, built.pooler, built.lora_manager, built.weight_bytes, ...

``MODEL_BUILD_STEPS`` below is the one place that states the order; each step is a small function of
the ``ModelBuild`` state and says in its docstring what it needs done before it. The order and why:

1. ``read_checkpoint``: config, tokenizer and a lazy weight iterator (``loader.load_model``); nothing
   is read from the weight files yet.
2. ``resolve_architecture``: the model class (the pooling runner maps ``*ForSequenceClassification``
   onto the causal-LM body).
3. ``choose_weight_format``: whether the checkpoint's quantized format is kept. It must run before
   the weights are iterated: dropping ``loaded.quant_config`` makes ``weights()`` dequantize instead
   (tensor parallelism cannot split quantized tensors; batch invariance needs float weights, except
   GGUF blocks on the integer-dot GEMM).
4. ``construct``: the model's modules on the device, parameters uninitialised.
5. ``shard``: tensor/pipeline-parallel slicing of the modules. Before quantization (a method
   quantizes this rank's slice) and before loading (the weight loaders then copy only this rank's
   slices).
6. ``attach_quantization``: each linear/embedding gets its ``quant_method``, which creates the
   parameters the checkpoint's tensors load into; hence after sharding and before loading.
7. ``load_weights``: the checkpoint's tensors go through the parameters' loaders (or dummy weights);
   a pooling model's head tensors are split off first.
8. ``process_weights_after_loading``: each method repacks/quantizes what was loaded; a tied LM
   head may get its own quantized copy; model-level fusions (W8A8 norms that emit int8 rows).
9. ``select_kernels``: the float linears' kernels: batch-invariant GEMMs, or oneDNN-packed bf16.
   After quantization (only unquantized layers are packed; batch invariance dequantizes what the
   invariant GEMMs cannot run) and before the weights are mapped (the packed copies are what stays
   resident).
10. ``map_weights``: serve the final parameters from the mapped weight cache
    (``loader.mapped_weights``): after every step that replaces a tensor.
11. ``wrap_lora``: LoRA wrappers around the projections; after quantization and kernel selection
    (the wrapper calls whatever the base layer runs), before the tensor-parallel collectives
    (which wrap the outermost module).
12. ``install_communication``: tensor-parallel all-reduce / gather wrappers; last, since every
    earlier step may replace or repack the linears.
13. ``build_pooler``: the pooling runner's pooler over the finished model.

The worker then loads a speculative draft (which needs the finished target) and builds the runner,
with the runner-level decode accelerator (``worker.fused_decode.build_decode_accelerator``) chosen
once from the finished model.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pagedllm.metrics.memory import format_bytes as fmt_bytes

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class ParallelSetup:
    """This rank's place in the replica: tensor-parallel rank/size, pipeline stage/count."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def sharded(self) -> bool:
        """More than one rank holds a part of the model."""
        return self.tp_size * self.pp_size > 1


@dataclass
class ModelBuild:
    """The state the build steps pass along (one instance per ``build_model`` call).

    Attributes:
        args: the ``EngineArgs``; parallel, device, dtype, kv_cache_dtype: this rank's setup.
        load_tokenizer: also load the tokenizer.
        loaded: the ``LoadedModel`` (after ``read_checkpoint``); model_cls: the model class.
        batch_invariant: batch-invariant mode requested (``EngineArgs.batch_invariant`` / env).
        model: the model (after ``construct``).
        weights: the checkpoint's (name, tensor) iterator to load (after ``shard``).
        pool_head: the pooling head's tensors split off the checkpoint ({"weight", "bias"}).
        quant: the quantization config the weights load with (None = float weights).
        weight_bytes: resident parameter and buffer bytes (plus oneDNN-packed copies).
        mapped_weights: the ``MappedWeights`` of ``map_weights``.
        lora_manager: the ``LoRAModelManager`` (``enable_lora``) or None.
        pooler: the pooling runner's pooler or None.
    """

    args: Any
    parallel: ParallelSetup
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    load_tokenizer: bool = True
    loaded: Any = None
    model_cls: Any = None
    batch_invariant: bool = False
    model: Any = None
    weights: Any = None
    pool_head: dict = field(default_factory=dict)
    quant: Any = None
    weight_bytes: int = 0
    mapped_weights: Any = None
    lora_manager: Any = None
    pooler: Any = None
    seconds: dict = field(default_factory=dict)

    def resident_bytes(self) -> int:
        """Bytes of the model's parameters and buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))


def hub_kwargs(args: Any) -> dict:
    """``loader.load_model``'s Hub and format keywords from the engine arguments."""
    return dict(revision=args.revision, download_dir=args.download_dir, load_format=args.load_format,
                tokenizer_revision=args.tokenizer_revision, hf_config_path=args.hf_config_path,
                mmproj=getattr(args, "mmproj", None))


def checkpoint_files(loaded: Any) -> list[str]:
    """The weight files of a loaded checkpoint: the .gguf file, or an HF directory's safetensors."""
    if loaded is None or loaded.load_format == "dummy":
        return []
    if loaded.source == "gguf":
        return [loaded.model_path] + ([loaded.mmproj.path] if getattr(loaded, "mmproj", None) else [])
    from pagedllm.loader.hf_loader import safetensors_files

    try:
        return safetensors_files(loaded.model_path, None)
    except (OSError, ValueError):
        return []


def checkpoint_bytes(loaded: Any) -> int:
    """Total size of ``checkpoint_files(loaded)`` in bytes."""
    total = 0
    for p in checkpoint_files(loaded):
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total


def read_checkpoint(b: ModelBuild) -> None:
    """Config, tokenizer and lazy weights of ``args.model``, with ``hf_overrides`` applied."""
    from pagedllm.config import apply_hf_overrides
    from pagedllm.loader import load_model

    args = b.args
    b.loaded = load_model(args.model, dtype=b.dtype, tokenizer=args.tokenizer,
                          ignore_patterns=args.ignore_patterns or None, load_tokenizer=b.load_tokenizer,
                          quantization=args.quantization, **hub_kwargs(args))
    if args.hf_overrides is not None:
        b.loaded.hf_config = apply_hf_overrides(b.loaded.hf_config, args.hf_overrides)


def resolve_architecture(b: ModelBuild) -> None:
    """The model class for the config's architectures and the runner.

    Raises:
        ValueError: a runner other than "generate" / "pooling", or an unsupported architecture.
    """
    from pagedllm.models.registry import get_model_class

    args, hf_config = b.args, b.loaded.hf_config
    if args.runner not in ("generate", "pooling"):
        raise ValueError(f"runner: must be 'generate' or 'pooling', got {args.runner!r}")
    archs = list(getattr(hf_config, "architectures", None) or [])
    if args.runner == "pooling":
        # *ForSequenceClassification / bare *Model checkpoints load into the causal-LM body.
        from pagedllm.pooling.adapters import pooling_architectures
        archs = pooling_architectures(archs)
    b.model_cls = get_model_class(archs, args.model_impl if args.runner == "generate" else "pagedllm", hf_config)


def choose_weight_format(b: ModelBuild) -> None:
    """Keep the checkpoint's quantized format, or drop it (``weights()`` then dequantizes) where
    tensor parallelism or batch invariance cannot run it. Before anything iterates the weights.

    Raises:
        ValueError: settings batch-invariant mode does not cover; a tensor-parallel split of a
            quantized HF checkpoint.
    """
    from pagedllm.worker.batch_invariant import batch_invariant_requested, check_batch_invariant_supported

    args, loaded, tp = b.args, b.loaded, b.parallel.tp_size
    b.batch_invariant = batch_invariant_requested(args)
    if b.batch_invariant:
        check_batch_invariant_supported(args, b.device, b.dtype, b.kv_cache_dtype)
    dtype_name = str(b.dtype).replace("torch.", "")
    quant = loaded.quant_config
    if quant is not None and not quant.on_the_fly and tp > 1:
        # NOTE: the tensor-parallel weight loaders slice float tensors; quantized ones have no split yet
        if loaded.source != "gguf":
            raise ValueError(f"tensor_parallel_size: {tp} ranks cannot split a {quant.name} checkpoint "
                             f"kept quantized yet (dequantizing it needs the full tensors on every rank)")
        logger.warning("pagedllm: tensor_parallel_size %d: the GGUF blocks are dequantized to %s at load "
                       "(quantized shards are not split yet)", tp, dtype_name)
        loaded.quant_config = quant = None
    gguf_kept = False
    if quant is not None and not quant.on_the_fly and b.batch_invariant and loaded.source == "gguf" \
            and b.device.type == "cpu":
        from pagedllm.worker.batch_invariant import intdot_available
        gguf_kept = intdot_available()
        if gguf_kept:
            # the integer-dot GEMM is batch invariant by construction: GGUF int4 / int8 group-32
            # layers keep their blocks; the others are dequantized by enable_batch_invariant
            logger.info("pagedllm: batch_invariant: GGUF blocks kept (integer-dot GEMM; other block "
                        "types dequantized to %s)", dtype_name)
        else:
            logger.warning("pagedllm: batch_invariant: the GGUF checkpoint's weights are dequantized to %s "
                           "at load (integer-dot kernel off or not built)", dtype_name)
            loaded.quant_config = quant = None
    if quant is not None and not quant.on_the_fly and b.batch_invariant and not gguf_kept:
        # NOTE: the batch-invariant GEMMs take float weights
        logger.warning("pagedllm: batch_invariant: the %s checkpoint's weights are dequantized to %s at load",
                       quant.name, dtype_name)
        loaded.quant_config = quant = None
    b.quant = quant


def construct(b: ModelBuild) -> None:
    """The model's modules on the device (parameters uninitialised)."""
    with torch.device(b.device):
        b.model = b.model_cls(b.loaded.hf_config, b.dtype)


def shard(b: ModelBuild) -> None:
    """Tensor/pipeline-parallel slicing (several ranks), and the checkpoint iterator to load
    (a pooling model's head tensors split off). Before quantization and loading."""
    p = b.parallel
    if p.sharded:
        from pagedllm.distributed.sharding import shard_model
        shard_model(b.model, p.tp_rank, p.tp_size, p.pp_rank, p.pp_size)
    b.weights = b.loaded.weights()
    if b.args.runner == "pooling":
        from pagedllm.pooling.adapters import drop_lm_head, split_head_weights
        drop_lm_head(b.model)
        b.weights = split_head_weights(b.weights, b.pool_head)


def attach_quantization(b: ModelBuild) -> None:
    """Give each layer its quantization method, which creates the parameters to load into."""
    if b.quant is not None:
        from pagedllm.quantization import attach_quantization as attach
        attach(b.model, b.quant, quantize_lm_head=b.args.runner == "generate")


def load_weights(b: ModelBuild) -> None:
    """Copy the checkpoint's tensors into the parameters (dummy weights: small random values).

    Raises:
        ValueError: a checkpoint that does not fit the model (annotated with what to check).
    """
    args, loaded, model = b.args, b.loaded, b.model
    if loaded.load_format == "dummy":
        from pagedllm.loader.dummy import initialize_dummy_weights
        initialize_dummy_weights(model, args.seed)
    elif loaded.source == "hf" and not b.parallel.sharded:
        from pagedllm.loader.hf_loader import check_checkpoint_files, safetensors_files
        check_checkpoint_files(model, loaded.model_path,
                               safetensors_files(loaded.model_path, args.ignore_patterns or None),
                               skip_names=("score.weight", "score.bias") if args.runner == "pooling" else ())
    try:
        if loaded.load_format != "dummy":
            model.load_weights(b.weights)
    except ValueError as e:
        from pagedllm.loader.hf_loader import annotate_load_error
        raise annotate_load_error(e, loaded, args.ignore_patterns or None, b.model_cls.__name__) from None
    b.weights = None
    model.eval()


def process_weights_after_loading(b: ModelBuild) -> None:
    """Each quantization method turns what was loaded into its kernel's layout; logs the sizes."""
    if b.quant is not None:
        from pagedllm.quantization import process_quantized_model
        qstats = process_quantized_model(b.model, b.quant)
        logger.info("pagedllm: quantization %s: %d linear layers, %s -> %s", b.quant.describe(),
                    qstats["num_linears"], fmt_bytes(qstats["float_bytes"]), fmt_bytes(qstats["quantized_bytes"]))
    b.weight_bytes = b.resident_bytes()


def select_kernels(b: ModelBuild) -> None:
    """The float linears' kernels: batch-invariant GEMMs (batch-invariant mode), else oneDNN-packed
    bf16 weights on CPU, and float32 ones where ``kernels.onednn.float32_packing_wanted`` (their
    dense copies dropped; a tied head gets a packed copy)."""
    if b.batch_invariant:
        from pagedllm.worker.batch_invariant import enable_batch_invariant
        # NOTE: instead of oneDNN prepacking: the invariant GEMM reads the dense weights.
        enable_batch_invariant(b.model)
        logger.info("pagedllm: batch-invariant mode: outputs do not depend on batching, chunking or caching")
    elif b.device.type == "cpu" and b.dtype in (torch.bfloat16, torch.float32):
        from pagedllm.kernels.onednn import prepack_cpu_linears
        packed = prepack_cpu_linears(b.model, pack_head=b.args.runner == "generate")
        b.weight_bytes = b.resident_bytes() + packed


def map_weights(b: ModelBuild) -> None:
    """Serve the final parameters from the mapped weight cache (``loader.mapped_weights``): GGUF
    checkpoints on CPU by default, safetensors too with ``PAGEDLLM_WEIGHT_MMAP=all``; one rank only
    (a shard's tensors differ per rank); logs what was mapped."""
    from pagedllm import envs
    from pagedllm.loader.mapped_weights import MappedWeights, map_model_weights

    args, loaded = b.args, b.loaded
    mode = envs.get("PAGEDLLM_WEIGHT_MMAP")
    wanted = loaded.source == "gguf" or (mode == "all" and loaded.load_format == "safetensors")
    # NOTE: not with sleep mode: a sleeping engine frees weight storages (pagedllm.worker.sleep),
    # which a mapping of the cache file would keep resident.
    if (mode == "0" or not wanted or loaded.load_format == "dummy" or b.parallel.sharded
            or b.device.type != "cpu" or args.runner != "generate" or getattr(args, "enable_sleep_mode", False)):
        b.mapped_weights = MappedWeights()
        return
    options = {"dtype": str(b.dtype), "quantization": args.quantization, "source": loaded.source,
               "batch_invariant": bool(b.batch_invariant), "hf_overrides": args.hf_overrides,
               "quant": type(loaded.quant_config).__name__ if loaded.quant_config is not None else None}
    # oneDNN-packed linears (select_kernels) drop their dense weights: the cached tensors differ
    # (only added when some are packed, so that other models' existing cache keys stay valid)
    packed = sum(1 for m in b.model.modules() if getattr(m, "onednn_weight", None) is not None)
    if packed:
        options["onednn_packed"] = packed
    t = time.perf_counter()
    mw = b.mapped_weights = map_model_weights(b.model, checkpoint_files(loaded), options)
    if mw.path is not None:
        logger.info("pagedllm: weights: %s mapped from %s (%s, %.2f s; file-backed pages), %s kept as copies",
                    fmt_bytes(mw.mapped_bytes), mw.path, mw.status, time.perf_counter() - t,
                    fmt_bytes(mw.copied_bytes))
    else:
        logger.info("pagedllm: weights kept as copies (weight cache %s)", mw.status)


def wrap_lora(b: ModelBuild) -> None:
    """``enable_lora``: wrap the projections for LoRA and make the ``LoRAModelManager``.

    Raises:
        ValueError: bad LoRA limits, or tensor parallelism (adapters are not sharded).
    """
    if not b.args.enable_lora:
        return
    from pagedllm.lora.model_manager import LoRAModelManager

    max_loras, max_rank, max_cpu = b.args.lora_limits()
    if b.parallel.tp_size > 1:
        raise ValueError("enable_lora: LoRA adapters are not split across tensor-parallel ranks yet; use "
                         "tensor_parallel_size=1 (pipeline or data parallelism work)")
    b.lora_manager = LoRAModelManager(b.model, max_loras, max_rank, max_cpu, b.dtype, b.device)


def install_communication(b: ModelBuild) -> None:
    """Several ranks: the tensor-parallel collectives around the (final) linears."""
    if b.parallel.sharded:
        from pagedllm.distributed.sharding import install_communication as install
        install(b.model)


def build_pooler(b: ModelBuild) -> None:
    """The pooling runner's pooler (with the head tensors split off the checkpoint)."""
    if b.args.runner == "pooling":
        from pagedllm.pooling.pooler import build_pooler as build
        b.pooler = build(b.args, b.loaded.hf_config, b.model, b.pool_head.get("weight"), b.pool_head.get("bias"))


#: The build, in order (see the module docstring for why each step sits where it does).
MODEL_BUILD_STEPS: tuple[Callable[[ModelBuild], None], ...] = (
    read_checkpoint,
    resolve_architecture,
    choose_weight_format,
    construct,
    shard,
    attach_quantization,
    load_weights,
    process_weights_after_loading,
    select_kernels,
    map_weights,
    wrap_lora,
    install_communication,
    build_pooler,
)


def build_model(args: Any, parallel: ParallelSetup, device: torch.device, dtype: torch.dtype,
                kv_cache_dtype: torch.dtype, load_tokenizer: bool = True,
                steps: Optional[tuple[Callable[[ModelBuild], None], ...]] = None) -> ModelBuild:
    """Build this rank's runnable model: run ``MODEL_BUILD_STEPS`` (or ``steps``) in order.

    Args:
        args: the ``EngineArgs``.
        parallel: this rank's ``ParallelSetup``.
        device, dtype, kv_cache_dtype: resolved by ``Worker.init_device``.
        load_tokenizer: also load the tokenizer.
        steps: the steps to run (tests; default all of them).

    Returns:
        the finished ``ModelBuild`` (``model``, ``loaded``, ``pooler``, ``lora_manager``,
        ``mapped_weights``, ``weight_bytes``, ``batch_invariant``; ``seconds`` per step).

    Raises:
        ValueError: unknown model / bad settings, a checkpoint that does not fit the model, or a
            model this tensor/pipeline split cannot take.
    """
    b = ModelBuild(args=args, parallel=parallel, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                   load_tokenizer=load_tokenizer)
    for step in steps if steps is not None else MODEL_BUILD_STEPS:
        t = time.perf_counter()
        step(b)
        b.seconds[step.__name__] = time.perf_counter() - t
    return b
