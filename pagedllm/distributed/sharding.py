"""Entry points the worker calls to split a built model over a replica's ranks.

``shard_model`` (before loading: tensor-parallel shards, then this pipeline stage's layers),
``install_communication`` (after loading, quantization and prepacking: the collectives) and
``local_kv_cache_spec`` (the KV cache shape this rank holds).
"""
from __future__ import annotations

from torch import nn

from pagedllm.attention.layer import Attention


def shard_model(model: nn.Module, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
    """Split ``model`` in place for rank ``(tp_rank, pp_rank)`` (see ``tensor_parallel`` and
    ``pipeline``).

    Raises:
        ValueError: a model or head count the split cannot take (the message names it).
    """
    if tp_size > 1:
        from pagedllm.distributed.tensor_parallel import shard_tensor_parallel
        shard_tensor_parallel(model, tp_rank, tp_size)
    if pp_size > 1:
        from pagedllm.distributed.pipeline import shard_pipeline
        shard_pipeline(model, pp_rank, pp_size)
    model.parallel = (tp_rank, tp_size, pp_rank, pp_size)


def install_communication(model: nn.Module) -> None:
    """Add the all-reduces, the logits gather and the stage sends/receives' logits rule."""
    _tp_rank, tp_size, _pp_rank, pp_size = model.parallel
    if tp_size > 1:
        from pagedllm.distributed.tensor_parallel import install_tensor_parallel_comm
        install_tensor_parallel_comm(model)
    if pp_size > 1:
        from pagedllm.distributed.pipeline import install_pipeline_comm
        install_pipeline_comm(model)


def local_kv_cache_spec(model: nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of this rank's attention layers.

    Raises:
        ValueError: layers with different KV head counts or head sizes (one cache shape per rank).
    """
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    shapes = {(a.num_kv_heads, a.head_dim) for a in attns}
    if len(shapes) != 1:
        raise ValueError(f"attention layers with different KV shapes on one rank: {sorted(shapes)}")
    assert sorted(a.layer_idx for a in attns) == list(range(len(attns))), "layer indices not 0..n-1"
    (kv, d), = shapes
    return len(attns), kv, d
