"""PEFT LoRA adapters on disk -> validated, slot-ready weights for the model's linear layers.

Format (Hugging Face ``peft``, ``PeftModel.save_pretrained``): a directory with
``adapter_config.json`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``, ``alpha_pattern``, ``target_modules``, ...) and ``adapter_model.safetensors``
(or the older ``adapter_model.bin``) holding, per adapted module ``M`` of the base model,
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``base_model.model.M.lora_B.weight``
``[out, r]``. PEFT computes ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA (peft ``tuners/lora/layer.py``, ``update_layer``);
``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for the modules whose name
ends with a pattern (peft ``utils.other.get_pattern_key``).

Our models fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(``CausalLM.packed_modules_mapping``). An adapter's weights for one of our linears are kept as
one shrink matrix ``a [k, in]`` (the targeted slices' ``A`` stacked, each padded to the module's
largest rank ``r``; ``k = slices * r``) and one expand matrix ``bt [k, out]``: ``scaling * B^T``
of each slice in its own rows and output columns, zeros elsewhere (block-diagonal), so a fused
projection's delta is two matmuls: ``(x @ a.T) @ bt``.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from pagedllm.lora.request import LoRARequest

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")

# adapter_config.json settings an adapter must not use: (key, what it means). A truthy value is
# refused with this explanation.
_UNSUPPORTED_SETTINGS = (
    ("use_dora", "DoRA (weight-decomposed LoRA)"),
    ("lora_bias", "LoRA biases"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style transposed weights)"),
    ("modules_to_save", "modules_to_save (fully fine-tuned extra modules; serve a merged checkpoint instead)"),
    ("layer_replication", "layer_replication"),
    ("trainable_token_indices", "trainable_token_indices (trained embedding rows)"),
    ("alora_invocation_tokens", "aLoRA (activated LoRA)"),
    ("target_parameters", "target_parameters (LoRA on raw parameters)"),
    ("use_qalora", "QA-LoRA"),
    ("use_bdlora", "BD-LoRA"),
)

_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded: missing files, an unsupported setting, a module the
    model has no LoRA slot for, wrong shapes, or a rank over ``max_lora_rank``. The message
    names the adapter."""


@dataclass
class LoRATarget:
    """One linear layer of the built model that adapters may adapt.

    Attributes:
        name: its module path in our model (``model.layers.3.self_attn.qkv_proj``).
        in_features, out_features: the layer's input and output sizes.
        slices: ``{shard id: (row offset, rows)}`` of the checkpoint modules fused into it
            (``{"q": ..., "k": ..., "v": ...}``, ``{0: gate, 1: up}``), or ``{None: (0,
            out_features)}`` for a plain layer.
    """

    name: str
    in_features: int
    out_features: int
    slices: dict


@dataclass
class LoRAModuleWeights:
    """An adapter's weights for one ``LoRATarget``.

    Attributes:
        a: ``[k, in]`` shrink matrix (model dtype, CPU); ``k = targeted slices x rank``.
        bt: ``[k, out]`` expand matrix, ``scaling * B^T`` block-diagonal over the slices.
        rank: the (largest) rank of the module's slices.
    """

    a: torch.Tensor
    bt: torch.Tensor
    rank: int


@dataclass
class LoRAAdapter:
    """A loaded adapter: ``weights`` maps target names (``LoRATarget.name``) to their weights.

    Attributes:
        request: the ``LoRARequest`` it was loaded for.
        rank: the largest rank over its modules.
        weights: ``{target name: LoRAModuleWeights}``.
        nbytes: bytes of its tensors.
    """

    request: LoRARequest
    rank: int
    weights: dict[str, LoRAModuleWeights] = field(default_factory=dict)
    nbytes: int = 0

    @property
    def int_id(self) -> int:
        return self.request.lora_int_id


def pattern_key(patterns: Any, module: str) -> Optional[str]:
    """The first key of ``patterns`` whose regex matches the end of ``module`` at a dot boundary
    (peft's ``get_pattern_key``: ``re.match(rf"(.*\\.)?({key})$", module)``), or None."""
    for key in patterns or ():
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_adapter_config(path: str, name: str) -> dict:
    """``adapter_config.json`` of the adapter at ``path`` (checked for settings we cannot serve).

    Raises:
        LoRAAdapterError: no such directory or file, invalid JSON, not a LoRA adapter, or an
            unsupported setting.
    """
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not path or not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"LoRA adapter '{name}': No adapter found at {path!r} (expected a PEFT directory "
                               f"with {CONFIG_NAME})")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter '{name}': cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter '{name}': {CONFIG_NAME} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter '{name}': peft_type {kind!r} is not supported (only LORA)")
    for key, what in _UNSUPPORTED_SETTINGS:
        if cfg.get(key):
            raise LoRAAdapterError(f"LoRA adapter '{name}': {key}={cfg[key]!r} is not supported: {what}")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise LoRAAdapterError(f"LoRA adapter '{name}': bias={bias!r} is not supported (only 'none')")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key, 8)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise LoRAAdapterError(f"LoRA adapter '{name}': {key} must be a positive number, got {v!r}")
    return cfg


