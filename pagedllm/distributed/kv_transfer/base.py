"""The KV connector interface, in vLLM v1's shape (``KVConnectorBase_V1``; pure Python, no torch).

A connector moves KV-cache blocks between the engine's block pool and something outside it (host
memory, a disk directory, another instance). It has two halves, one object per role:

* **scheduler side** (``KVConnectorRole.SCHEDULER``, in the engine-core process, beside the
  ``Scheduler``): decides *what* moves. ``get_num_new_matched_tokens`` says how many tokens past
  the device prefix-cache hit it can supply for a waiting request; after the scheduler allocated
  blocks for them, ``update_state_after_alloc`` gets those blocks; ``request_finished`` sees a
  request's block table before it is freed (so its full blocks can be saved); at the end of each
  ``schedule()``, ``build_connector_meta`` packs the step's loads and saves into a
  ``KVConnectorMetadata`` that rides on the ``SchedulerOutput`` to the workers;
  ``update_connector_output`` receives what the workers report back.
* **worker side** (``KVConnectorRole.WORKER``, next to the KV cache tensors): does the moving.
  ``register_kv_caches`` hands it the caches once; each step it is bound to the step's metadata
  (``bind_connector_metadata``), ``start_load_kv`` runs before the forward, ``wait_for_layer_load``
  / ``save_kv_layer`` are per-layer hooks for backends that stream layer by layer,
  ``wait_for_save`` runs after the forward, and ``get_connector_output`` returns what the scheduler
  side should learn (``ModelRunnerOutput.kv_connector_output``).

The address of a block is its **block hash** (``Request.block_hashes``, ``kv_cache_utils``): a hash
chained over every token before and in the block, with the request's ``cache_salt`` and LoRA
adapter mixed into the first block; with a connector the chain's root is derived from
``KVCacheLayout.fingerprint`` (model identity, KV dtype and layout), so a block hash names the
same KV bytes in any process that serves the same model with the same layout.

The engine core (``pagedllm.core``) calls only the methods below; connector classes are looked up
by name in ``pagedllm.distributed.kv_transfer.factory``. docs/kv_connector.md walks through
writing one.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Optional

#: Version of the stored block layout ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``;
#: part of the fingerprint, so a change here makes older stored blocks foreign.
KV_LAYOUT_VERSION = 1


class KVConnectorRole(enum.Enum):
    """Which half of a connector an object is (vLLM's names)."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side sends the worker side for one step (subclassed per connector).
    Carried by ``SchedulerOutput.kv_connector_metadata``."""


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of one KV block as the worker stores it, and what produced it.

    Attributes:
        num_layers: KV caches (attention layers) on the rank.
        block_size: tokens per block.
        num_kv_heads: KV heads per cache.
        head_dim: D.
        dtype: the cache dtype's name (``str(torch.dtype)`` without ``torch.``), e.g. "bfloat16".
        model_fingerprint: hex digest naming the model's weights/config/compute dtype
            (``pagedllm.distributed.kv_transfer.offloading.model_fingerprint``).
        hash_algo: the block-hash algorithm ("sha256" or "xxhash").
        layout_version: ``KV_LAYOUT_VERSION``.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_fingerprint: str
    hash_algo: str = "sha256"
    layout_version: int = KV_LAYOUT_VERSION

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, block_size, num_kv_heads, head_dim)``: one stored block."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def fingerprint(self) -> str:
        """sha256 hex of every field: blocks stored under another fingerprint are foreign."""
        d = json.dumps(self.__dict__, sort_keys=True).encode()
        return hashlib.sha256(b"pagedllm-kv-layout:" + d).hexdigest()


class KVConnectorBase_V1:
    """Base class of KV connectors (vLLM v1's method names and meanings; see the module docstring).

    Args:
        config: the ``KVTransferConfig``.
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        layout: the KV block layout (both roles get the same one).
    """

    def __init__(self, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        self.config = config
        self.role = role
        self.layout = layout
        self._connector_metadata: Optional[KVConnectorMetadata] = None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Called once after the worker allocated its KV caches: layer name -> tensor
        ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (pagedllm's layout)."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set the step's metadata (before ``start_load_kv``)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop the step's metadata (after ``wait_for_save``)."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> Optional[KVConnectorMetadata]:
        return self._connector_metadata

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start (or do) the step's loads into the KV caches; runs before the forward. A
        connector that loads asynchronously returns at once and finishes in ``wait_for_layer_load``."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads are in its cache (per-layer backends)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving ``layer_name``'s KV after the forward wrote it (per-layer backends)."""

    def wait_for_save(self) -> None:
        """Block until the step's saves no longer need the KV caches (runs after the forward)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """``(done sending, done receiving)`` request ids for asynchronous transfers; (None, None)
        when the connector transfers synchronously."""
        return None, None

    def get_connector_output(self) -> Any:
        """What the scheduler side must learn from this step (``update_connector_output``), or
        None. pagedllm's equivalent of vLLM's ``KVConnectorOutput`` fields."""
        return None

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """Tokens past ``num_computed_tokens`` (the device prefix hit, block aligned) that the
        connector can load for ``request``, and whether the load is asynchronous.

        Must leave at least the request's last token to compute. May be called several times for
        one request (admission retried next step). Returns ``(0, False)`` when it has nothing.
        """
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: list[Any], num_external_tokens: int) -> None:
        """After a successful allocation: ``blocks`` (``KVCacheBlock``s, in token order) are the
        blocks that will hold the ``num_external_tokens`` loaded tokens (empty when 0)."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's metadata for the workers; resets the scheduler side's per-step state."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        """What the workers reported for the step (``get_connector_output`` of the output rank)."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """A request finished (or was aborted); ``block_ids`` is its block table, still intact.

        Returns ``(delay_free, kv_transfer_params)``: pagedllm's connectors return False (blocks
        are freed at once; saves copy them before any later step can overwrite them).
        """
        return False, None

    def has_pending_work(self) -> bool:
        """True while saves are queued that need one more step to reach the workers (the engine
        keeps stepping until they have)."""
        return False

    def get_kv_connector_stats(self) -> Optional[dict]:
        """Totals for /metrics and logs (connector-specific keys), or None."""
        return None

    def shutdown(self) -> None:
        """Release resources (flush writers, close files); idempotent."""
