"""Sleep mode on one rank (vLLM's ``enable_sleep_mode``, ``sleep(level)`` / ``wake_up(tags)``).

vLLM offloads GPU memory to CPU RAM; on CPU the point is the process's resident memory, so:

* the KV cache (tag ``"kv_cache"``): its contents are forgotten. Lazily committed caches
  (``pagedllm.worker.kv_memory``) give every page back with madvise(2) ``MADV_DONTNEED`` (the engine
  core does that through ``release_kv_blocks`` after resetting the prefix cache); caches allocated
  up front (CUDA, ``PAGEDLLM_KV_LAZY=0``) are freed (their storage resized to 0 bytes) and
  zero-filled again on wake.
* the weights (tag ``"weights"``), level 1: every tensor the model's modules hold (parameters,
  buffers and plain tensor attributes such as packed GGUF blocks, scales, oneDNN-packed weights,
  cached norm multipliers) is written to an unlinked temporary file (``PAGEDLLM_SLEEP_DIR``, else
  ``TMPDIR`` / ``/tmp``: a disk file, so the copy lives in the page cache, which the kernel may
  evict, not in the process's anonymous memory) and its memory is freed; wake reads it back into
  the same tensor objects (same shapes, strides and bytes), so everything that holds a reference
  to them (the fused decode step, LoRA wrappers) sees the weights again, bit for bit.
* level 2: the weights are dropped with no copy; wake rebuilds the model from the checkpoint
  (``Worker.load_model`` + ``initialize_cache``), as a fresh start-up would.

A storage torch allocated (resizable) is freed in place (``resize_(0)``), so any view of it anywhere
is restored by the wake; one that torch cannot resize (wrapping a numpy array or a file mapping) is
detached from each tensor found (``Tensor.set_`` onto an empty storage) and a fresh storage is
made on wake, so views of it held outside the modules keep the old memory alive (still correct).
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch import nn

from pagedllm import envs


class EngineSleepingError(RuntimeError):
    """A request reached an engine that is asleep (the server answers 503, as vLLM does)."""

    def __init__(self, message: str = "The model is sleeping; wake it up first (POST /wake_up, or "
                                      "LLM.wake_up()).") -> None:
        super().__init__(message)


#: vLLM's sleep tags (``LLM.wake_up(tags=[...])``).
SLEEP_TAGS = ("weights", "kv_cache")


def check_tags(tags: Optional[Iterable[str]]) -> list[str]:
    """``tags`` as a list (None = every tag), each one of ``SLEEP_TAGS``.

    Raises:
        ValueError: an unknown tag (the message names it and the valid ones).
    """
    if tags is None:
        return list(SLEEP_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    out = []
    for t in tags:
        if t not in SLEEP_TAGS:
            raise ValueError(f"tags: unknown sleep tag {t!r}; valid tags are {list(SLEEP_TAGS)}")
        if t not in out:
            out.append(t)
    return out


def check_level(level: Any) -> int:
    """``level`` as 1 or 2.

    Raises:
        ValueError: any other value (the message names ``level``).
    """
    try:
        lv = int(level)
    except (TypeError, ValueError):
        lv = None
    if lv not in (1, 2) or isinstance(level, bool) or (isinstance(level, float) and level != lv):
        raise ValueError(f"level: the sleep level must be 1 or 2, got {level!r}")
    return lv


def _module_tensors(modules: Iterable[nn.Module]) -> list[tuple[torch.Tensor, Any, Optional[str]]]:
    """Every distinct tensor object the modules (and their submodules) hold: parameters, buffers,
    tensor attributes, tensors in list/tuple/dict attributes, and tensor attributes of plain
    objects they hold (quantization methods), in a fixed order, as ``(tensor, owner, name)``:
    ``owner.name`` is the tensor for a direct attribute of a module (``owner`` None otherwise)."""
    out: list[tuple[torch.Tensor, Any, Optional[str]]] = []
    seen: set[int] = set()

    def add(v: Any, owner: Any = None, name: Optional[str] = None) -> None:
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            out.append((v, owner, name))

    def scan(v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            add(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                scan(x, depth)
        elif isinstance(v, dict):
            for x in v.values():
                scan(x, depth)
        elif depth > 0 and hasattr(v, "__dict__") and not isinstance(v, (nn.Module, type)):
            for x in vars(v).values():
                scan(x, depth - 1)

    mods: list = []
    done: set[int] = set()
    for root in modules:
        if root is None:
            continue
        for mod in root.modules():
            if id(mod) not in done:
                done.add(id(mod))
                mods.append(mod)
    # NOTE: direct attributes first, so a tensor also listed in a container elsewhere (the fused
    # decode step's operand lists) is recorded with its owning module.
    for mod in mods:
        for k, v in vars(mod).items():
            if k in ("_parameters", "_buffers"):
                for x in v.values():
                    add(x)
            elif isinstance(v, torch.Tensor):
                add(v, mod, k)
    for mod in mods:
        for k, v in vars(mod).items():
            if k not in ("_parameters", "_buffers", "_modules") and not isinstance(v, torch.Tensor):
                scan(v, 1)
    return out


def _storage_key(t: torch.Tensor) -> Optional[int]:
    """An id of ``t``'s storage (None for tensors without one: mkldnn, meta, empty)."""
    if t.is_mkldnn or t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if st.nbytes() == 0:
        return None
    return st.data_ptr()


