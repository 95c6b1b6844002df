"""A typed registry of named extension points (step-time backends, KV allocators, trace
readers): duplicate names raise; an unknown name is a `ConfigError` naming the flag and
the allowed values; built-in modules register themselves when first asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from twin.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, flag: str, modules: tuple[str, ...] = ()) -> None:
        self.kind, self.flag = kind, flag
        self._modules = modules
        self._items: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = item
            return item

        return deco

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def get(self, name: str) -> T:
        self._load()
        if name not in self._items:
            raise ConfigError(f"{self.flag} {name!r}: allowed values: {', '.join(self.names())}")
        return self._items[name]

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._items

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._modules:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise
