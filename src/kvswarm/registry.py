"""Strategies selectable by name: one small registry for placement, eviction, selection, grouping
and clustering, so that benchmarks, the CLI and the simulator build a strategy from a string
through the same code path production uses."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Strategy classes of one kind by their ``name`` attribute."""

    def __init__(self, kind: str, base: type[T], *classes: type[T]) -> None:
        self.kind, self.base = kind, base  # ``kind`` names the strategy in errors ("placement", ...)
        self._classes: dict[str, type[T]] = {}
        for cls in classes:
            self.register(cls)

    def register(self, cls: type[T]) -> type[T]:
        """Make ``cls`` constructible by its ``name``; returns it, so it works as a decorator."""
        self._classes[cls.name] = cls  # type: ignore[attr-defined]
        return cls

    def make(self, spec: str | T, *args, **kw) -> T:
        """``spec`` itself when it already is a strategy, else a new instance of the class named ``spec``."""
        if isinstance(spec, self.base):
            return spec
        try:
            cls = self._classes[spec]  # type: ignore[index]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {spec!r}; one of {self.names()}") from None
        return cls(*args, **kw)

    def names(self) -> list[str]:
        return sorted(self._classes)
