"""Qwen2.5-VL (HF ``Qwen2_5_VLForConditionalGeneration``): a ViT over dynamic-resolution images
(window attention, 2D rotary, a 2x2 patch merger) whose outputs replace the image placeholder tokens
of a Qwen2 decoder that rotates q/k with M-RoPE (three position rows: temporal, height, width).

Images (``Qwen2VLImageProcessor``): resized so each side is a multiple of ``patch * merge`` within
``min_pixels .. max_pixels``, cut into ``grid_thw = (t, h, w)`` patches of ``temporal_patch *
3 * patch * patch`` floats (a still image is its frame twice, ``t = 1``), flattened in merge-block
order; ``t * h * w / merge**2`` placeholder tokens per image (``multimodal.processing`` keeps the grid
on the ``MultiModalFeature``).

Vision tower (``Qwen2_5_VisionTransformer``): Conv3d patch embedding (a linear map of each patch),
blocks of RMSNorm -> attention (fused qkv with bias, 2D rotary: half the rotated dims by the patch
row, half by the column) -> RMSNorm -> SwiGLU MLP with bias; blocks listed in
``fullatt_block_indexes`` attend over the whole image, the others within windows of
``window_size`` pixels (``window_size / patch / merge`` merged tokens a side; tokens are reordered
window by window for the blocks and back after the merger). Merger: RMSNorm, the ``merge**2``
neighbouring patches concatenated, Linear -> GELU -> Linear to the decoder width.

M-RoPE positions (``multimodal.mrope``): text tokens use ``p + delta`` in all three rows; an image
run starting at prompt position ``o`` uses ``(base + t, base + h, base + w)`` (``base = o + delta``,
indices in the merged grid); the text after it continues at ``base + max(h, w)``; ``delta`` is kept
per request for its decode steps. The rotary dims are split by ``rope_parameters["mrope_section"]``
(e.g. [16, 24, 24] of 64 frequency pairs), each section rotated by its row, as transformers'
``Qwen2_5_VLRotaryEmbedding``.

Checkpoint names: ``model.visual.*`` / ``model.language_model.*`` / ``lm_head.*`` (transformers 5) or
``visual.*`` / ``model.*`` / ``lm_head.*`` (the Hub's Qwen2.5-VL checkpoints).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers import RotaryEmbedding
from pagedllm.models.vlm import LlamaVisionLanguageModel, MMLlamaModel


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope: positions int64 ``[3, T]`` (temporal, height, width rows); frequency pair
    ``j`` takes its angle from row ``s(j)``, ``s`` given by ``mrope_section`` (sections of the
    ``head_dim / 2`` pairs, in order). Plain ``[T]`` positions rotate as an ordinary rope (text only:
    the three rows are equal)."""

    def __init__(self, head_dim: int, inv_freq: torch.Tensor, mrope_section: Sequence[int],
                 scaling: float = 1.0) -> None:
        super().__init__(head_dim, inv_freq, scaling)
        half = self.inv_freq.numel()
        if sum(mrope_section) != half:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {half}")
        sec = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(mrope_section)])
        self.section_rows = torch.cat([sec, sec])  # [R]: the position row of each rotated dim
        self.mrope_section = list(mrope_section)

    def apply_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().apply_(positions, q, k)
        return self.forward(positions, q, k)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 ``[T]`` or ``[3, T]``; q ``[T, Hq, D]``, k ``[T, Hkv, D]`` -> rotated, same dtypes."""
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        self._ensure(positions)
        rows = self.section_rows.to(positions.device)
        dims = torch.arange(rows.numel(), device=positions.device)
        idx = positions[rows]  # [R, T]: each dim's position for each token
        cos = self._cos[idx, dims.unsqueeze(1)].T.to(q.dtype).unsqueeze(1)
        sin = self._sin[idx, dims.unsqueeze(1)].T.to(q.dtype).unsqueeze(1)
        from pagedllm.models.layers import _rotate_half

        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Qwen2_5_VLTextModel(MMLlamaModel):
    """The Qwen2 decoder (``MMLlamaModel``: image rows from ``ForwardContext.mm_embeds``) with an
    ``MRotaryEmbedding`` shared by every layer; ``forward(ids [T], positions [T] or [3, T])``."""

    def __init__(self, config, spec: type) -> None:
        super().__init__(config, spec)
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        section = params.get("mrope_section")
        if section is not None:
            rope = MRotaryEmbedding(self.rotary.head_dim, self.rotary.inv_freq, section, self.rotary.scaling)
            self.rotary = rope
            for layer in self.layers:
                layer.self_attn.rotary[0] = rope


# ----------------------------------------------------------------------------- vision tower
class _VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        k = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: a stride = kernel Conv3d over one patch is a matmul with the flattened kernel
        w = self.proj.weight
        return x.reshape(-1, w[0].numel()).to(w.dtype) @ w.reshape(w.shape[0], -1).T


class _VisionAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cu: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from pagedllm.models.layers import _rotate_half

        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # float32 [N, 1, D]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        out = torch.empty_like(q)
        for a, b in zip(cu[:-1], cu[1:]):  # each window (or the whole image) attends within itself
            out[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class _VisionMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _VisionBlock(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm1 = _VisionRMSNorm(cfg.hidden_size)
        self.norm2 = _VisionRMSNorm(cfg.hidden_size)
        self.attn = _VisionAttention(cfg)
        self.mlp = _VisionMLP(cfg)

    def forward(self, x, cu, cos, sin):
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = _VisionRMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


class Qwen2_5_VisionTransformer(nn.Module):
    """The Qwen2.5-VL vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``
    parameter names). ``forward(patches [P, C*Tp*p*p] float, grid (t, h, w)) -> [P / merge**2,
    out_hidden_size]`` for ONE image (``P = t*h*w``, the processor's patch order)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.merge = int(cfg.spatial_merge_size)
        self.patch_size = int(cfg.patch_size)
        self.window_size = int(cfg.window_size)
        self.full_blocks = set(int(i) for i in cfg.fullatt_block_indexes)
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = _PatchMerger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        half = head_dim // 2  # h and w each rotate a quarter of the head's frequency pairs
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def _rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin float32 ``[t*h*w, head_dim]`` in the processor's merge-block patch order."""
        m = self.merge
        hp = torch.arange(h).unsqueeze(1).expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        wp = torch.arange(w).unsqueeze(0).expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        f = torch.cat([hp[:, None].float() * self.inv_freq, wp[:, None].float() * self.inv_freq], -1).repeat(t, 1)
        emb = torch.cat([f, f], -1)
        return emb.cos(), emb.sin()

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """``(order of the merged tokens window by window [t*h*w/m^2], window bounds in patches)``."""
        m = self.merge
        gh, gw = h // m, w // m
        ws = self.window_size // m // self.patch_size
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = ws - gh % ws, ws - gw % ws  # NOTE: as transformers: a whole extra window when divisible
        nh, nw = (gh + ph) // ws, (gw + pw) // ws
        pad = F.pad(idx, (0, pw, 0, ph), value=-100).reshape(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4)
        pad = pad.reshape(t, nh * nw, ws * ws)
        sizes = (pad != -100).sum(-1).reshape(-1)
        order = pad.reshape(-1)
        order = order[order != -100]
        cu = [0]
        for n in sizes.tolist():
            if n:
                cu.append(cu[-1] + n * m * m)
        return order, cu

    def forward(self, patches: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        t, h, w = (int(g) for g in grid)
        n, unit = t * h * w, self.merge**2
        if patches.shape[0] != n:
            raise ValueError(f"{patches.shape[0]} patches for a {t}x{h}x{w} grid")
        order, cu_win = self._windows(t, h, w)
        cos, sin = self._rotary(t, h, w)
        dev = patches.device

        def permute(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(n // unit, unit, -1)[order.to(x.device)].reshape(n, -1)

        x = permute(self.patch_embed(patches))
        cos, sin = permute(cos).to(dev), permute(sin).to(dev)
        cu_full = [i * h * w for i in range(t + 1)]  # full attention: within each frame
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if i in self.full_blocks else cu_win, cos, sin)
        return self.merger(x)[torch.argsort(order).to(dev)]


class Qwen2_5_VLForConditionalGeneration(LlamaVisionLanguageModel):
    """HF ``Qwen2_5_VLForConditionalGeneration`` (images; videos are not taken).

    ``embed_images(patches [P, C*Tp*p*p], grid_thw (t, h, w)) -> [1, P / merge**2, hidden]``.

    Attributes:
        uses_mrope: the runner passes ``[3, T]`` M-RoPE positions (``multimodal.mrope``).
        spatial_merge_size: patches merged a side into one image token.
    """

    qkv_bias = True
    o_bias_from_config = False
    uses_mrope = True
    vision_prefixes = (("model.visual.", "visual."), ("visual.", "visual."))
    vision_modules = ("visual",)

    def build(self, config) -> nn.Module:
        return Qwen2_5_VLTextModel(config, type(self))

    def build_vision(self, full) -> None:
        self.visual = Qwen2_5_VisionTransformer(full.vision_config).eval()
        self.spatial_merge_size = int(full.vision_config.spatial_merge_size)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, grid_thw: Optional[Sequence[int]] = None) -> torch.Tensor:
        """One image's patches float ``[P, C*Tp*p*p]`` (``Qwen2VLImageProcessor``'s
        ``pixel_values`` rows of that image) and its ``image_grid_thw`` row -> ``[1, P / merge**2,
        hidden]`` (model dtype).

        Raises:
            ValueError: no vision tower, no grid, or a patch count that does not match the grid.
        """
        if not self.supports_images:
            raise ValueError("this model has no vision tower")
        if grid_thw is None:
            raise ValueError("Qwen2.5-VL images need their grid_thw")
        p = next(self.visual.parameters())
        return self.visual(pixel_values.to(p.device, p.dtype), grid_thw).to(self.dtype).unsqueeze(0)

    def embed_feature(self, feature) -> torch.Tensor:
        """``[length, hidden]`` embeddings of one ``MultiModalFeature`` (its patches and grid)."""
        return self.embed_images(feature.data, feature.grid_thw)[0]
