"""The `brisk` command: parses flags, calls brisk.core, prints. No model logic lives here."""
from __future__ import annotations

import os
import sys

import typer

# OpenMP threads that spin after each parallel region steal the core that NumPy's BLAS needs
# during CPU decoding (measured: ~5% slower decode, ~15% slower prefill when active).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .app import app  # noqa: E402
from . import bench_cmd, cache_cmd, chat_cmd, distill_cmd, eval_cmd, generate_cmd, info_cmd, models_cmd, pull_cmd, quantize_cmd, serve_cmd  # noqa: E402,F401  (registers the commands)


def run() -> None:
    """Console-script entry: user errors become one line on stderr and a non-zero exit."""
    try:
        _run()
    except SystemExit as e:
        _exit(e.code)
    _exit(0)


def _exit(code) -> None:
    """Leave with `code` (as sys.exit takes it). Once torch is loaded, without the interpreter's
    teardown: unloading its thousand modules takes most of a second after the answer is out. What
    that teardown owes is done first: other threads joined, atexit handlers run, output flushed."""
    if "torch" not in sys.modules:
        sys.exit(code)
    import atexit
    import threading

    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (brisk ... | head) or stream: nothing to keep
            pass
    os._exit(code or 0)


def _run() -> None:
    import warnings

    from ..core.errors import BriskError
    from ..quant import settings

    def one_line(message, category, filename, lineno, file=None, line=None):
        # warnings raised while generating (not only at load) read like the loader's: one line each
        from .common import warning_line

        print(warning_line(message, category), file=sys.stderr)

    warnings.showwarning = one_line
    try:
        rv = app(standalone_mode=False, prog_name="brisk")
        sys.exit(rv if isinstance(rv, int) else 0)
    except BriskError as e:
        print(f"error: {e.cli_message()}", file=sys.stderr)
        sys.exit(1)
    except settings.SettingError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # click usage errors and anything unexpected: still one line
        if _is_click_error(e):  # click's own usage message (exit 2), as any click program
            e.show()
            sys.exit(e.exit_code)
        if settings.DEBUG.get():
            raise
        print(f"error: {type(e).__name__}: {e} (set BRISK_DEBUG=1 for a traceback)", file=sys.stderr)
        sys.exit(1)


def _is_click_error(e: Exception) -> bool:
    """A click usage error, from click itself or from the copy of click that typer may vendor
    (typer._click: its classes are not click's, so isinstance against click misses them)."""
    return any(c.__name__ == "ClickException" for c in type(e).__mro__) and hasattr(e, "show")


if __name__ == "__main__":  # python -m brisk.cli.main, as the console script runs it
    run()