def read_adapter_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors`` (else ``adapter_model.bin``) on the CPU.

    Raises:
        LoRAAdapterError: neither file exists or it cannot be read.
    """
    for fname in WEIGHT_NAMES:
        p = os.path.join(path, fname)
        if not os.path.isfile(p):
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(p, device="cpu")
            return torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt or truncated file: the loader's own exception type
            raise LoRAAdapterError(f"LoRA adapter '{name}': cannot read {p}: {e}") from None
    raise LoRAAdapterError(f"LoRA adapter '{name}': No adapter found at {path!r} (no {' or '.join(WEIGHT_NAMES)})")


def load_peft_adapter(request: LoRARequest, targets: dict[str, LoRATarget],
                      packed_modules_mapping: dict[str, tuple[str, Any]], max_rank: int,
                      dtype: torch.dtype, canonical_name: Optional[Callable[[str], Optional[str]]] = None
                      ) -> LoRAAdapter:
    """Load and validate the PEFT adapter at ``request.lora_path`` for a model whose adaptable
    linears are ``targets``.

    Args:
        request: the adapter's LoRARequest.
        targets: ``{our module name: LoRATarget}`` (``pagedllm.lora.layer.find_lora_targets``).
        packed_modules_mapping: checkpoint module name -> (fused module name, shard id)
            (``CausalLM.packed_modules_mapping``).
        max_rank: largest rank accepted (``max_lora_rank``).
        dtype: dtype of the returned weights (the model's).
        canonical_name: the model's checkpoint-name normaliser for parameter names
            (``CausalLM._canonical_name``; adds the ``model.`` prefix where missing).

    Returns:
        LoRAAdapter with weights for every module the adapter adapts.

    Raises:
        LoRAAdapterError: see ``read_adapter_config`` / ``read_adapter_tensors``; a tensor that
            is not a LoRA A/B matrix, a module the model cannot adapt ("unknown target module"),
            an A without its B, wrong shapes, or a rank over ``max_rank``.
    """
    name, path = request.lora_name, request.lora_path
    cfg = read_adapter_config(path, name)
    tensors = read_adapter_tensors(path, name)
    if not tensors:
        raise LoRAAdapterError(f"LoRA adapter '{name}': {path} holds no tensors")
    supported = _supported_module_names(targets, packed_modules_mapping)
    # (our target name) -> {shard id: {"A": tensor, "B": tensor, "key": peft module name}}
    found: dict[str, dict[Any, dict[str, Any]]] = {}
    matched = [(key, t, _KEY_RE.match(key)) for key, t in tensors.items()]
    # NOTE: LoRA matrices first, so an adapter of an unsupported module is named as such rather
    # than by the full weights peft saves beside it (e.g. a tied embedding's).
    matched.sort(key=lambda e: (e[2] is None, "lora_" not in e[0]))
    for key, t, m in matched:
        if m is None:
            what = ("DoRA magnitudes" if "lora_magnitude_vector" in key else
                    "an embedding LoRA" if "lora_embedding" in key else
                    "a full weight (modules_to_save or saved embedding layers)" if key.endswith(".weight")
                    else "not a LoRA A/B matrix")
            raise LoRAAdapterError(f"LoRA adapter '{name}': unsupported tensor {key!r} ({what})")
        module, ab = m.group("module"), m.group("ab")
        ours, sid = _our_module(module, packed_modules_mapping, canonical_name)
        target = targets.get(ours)
        if target is None or sid not in target.slices:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': unknown target module {module!r}; this model takes LoRA on "
                f"{', '.join(sorted(supported))} of its decoder layers")
        found.setdefault(ours, {}).setdefault(sid, {"key": module})[ab] = t
    adapter = LoRAAdapter(request=request, rank=0)
    r_default, alpha_default = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    use_rslora = bool(cfg.get("use_rslora", False))
    for ours, by_slice in found.items():
        target = targets[ours]
        parts = []  # (row offset, rows, A [r, in], B [rows, r], scaling)
        for sid, ent in by_slice.items():
            module = ent["key"]
            if "A" not in ent or "B" not in ent:
                raise LoRAAdapterError(f"LoRA adapter '{name}': module {module!r} has lora_{'A' if 'A' not in ent else 'B'}"
                                       f" missing (both lora_A and lora_B are needed)")
            a, b = ent["A"], ent["B"]
            off, rows = target.slices[sid]
            r = a.shape[0] if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (rows, r):
                raise LoRAAdapterError(
                    f"LoRA adapter '{name}': module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; this model needs lora_A [r, {target.in_features}] and lora_B [{rows}, r]")
            if r > max_rank:
                raise LoRAAdapterError(f"LoRA adapter '{name}': module {module!r} has rank {r}, over max_lora_rank "
                                       f"{max_rank} (raise --max-lora-rank)")
            rk = pattern_key(rank_pattern, module)
            r_cfg = rank_pattern[rk] if rk is not None else r_default
            if r_cfg != r:
                raise LoRAAdapterError(f"LoRA adapter '{name}': module {module!r} has rank {r} but "
                                       f"{CONFIG_NAME} says {r_cfg}")
            ak = pattern_key(alpha_pattern, module)
            alpha = alpha_pattern[ak] if ak is not None else alpha_default
            scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
            parts.append((off, rows, a, b, scaling))
        parts.sort(key=lambda p: p[0])
        rank = max(p[2].shape[0] for p in parts)
        k = rank * len(parts)
        a_all = torch.zeros(k, target.in_features, dtype=torch.float32)
        bt_all = torch.zeros(k, target.out_features, dtype=torch.float32)
        for i, (off, rows, a, b, scaling) in enumerate(parts):
            r = a.shape[0]
            a_all[i * rank:i * rank + r] = a.float()
            bt_all[i * rank:i * rank + r, off:off + rows] = b.float().t() * scaling
        w = LoRAModuleWeights(a_all.to(dtype).contiguous(), bt_all.to(dtype).contiguous(), rank)
        adapter.weights[ours] = w
        adapter.rank = max(adapter.rank, rank)
        adapter.nbytes += w.a.numel() * w.a.element_size() + w.bt.numel() * w.bt.element_size()
    return adapter


def _our_module(module: str, mapping: dict[str, tuple[str, Any]],
                canonical_name: Optional[Callable[[str], Optional[str]]]) -> tuple[Optional[str], Any]:
    """A checkpoint module name -> (our module name, shard id or None)."""
    if canonical_name is not None:
        c = canonical_name(module + ".weight")
        if c is None:
            return None, None
        module = c[:-len(".weight")]
    head, _, last = module.rpartition(".")
    if last in mapping:
        fused, sid = mapping[last]
        return (f"{head}.{fused}" if head else fused), sid
    return module, None


def _supported_module_names(targets: dict[str, LoRATarget], mapping: dict[str, tuple[str, Any]]) -> set[str]:
    """Checkpoint module names (``q_proj``, ..., ``down_proj``) the targets take."""
    inverse: dict[tuple[str, Any], str] = {(fused, sid): ckpt for ckpt, (fused, sid) in mapping.items()}
    out: set[str] = set()
    for t in targets.values():
        last = t.name.rpartition(".")[2]
        for sid in t.slices:
            out.add(last if sid is None else inverse.get((last, sid), last))
    return out
