"""``KVConnectorFactory``: connector names -> classes (vLLM's registry; pure Python)."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from pagedllm.distributed.kv_transfer.base import KVCacheLayout, KVConnectorBase_V1, KVConnectorRole


class KVConnectorFactory:
    """Registry of connector classes, imported lazily on first use."""

    _registry: dict[str, Callable[[], type[KVConnectorBase_V1]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``.

        Raises:
            ValueError: ``name`` is already registered.
        """
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")

        def loader() -> type[KVConnectorBase_V1]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: Any) -> type[KVConnectorBase_V1]:
        """The class for ``config.kv_connector`` (importing ``kv_connector_module_path`` first).

        Raises:
            ValueError: an unknown name (the message lists the registered ones).
        """
        if config.kv_connector_module_path:
            try:
                importlib.import_module(config.kv_connector_module_path)
            except ImportError as e:
                raise ValueError(f"kv_transfer_config.kv_connector_module_path: cannot import "
                                 f"{config.kv_connector_module_path!r}: {e}") from None
        loader = cls._registry.get(config.kv_connector)
        if loader is None:
            raise ValueError(f"kv_transfer_config.kv_connector: unknown connector {config.kv_connector!r}; "
                             f"registered: {cls.names()}")
        return loader()

    @classmethod
    def create_connector(cls, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> KVConnectorBase_V1:
        """A connector object for ``role``."""
        return cls.get_connector_class(config)(config, role, layout)


KVConnectorFactory.register_connector(
    "OffloadingConnector", "pagedllm.distributed.kv_transfer.offloading", "OffloadingConnector")
KVConnectorFactory.register_connector(
    "P2pConnector", "pagedllm.distributed.kv_transfer.p2p", "P2pConnector")
