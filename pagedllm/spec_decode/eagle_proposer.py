"""EAGLE proposer: drafts with an :class:`~pagedllm.spec_decode.eagle.EagleHead` fed by the
target's hidden states.

Indexing (vLLM's): the head's input at position ``p`` is the token at ``p + 1`` and the target's
hidden state at ``p`` (the one that predicted that token); its output there stands in for the
target's hidden state at ``p + 1``. Its KV cache (one layer) shares the target's block tables,
with ``k`` lookahead slots for its own drafts.

Every step the head runs over every request's newly verified positions (the step's committed
tokens: prefill chunks too, so its cache has no holes); for requests that draft, the output at
the last verified position gives draft 1 through the target's LM head, then ``k - 1`` one-token
steps feed back the head's own output.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.spec_decode.draft_model import paged_metadata
from pagedllm.attention.backend import ForwardContext, set_forward_context
from pagedllm.spec_decode.proposer import PagedModelProposer, Proposal, ProposeBatch


def load_eagle_head(path: str, target: Any, dtype: torch.dtype) -> Any:
    """An EagleHead from an EAGLE checkpoint directory (``config.json`` and ``*.safetensors`` or
    ``pytorch_model.bin``), sharing ``target``'s embedding.

    Raises:
        ValueError: a missing directory/config/weights, or tensors that do not fit the head.
    """
    import glob
    import os

    from transformers import LlamaConfig

    from pagedllm.spec_decode.eagle import EagleHead

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config.model: {path!r} has no config.json (an EAGLE head directory)")
    cfg = LlamaConfig.from_pretrained(path)
    cfg.num_hidden_layers = 1
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors.torch import load_file
        weights: dict = {}
        for f in files:
            weights.update(load_file(f))
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        weights = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"speculative_config.model: {path!r} has no *.safetensors or pytorch_model.bin")
    head = EagleHead(cfg, target.model.embed_tokens, dtype)
    try:
        head.load_weights(weights.items())
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {path!r}: {e}") from None
    return head.eval()


class EagleProposer(PagedModelProposer):
    """See the module docstring.

    Args:
        num_speculative_tokens: ``k``.
        head: the EagleHead; target: the target model (its ``compute_logits``).
        num_blocks / block_size / kv_cache_dtype / device / attn_impl: as the target's cache.
    """

    needs_hidden = True

    def __init__(self, num_speculative_tokens: int, head: Any, target: Any, num_blocks: int, block_size: int,
                 kv_cache_dtype: torch.dtype, device: torch.device, attn_impl: Any) -> None:
        _, num_kv_heads, head_dim = head.get_kv_cache_spec()
        # NOTE: the head is one layer, whatever its spec's layer count.
        super().__init__(num_speculative_tokens, (1, num_kv_heads, head_dim), num_blocks, block_size,
                         kv_cache_dtype, device, attn_impl)
        self.head, self.target = head, target

    def _run(self, ids, starts, lens, block_ids, hidden):
        """The head over the given tokens: ``(rows for the LM head, rows to feed back)``."""
        meta, pos = paged_metadata(starts, lens, block_ids, self.block_size)
        with set_forward_context(ForwardContext(meta, self.kv_caches, self.attn_impl)):
            h = self.head(torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device), hidden)
        return h, h

    def _inputs(self, batch: ProposeBatch) -> torch.Tensor:
        """``[T, *]`` the head's hidden input rows, in the forward's token order."""
        return batch.hidden

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(x).argmax(-1)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> Proposal:
        out = Proposal()
        if batch.hidden is None:
            return out
        inputs = self._inputs(batch)
        items = []  # (req, token ids at p + 1, hidden rows, start, drafts?)
        for i, r in enumerate(batch.reqs):
            if r.sampling_params is None:
                continue
            new = batch.sampled.get(r.req_id)
            n_real = r.num_tokens - len(r.spec_token_ids)
            n_valid = n_real + (len(new) - 1 if new and r.spec_token_ids else 0)
            if new:
                nxt = list(r.token_ids[r.start_pos + 1:]) + list(new)  # tokens at p + 1
            else:
                nxt = list(r.token_ids[r.start_pos + 1:r.start_pos + 1 + n_valid])
            n_valid = min(n_valid, len(nxt))
            if n_valid <= 0:
                continue
            rows = np.arange(batch.qsl[i], batch.qsl[i] + n_valid)
            items.append((r, nxt[:n_valid], rows, r.start_pos, bool(new) and r.req_id in batch.want))
        if not items:
            return out
        items.sort(key=lambda it: len(it[1]) != 1)
        ids = np.fromiter((t for it in items for t in it[1]), dtype=np.int64)
        lens = [len(it[1]) for it in items]
        rows = torch.from_numpy(np.concatenate([it[2] for it in items]))
        lhid, hid = self._run(ids, [it[3] for it in items], lens, [it[0].block_ids for it in items],
                              inputs[rows.to(inputs.device)])
        last = np.cumsum(lens) - 1
        sel = [j for j, it in enumerate(items) if it[4]]
        if not sel:
            return out
        reqs = [items[j][0] for j in sel]
        h = hid[torch.from_numpy(last[sel])]
        tok = self._greedy(lhid[torch.from_numpy(last[sel])])
        pos = [items[j][3] + lens[j] for j in sel]  # position of the next head input
        caps = [min(self.k, batch.max_drafts.get(r.req_id, self.k)) for r in reqs]
        drafts = [[int(t)] for t in tok.tolist()]
        bs = self.block_size
        for step in range(1, max(caps)):
            live = [i for i, c in enumerate(caps) if c > step and pos[i] + step - 1 < len(reqs[i].block_ids) * bs]
            if not live:
                break
            sub = torch.tensor(live)
            lh, h = self._run(np.array([drafts[i][-1] for i in live], dtype=np.int64),
                              [pos[i] + step - 1 for i in live], [1] * len(live),
                              [reqs[i].block_ids for i in live], h[sub])
            caps_live = self._greedy(lh).tolist()
            for i, t in zip(live, caps_live):
                drafts[i].append(int(t))
            # keep h aligned with the full request list for the next step
            full = torch.zeros(len(reqs), h.shape[-1], dtype=h.dtype, device=h.device)
            full[sub] = h
            h = full
        for r, d, c in zip(reqs, drafts, caps):
            out.token_ids[r.req_id] = d[:c]
        return out


def load_eagle3_head(path: str, target: Any, dtype: torch.dtype) -> Any:
    """An Eagle3Head from an EAGLE-3 checkpoint directory (``config.json`` and weights),
    sharing ``target``'s embedding; ``head.aux_layer_ids`` are the target layers whose entering
    residual streams it reads (``eagle_aux_hidden_state_layer_ids`` in the config, top level or
    under ``eagle_config``; default :func:`~pagedllm.spec_decode.eagle.eagle3_aux_layer_ids`).

    Raises:
        ValueError: naming the field: missing files, a ``hidden_size`` / ``target_hidden_size``
            / ``vocab_size`` that does not fit the target, aux layer ids outside the target, or
            tensors that do not fit the head.
    """
    from transformers import LlamaConfig

    from pagedllm.spec_decode.eagle import Eagle3Head, eagle3_aux_layer_ids
    from pagedllm.spec_decode.mtp_proposer import read_head_config, read_head_weights

    raw = read_head_config(path)
    cfg = LlamaConfig.from_pretrained(path)
    cfg.num_hidden_layers = 1
    tc = target.config
    H, n = int(tc.hidden_size), int(tc.num_hidden_layers)
    for field, got, want in (("hidden_size", cfg.hidden_size, H),
                             ("target_hidden_size", getattr(cfg, "target_hidden_size", None) or cfg.hidden_size, H),
                             ("vocab_size", cfg.vocab_size, int(tc.vocab_size))):
        if int(got) != int(want):
            raise ValueError(f"speculative_config.model: the EAGLE-3 head's {field} is {got}, the target's "
                             f"{'vocab_size' if field == 'vocab_size' else 'hidden_size'} is {want}")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else eagle3_aux_layer_ids(n)
    if len(ids) != 3 or not all(0 <= i < n for i in ids):
        raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)}: need three "
                         f"target layer indices in [0, {n}) (the target has {n} layers)")
    weights = read_head_weights(path)
    head = Eagle3Head(cfg, target.model.embed_tokens, dtype)
    try:
        head.load_weights(weights.items())
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {path!r}: {e}") from None
    head.aux_layer_ids = ids
    return head.eval()


class AuxHiddenCapture:
    """Records the residual stream entering some target decoder layers during the forward
    (EAGLE-3's low / middle / high features: ``x + residual`` of vLLM's layer loop) with
    forward pre-hooks (the CPU fused decode step, which bypasses the layer modules, is not built
    for a target with hooks: ``worker.fused_decode.build_decode_accelerator``).

    Raises:
        ValueError: a target without ``model.layers``.
    """

    def __init__(self, target: Any, layer_ids: tuple[int, ...]) -> None:
        inner = getattr(target, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None:
            raise ValueError("speculative_config.method: 'eagle3' needs a target with decoder layers "
                             "(model.layers) to read hidden states from")
        self.layer_ids = tuple(layer_ids)
        self.captured: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i)) for i in sorted(set(layer_ids))]

    def _hook(self, i: int):
        def hook(module, args):
            x, residual = args[1], args[2] if len(args) > 2 else None
            self.captured[i] = x if residual is None else x + residual
        return hook

    def take(self) -> torch.Tensor:
        """``[T, 3 H]`` the last forward's captures, concatenated in ``layer_ids`` order."""
        out = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured = {}
        return out


class Eagle3Proposer(EagleProposer):
    """EAGLE-3: like :class:`EagleProposer`, but the head reads three target layers' residual
    streams (``AuxHiddenCapture``), drafts through its own LM head (draft vocabulary mapped by
    ``d2t``) and feeds back its pre-norm output."""

    def __init__(self, num_speculative_tokens: int, head: Any, target: Any, **kw: Any) -> None:
        super().__init__(num_speculative_tokens, head, target, **kw)
        self.capture = AuxHiddenCapture(target, head.aux_layer_ids)

    def _run(self, ids, starts, lens, block_ids, hidden):
        meta, pos = paged_metadata(starts, lens, block_ids, self.block_size)
        with set_forward_context(ForwardContext(meta, self.kv_caches, self.attn_impl)):
            return self.head(torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device), hidden)

    def _inputs(self, batch: ProposeBatch) -> torch.Tensor:
        return self.capture.take()

    def _greedy(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.compute_logits(x).argmax(-1)
