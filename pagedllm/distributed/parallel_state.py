"""Process groups of one engine replica: tensor-parallel (TP) and pipeline-parallel (PP).

Rank layout (vLLM's): ``rank = pp_rank * tp_size + tp_rank``; a TP group is ``tp_size``
consecutive ranks (one pipeline stage), a PP group is the ranks with the same ``tp_rank``.
Backends: gloo on CPU, NCCL on CUDA (``torch.distributed``).

Module-level state is set once per process by ``init_distributed`` (each rank is its own
process) and read by the communication modules that ``pagedllm.distributed.sharding`` installs.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist
from pagedllm import envs


def _timeout() -> datetime.timedelta:
    """Collective timeout: ``PAGEDLLM_DIST_TIMEOUT_S`` seconds (default 600)."""
    return datetime.timedelta(seconds=float(envs.get("PAGEDLLM_DIST_TIMEOUT_S")))


class GroupCoordinator:
    """One process group and this rank's place in it.

    Attributes:
        ranks: global ranks of the group, in group order.
        rank_in_group: this rank's index in ``ranks``; world_size: ``len(ranks)``.
        group: the ``torch.distributed`` group (None for a group of one).
    """

    def __init__(self, ranks: list[int], rank: int, group) -> None:
        self.ranks = ranks
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.group = group

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group (in place when ``x`` is contiguous); returns the sum.

        bf16/fp16 tensors are summed in float32 where the backend has no such reduction (gloo)
        and rounded back once.
        """
        if self.world_size == 1:
            return x
        if not x.is_contiguous():
            x = x.contiguous()
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            y = x.float()
            dist.all_reduce(y, group=self.group)
            x.copy_(y)
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> Optional[torch.Tensor]:
        """Concatenate every rank's ``x`` (same shape) along ``dim`` on the group's first rank;
        None on the others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if self.is_first:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.gather(x, gather_list=parts, dst=self.ranks[0], group=self.group)
            return torch.cat(parts, dim=dim)
        dist.gather(x, gather_list=None, dst=self.ranks[0], group=self.group)
        return None

    def send_next(self, x: torch.Tensor):
        """Send ``x`` to the next rank of the group (asynchronously); returns the work handle
        (wait on it before ``x`` is freed or reused)."""
        return dist.isend(x.contiguous(), dst=self.ranks[self.rank_in_group + 1], group=self.group)

    def recv_prev(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive a tensor of ``shape``/``dtype`` from the previous rank of the group."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.ranks[self.rank_in_group - 1], group=self.group)
        return x


_TP: Optional[GroupCoordinator] = None
_PP: Optional[GroupCoordinator] = None


def init_distributed(world_size: int, rank: int, init_method: str, tp_size: int, pp_size: int,
                     device: torch.device) -> None:
    """Join the replica's default group and build its TP and PP groups (every rank calls
    this, with the same sizes).

    Raises:
        ValueError: ``tp_size * pp_size != world_size`` or no ``init_method``.
    """
    global _TP, _PP
    if tp_size * pp_size != world_size:
        raise ValueError(f"tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size} != {world_size} ranks")
    if not init_method:
        raise ValueError("init_distributed: an init_method (tcp://host:port or tcpstore://host:port) is required")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if init_method.startswith("tcpstore://"):
            # A store already listening (hosted by the launching process): every rank is a client.
            host, port = init_method[len("tcpstore://"):].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=_timeout())
            dist.init_process_group(backend, store=store, world_size=world_size, rank=rank,
                                    timeout=_timeout())
        else:
            dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                                    timeout=_timeout())
    tp_groups = [list(range(p * tp_size, (p + 1) * tp_size)) for p in range(pp_size)]
    pp_groups = [list(range(t, world_size, tp_size)) for t in range(tp_size)]
    # NOTE: every rank must create every group, in the same order (torch.distributed.new_group).
    for ranks in tp_groups:
        g = dist.new_group(ranks, timeout=_timeout()) if len(ranks) > 1 else None
        if rank in ranks:
            _TP = GroupCoordinator(ranks, rank, g)
    for ranks in pp_groups:
        g = dist.new_group(ranks, timeout=_timeout()) if len(ranks) > 1 else None
        if rank in ranks:
            _PP = GroupCoordinator(ranks, rank, g)


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group (a group of one before ``init_distributed``)."""
    return _TP if _TP is not None else GroupCoordinator([0], 0, None)


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group (a group of one before ``init_distributed``)."""
    return _PP if _PP is not None else GroupCoordinator([0], 0, None)


def destroy_distributed() -> None:
    """Leave the process groups (idempotent)."""
    global _TP, _PP
    _TP = _PP = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone
            pass