@dataclass
class _Storage:
    storage: Any                      # the UntypedStorage (kept: the tensors point at it)
    nbytes: int
    resizable: bool
    tensors: list                     # [(tensor, storage_offset, size, stride)] found on it
    file_offset: int = -1             # where its bytes are in the backup file (level 1)


@dataclass
class WeightSleep:
    """The weights of one rank while asleep (``offload``), restored by ``restore``.

    Attributes:
        level: 1 (a copy in ``backup``) or 2 (no copy: the caller reloads the checkpoint).
        storages: what was freed.
        nbytes: bytes freed (sum over the storages).
        backup: the unlinked temporary file (level 1), else None.
    """

    level: int
    storages: list = field(default_factory=list)
    nbytes: int = 0
    backup: Any = None
    packed: list = field(default_factory=list)  # [(owner, name, dense nbytes, shape, dtype, offset)]


def _host_view(t_or_storage: Any) -> memoryview:
    """A writable memoryview over the bytes of a CPU storage or contiguous tensor, without a copy.

    NOTE: not via numpy: ``Tensor.numpy()`` marks the storage non-resizable for good, and
    ``offload`` frees resizable storages with ``resize_(0)``."""
    import ctypes

    if isinstance(t_or_storage, torch.Tensor):
        ptr, n = t_or_storage.data_ptr(), t_or_storage.numel() * t_or_storage.element_size()
    else:
        ptr, n = t_or_storage.data_ptr(), t_or_storage.nbytes()
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


