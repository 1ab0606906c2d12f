"""The broker's shared aliases and keys, defined once and imported where they are used."""

from __future__ import annotations

import operator
from typing import Any, Callable, Generic, Iterable, NamedTuple, TypeVar, overload

# how the broker's objects send: (peer identity, frames) -> whether it left
Send = Callable[[bytes, list[Any]], bool]
# time.monotonic, or a test's fake clock
Clock = Callable[[], float]
# a request, from admission to its one answer: (client identity, request id)
RequestKey = tuple[bytes, str]


class ModelVersion(NamedTuple):
    """One version of one model: the key of what a worker holds, loads and failed to
    load. ``str()`` gives ``name/version``, the form of ``zeroserve status``, the logs
    and the workers' memory reports."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}/{self.version}"


def earliest(dues: Iterable[float | None]) -> float | None:
    """The least of the times that are not None; None when none is. A loop: ``min`` over a
    generator with ``default=`` costs the broker's loop about 2.5 us, several times a turn
    (its keyword alone about 1 us)."""
    best = None
    for d in dues:
        if d is not None and (best is None or d < best):
            best = d
    return best


T = TypeVar("T")


class ReadOnly(Generic[T]):
    """A public, read-only attribute over the private slot of the same name (``draining``
    reads ``_draining``): state that one owner writes and everyone may read. Declared as
    ``draining: ReadOnly[bool] = ReadOnly()``; mypy reads the type from ``__get__``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_" + name
        # at run time a property over a C getter takes its place: the request path reads
        # workers' fields on every dispatch, and that costs about 50 ns a read where a
        # Python __get__ costs 120 (a plain attribute: 23)
        setattr(owner, name, property(operator.attrgetter(self._slot)))

    @overload
    def __get__(self, obj: None, owner: type) -> ReadOnly[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T | ReadOnly[T]:
        return self if obj is None else getattr(obj, self._slot)
