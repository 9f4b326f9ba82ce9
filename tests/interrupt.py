"""Ending a resumable job (quantize, distill) part way from outside it, for the resume tests: one of
the job's step functions is wrapped so that after its n-th call the run dies as a crash would (an
exception) or as Ctrl-C would (a real SIGINT to the process). The jobs carry no test hook of their
own, so what follows is their real interrupt and resume path."""
from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from pathlib import Path


class Stopped(RuntimeError):
    """The crash that stop_after simulates."""


def stop_after(fn, n: int, how: str = "crash"):
    """fn, ending the run once its n-th call has returned: "crash" raises Stopped, "sigint" sends
    this process SIGINT (Python's handler then raises KeyboardInterrupt, as for a user's Ctrl-C)."""
    calls = 0

    def step(*args, **kwargs):
        nonlocal calls
        out = fn(*args, **kwargs)
        calls += 1
        if calls == n:
            if how == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler raises KeyboardInterrupt here
            raise Stopped(f"stopped after {n} calls of {fn.__name__}")
        return out

    return step


def patch(target: str, n: int, how: str = "crash") -> None:
    """Replace `target` ("package.module:name" or "package.module:Class.method") by stop_after's wrapper."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    setattr(owner, name, stop_after(getattr(owner, name), n, how))


def brisk_command(target: str, n: int, how: str = "crash") -> list[str]:
    """The argv prefix of a `brisk` process (brisk's own run()) with `target` patched as patch() does."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import interrupt; "
            f"interrupt.patch({target!r}, {n}, {how!r}); from brisk.cli.main import run; run()")
    return [sys.executable, "-c", code]
