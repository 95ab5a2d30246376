"""Speculative proposers by name: ``speculative_config.method`` -> how to build and load it.

A new proposer is one file plus a registration::

    from pagedllm.spec_decode.registry import register_proposer

    @register_proposer("my_method")
    def build(cfg, ctx):            # cfg: SpeculativeConfig, ctx: ProposerContext
        return MyProposer(cfg.num_speculative_tokens)   # a spec_decode.proposer.Proposer

after which ``speculative_config={"method": "my_method", "num_speculative_tokens": k}`` is
accepted by the config, the CLI, the engine and the worker (``tests/spec_decode/
test_custom_proposer.py`` shows it). The built-in methods are registered below with lazy
imports, so this module (like ``spec_decode.config``) imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

#: ``ProposerKind.draft`` values.
DRAFT_NONE = "none"    # proposes from token ids only (n-gram, suffix): no weights, no KV cache
DRAFT_MODEL = "model"  # its own checkpoint, run as a model with its own KV cache (draft_model)
DRAFT_HEAD = "head"    # a head over the target's hidden states, loaded beside it (EAGLE, MTP)


@dataclass(frozen=True)
class ProposerContext:
    """What the worker hands a proposer's ``build``: fields a method does not use are ignored.

    Attributes:
        draft_model: the loaded draft (``DRAFT_MODEL``: the draft's model; ``DRAFT_HEAD``: the
            module ``load_head`` returned), or None for ``DRAFT_NONE``.
        target: the target model (``nn.Module``).
        num_blocks / block_size: the KV cache's geometry (a draft model's own cache matches it).
        kv_cache_dtype: torch dtype of the KV cache.
        device: the rank's torch device.
        attn_impl: the attention backend instance the runner uses.
    """

    draft_model: Any = None
    target: Any = None
    num_blocks: int = 0
    block_size: int = 16
    kv_cache_dtype: Any = None
    device: Any = None
    attn_impl: Any = None


@dataclass(frozen=True)
class ProposerKind:
    """One registered ``speculative_config.method``.

    Attributes:
        name: the method name.
        build: ``(SpeculativeConfig, ProposerContext) -> Proposer``.
        draft: ``DRAFT_NONE`` | ``DRAFT_MODEL`` | ``DRAFT_HEAD`` (what the worker loads first).
        requires_model: ``speculative_config.model`` must be given.
        load_head: ``DRAFT_HEAD`` only: ``(model path or None, target nn.Module, torch dtype) ->
            nn.Module``.
        default_num_speculative_tokens: ``SpeculativeConfig -> int`` when the user gives no
            ``num_speculative_tokens`` (None: it is required).
        writes_lookahead_kv: the proposer writes ``k`` KV slots past a decoding request's
            scheduled tokens (a draft model's own drafts), which the scheduler allocates.
        cuda_graphs: decode CUDA graphs may be captured with it (False when it reads
            activations through forward hooks, which a replayed graph does not run).
    """

    name: str
    build: Callable[[Any, ProposerContext], Any]
    draft: str = DRAFT_NONE
    requires_model: bool = False
    load_head: Optional[Callable[[Optional[str], Any, Any], Any]] = None
    default_num_speculative_tokens: Optional[Callable[[Any], int]] = None
    writes_lookahead_kv: bool = False
    cuda_graphs: bool = True


_REGISTRY: dict[str, ProposerKind] = {}


def register_proposer(name: str, **options: Any) -> Callable[[Callable[[Any, ProposerContext], Any]],
                                                               Callable[[Any, ProposerContext], Any]]:
    """Decorator registering ``build`` under ``name``; ``options`` are ``ProposerKind`` fields.

    Raises:
        ValueError: ``name`` is taken, or ``draft`` is not one of the ``DRAFT_*`` values.
    """
    def deco(build: Callable[[Any, ProposerContext], Any]) -> Callable[[Any, ProposerContext], Any]:
        if name in _REGISTRY:
            raise ValueError(f"speculative proposer {name!r} is already registered")
        kind = ProposerKind(name=name, build=build, **options)
        if kind.draft not in (DRAFT_NONE, DRAFT_MODEL, DRAFT_HEAD):
            raise ValueError(f"register_proposer({name!r}): draft must be 'none', 'model' or 'head'")
        if kind.draft == DRAFT_HEAD and kind.load_head is None:
            raise ValueError(f"register_proposer({name!r}): a 'head' proposer needs load_head")
        _REGISTRY[name] = kind
        return build
    return deco


def registered_proposers() -> tuple[str, ...]:
    """The registered method names, in registration order."""
    return tuple(_REGISTRY)


def get_proposer_kind(name: str) -> ProposerKind:
    """The registration of ``name``.

    Raises:
        ValueError: an unknown method (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"speculative_config.method: must be one of {', '.join(_REGISTRY)}, "
                         f"got {name!r}") from None


# ------------------------------------------------------------------------------------------
# Built-in methods (vLLM's names). Imports are inside the functions: torch loads only when a
# proposer is built.
# ------------------------------------------------------------------------------------------
@register_proposer("ngram")
def _build_ngram(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.ngram import NgramProposer
    from pagedllm.spec_decode.proposer import TokenProposer
    return TokenProposer(NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                       cfg.prompt_lookup_max), uses_prompt_len=False)


@register_proposer("suffix", default_num_speculative_tokens=lambda cfg: cfg.suffix_decoding_max_tree_depth)
def _build_suffix(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.proposer import TokenProposer
    from pagedllm.spec_decode.suffix import SuffixProposer
    return TokenProposer(SuffixProposer(
        cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth,
        cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor,
        cfg.suffix_decoding_min_token_prob), uses_prompt_len=True)


@register_proposer("draft_model", draft=DRAFT_MODEL, requires_model=True, writes_lookahead_kv=True)
def _build_draft_model(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(cfg.num_speculative_tokens, model=ctx.draft_model, num_blocks=ctx.num_blocks,
                              block_size=ctx.block_size, kv_cache_dtype=ctx.kv_cache_dtype,
                              device=ctx.device, attn_impl=ctx.attn_impl)


def _load_eagle(path: Optional[str], target: Any, dtype: Any) -> Any:
    from pagedllm.spec_decode.eagle_proposer import load_eagle_head
    return load_eagle_head(path, target, dtype)


def _load_eagle3(path: Optional[str], target: Any, dtype: Any) -> Any:
    from pagedllm.spec_decode.eagle_proposer import load_eagle3_head
    return load_eagle3_head(path, target, dtype)


def _load_mtp(path: Optional[str], target: Any, dtype: Any) -> Any:
    from pagedllm.spec_decode.mtp_proposer import load_mtp_head
    return load_mtp_head(path, target, dtype)


def _eagle_kwargs(ctx: ProposerContext) -> dict[str, Any]:
    return dict(num_blocks=ctx.num_blocks, block_size=ctx.block_size, kv_cache_dtype=ctx.kv_cache_dtype,
                device=ctx.device, attn_impl=ctx.attn_impl)


@register_proposer("eagle", draft=DRAFT_HEAD, requires_model=True, load_head=_load_eagle,
                   writes_lookahead_kv=True)
def _build_eagle(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.eagle_proposer import EagleProposer
    return EagleProposer(cfg.num_speculative_tokens, ctx.draft_model, ctx.target, **_eagle_kwargs(ctx))


@register_proposer("eagle3", draft=DRAFT_HEAD, requires_model=True, load_head=_load_eagle3,
                   writes_lookahead_kv=True, cuda_graphs=False)
def _build_eagle3(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.eagle_proposer import Eagle3Proposer
    return Eagle3Proposer(cfg.num_speculative_tokens, ctx.draft_model, ctx.target, **_eagle_kwargs(ctx))


# MTP: the head may live in the target checkpoint, so ``model`` is optional.
@register_proposer("mtp", draft=DRAFT_HEAD, load_head=_load_mtp, default_num_speculative_tokens=lambda cfg: 1)
def _build_mtp(cfg: Any, ctx: ProposerContext) -> Any:
    from pagedllm.spec_decode.mtp_proposer import MTPProposer
    return MTPProposer(cfg.num_speculative_tokens, ctx.draft_model, ctx.block_size, ctx.device)