def _as_bytes(storage: Any, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (no copy)."""
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(storage, 0, (storage.nbytes(),))
    return t


def offload(modules: Iterable[nn.Module], level: int, extra: Iterable[torch.Tensor] = ()) -> WeightSleep:
    """Free the memory of every tensor ``modules`` hold (and of ``extra`` tensors); with
    ``level`` 1 first write the bytes to an unlinked temporary file (``PAGEDLLM_SLEEP_DIR``, else
    the system temp directory).

    Returns:
        the ``WeightSleep`` that ``restore`` takes.

    Raises:
        OSError: the backup file cannot be written (nothing is freed then).
    """
    modules = [m for m in modules if m is not None]
    groups: dict[int, _Storage] = {}
    packed: list = []  # oneDNN-blocked (opaque) weights held as module attributes
    for t, owner, name in list(_module_tensors(modules)) + [(x, None, None) for x in extra]:
        if t.layout == torch._mkldnn and owner is not None:
            packed.append((owner, name, t))
            continue
        key = _storage_key(t)
        if key is None:
            continue
        g = groups.get(key)
        if g is None:
            st = t.untyped_storage()
            g = groups[key] = _Storage(st, st.nbytes(), bool(st.resizable()), [])
        g.tensors.append((t, t.storage_offset(), tuple(t.shape), tuple(t.stride())))
    state = WeightSleep(level=level)
    if level == 1:
        d = envs.get("PAGEDLLM_SLEEP_DIR")
        f = tempfile.TemporaryFile(dir=d, prefix="pagedllm-sleep-")
        try:
            pos = 0
            for i, (owner, name, t) in enumerate(packed):
                dense = t.to_dense().contiguous()
                nb = dense.numel() * dense.element_size()
                f.write(_host_view(dense))
                packed[i] = (owner, name, nb, tuple(dense.shape), dense.dtype, pos)
                pos += nb
            for g in groups.values():
                g.file_offset = pos
                if g.storage.device.type == "cpu":
                    f.write(_host_view(g.storage))
                else:
                    f.write(_host_view(_as_bytes(g.storage, g.storage.device).cpu()))
                pos += g.nbytes
            f.flush()
        except BaseException:
            f.close()
            raise
        state.backup = f
    else:
        packed = [(owner, name, 0, None, None, -1) for owner, name, _ in packed]
    # NOTE: the packed weights are re-packed on wake (new tensor objects): the worker drops the
    # fused decode step's operand lists before sleeping and gathers them again on wake.
    for owner, name, nb, _shape, _dtype, _off in packed:
        setattr(owner, name, None)
        state.nbytes += nb
    state.packed = packed
    with torch.inference_mode():  # NOTE: some tensors are inference tensors (rope tables)
        for g in groups.values():
            if g.resizable:
                g.storage.resize_(0)
            else:
                for t, _, _, _ in g.tensors:
                    t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
                g.storage = None  # NOTE: the last reference here: the memory goes with it
            state.nbytes += g.nbytes
            state.storages.append(g)
    return state


def restore(state: WeightSleep) -> None:
    """Give every tensor ``offload`` freed its memory back, with the bytes of the backup file
    (level 1) or uninitialised (level 2: the caller overwrites them); closes the file.

    Raises:
        OSError: the backup cannot be read.
    """
    f = state.backup
    try:
        with torch.inference_mode():  # NOTE: some tensors are inference tensors (rope tables)
            for g in state.storages:
                dev = g.tensors[0][0].device
                if g.resizable:
                    g.storage.resize_(g.nbytes)
                else:
                    g.storage = torch.empty(g.nbytes, dtype=torch.uint8, device=dev).untyped_storage()
                    for t, off, size, stride in g.tensors:
                        t.set_(g.storage, off, size, stride)
                if f is not None:
                    f.seek(g.file_offset)
                    if dev.type == "cpu":
                        n = f.readinto(_host_view(g.storage))
                    else:
                        host = torch.empty(g.nbytes, dtype=torch.uint8)
                        n = f.readinto(_host_view(host))
                        _as_bytes(g.storage, dev).copy_(host)
                    if n != g.nbytes:
                        raise OSError(f"sleep backup: read {n} of {g.nbytes} bytes")
            if f is not None:
                from pagedllm.kernels.onednn import pack_weight
                for owner, name, nb, shape, dtype, off in state.packed:
                    dense = torch.empty(shape, dtype=dtype)
                    f.seek(off)
                    if f.readinto(_host_view(dense)) != nb:
                        raise OSError(f"sleep backup: short read of the packed weight {name}")
                    setattr(owner, name, pack_weight(dense))
    finally:
        if f is not None:
            f.close()
            state.backup = None


def free_eager_kv(caches: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Free the KV caches allocated up front (not by ``kv_memory.new_kv_cache``'s lazy mapping,
    whose pages the engine gives back with madvise): their storages are resized to 0 bytes.
    Returns the tensors freed, for ``restore_eager_kv``."""
    freed = []
    for t in caches:
        if getattr(t, "_kv_mmap", None) is not None:
            continue
        st = t.untyped_storage()
        if st.resizable() and st.nbytes():
            t._sleep_nbytes = st.nbytes()
            st.resize_(0)
            freed.append(t)
    return freed


def restore_eager_kv(caches: Iterable[torch.Tensor]) -> None:
    """Give the caches ``free_eager_kv`` freed their memory back, zero-filled (a fresh cache)."""
    for t in caches:
        t.untyped_storage().resize_(t._sleep_nbytes)
        with torch.inference_mode():  # NOTE: some tensors are inference tensors (rope tables)
            t.zero_()
