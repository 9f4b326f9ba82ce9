"""Progress of the loader's long steps (widening a GGUF to float once, quantizing at load), for
whoever listens: the command line draws a bar from it; core itself never prints."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
Listener = Callable[[str, int, int], None]  # (what, done, total)

_listener: Listener | None = None


def report(what: str, done: int, total: int) -> None:
    if _listener is not None:
        _listener(what, done, total)


def track(items: Iterable[T], what: str, total: int) -> Iterator[T]:
    """items, reporting each one done."""
    report(what, 0, total)
    for i, x in enumerate(items):
        yield x
        report(what, i + 1, total)


@contextlib.contextmanager
def listening(fn: Listener) -> Iterator[None]:
    global _listener
    before, _listener = _listener, fn
    try:
        yield
    finally:
        _listener = before
