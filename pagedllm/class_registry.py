"""A name -> class registry with vLLM's ``*Manager.register_module`` interface (pure Python).

Used by ``ToolParserManager`` and ``ReasoningParserManager``: each subclass names its base class
and the words its messages use; the table, lookups, listing and registration live here once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Optional, Union


class ClassRegistry:
    """Class methods over a name -> class table; a subclass names what it holds:
    ``class ToolParserManager(ClassRegistry, base=ToolParser, kind="tool call parser")``.

    Class keywords:
        base: the class every registered class must subclass.
        kind: the messages' name of an entry ("tool call parser").
        type_kind: the TypeError message's name of an entry (default: ``kind``).

    Each subclass gets its own table, ``registry``.
    """

    registry: ClassVar[dict[str, type]]
    base: ClassVar[type]
    kind: ClassVar[str]
    type_kind: ClassVar[str]

    def __init_subclass__(cls, *, base: type, kind: str, type_kind: Optional[str] = None, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.registry, cls.base, cls.kind, cls.type_kind = {}, base, kind, type_kind or kind

    @classmethod
    def get(cls, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            KeyError: no such entry (the message lists the registered names).
        """
        if name in cls.registry:
            return cls.registry[name]
        raise KeyError(f"{cls.kind} {name!r} is not registered; available: "
                       f"{', '.join(sorted(cls.registry))}")

    @classmethod
    def list_registered(cls) -> list[str]:
        """The registered names, sorted."""
        return sorted(cls.registry)

    @classmethod
    def _register(cls, module: type, names: Union[str, Sequence[str], None], force: bool) -> None:
        if not (isinstance(module, type) and issubclass(module, cls.base)):
            raise TypeError(f"{cls.type_kind} must subclass {cls.base.__name__}, got {module!r}")
        if names is None:
            names = [module.__name__]
        elif isinstance(names, str):
            names = [names]
        for n in names:
            if not force and n in cls.registry:
                raise KeyError(f"{cls.kind} {n!r} is already registered")
            cls.registry[n] = module

    @classmethod
    def register_module(cls, name: Union[str, Sequence[str], None] = None, force: bool = True,
                        module: Optional[type] = None) -> Union[type, Callable[[type], type]]:
        """Register ``module`` under ``name`` (one or several names; None = the class name), or,
        without ``module``, return a class decorator doing so.

        Raises:
            TypeError: the class does not subclass ``base``.
            KeyError: ``force=False`` and a name is taken.
        """
        if module is not None:
            cls._register(module, name, force)
            return module

        def deco(m: type) -> type:
            cls._register(m, name, force)
            return m
        return deco
