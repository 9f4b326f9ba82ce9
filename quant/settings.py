"""Every BRISK_ environment variable brisk reads, declared once: its name, type, default, when it is
read and why it exists. The code reads a value through its Setting (`settings.THREADS.get()`), at
import or per call as the reader needs; this module reads nothing at import. It lives at the lowest
layer so that quant/ and core/ read from the same declarations.

docs/configuration.md is this module's table: `python -m brisk.quant.settings > docs/configuration.md`
regenerates it (tests/test_settings.py checks that it is current)."""
from __future__ import annotations

import os
from dataclasses import dataclass

_NUMBERS = {"int": "a whole number", "float": "a number"}  # completing "BRISK_X='...' is not ..."


class SettingError(ValueError):
    """An environment variable whose value brisk cannot read; the message names the variable and
    is one line, as the command line prints it."""


@dataclass(frozen=True)
class Setting:
    """One environment variable. kind: "switch" (on unless "0"), "flag" (on when set to anything
    non-empty), "int", "float", "choice" (one of `choices`), "path" or "text" (as given; None unset).
    shown_default: the default as the table shows it, where `default` cannot say it (computed)."""
    name: str
    kind: str
    default: object
    read: str  # when the code reads it: "at import", "per call", ...
    why: str
    choices: tuple[str, ...] = ()
    shown_default: str = ""

    def get(self):
        """The value in the environment now (the default where unset); SettingError where it does
        not parse."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        if self.kind == "switch":
            return raw != "0"
        if self.kind == "flag":
            return bool(raw)
        try:
            if self.kind == "int":
                return int(raw)
            if self.kind == "float":
                return float(raw)
        except ValueError:
            raise SettingError(f"{self.name}={raw!r} is not {_NUMBERS[self.kind]}: {self.why}") from None
        if self.kind == "choice" and raw not in self.choices:
            raise SettingError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}: {self.why}")
        return raw

    def row(self) -> str:
        kind = " or ".join(self.choices) if self.kind == "choice" else self.kind
        default = self.shown_default or (("on" if self.default else "off") if isinstance(self.default, bool)
                                          else f"{self.default:g}" if isinstance(self.default, float) else self.default)
        return f"| `{self.name}` | {kind} | {default} | {self.read} | {self.why} |"


ALL: list[Setting] = []


def _declare(*args, **kwargs) -> Setting:
    setting = Setting(*args, **kwargs)
    ALL.append(setting)
    return setting


# ---------------------------------------------------------------- files and the command line

CACHE = _declare("BRISK_CACHE", "path", None, "at import (models), per build (kernels)",
                 "where brisk keeps converted GGUF tensors, header caches and its compiled kernels",
                 shown_default="~/.cache/brisk (the kernels: $XDG_CACHE_HOME/brisk where that is set)")
DEBUG = _declare("BRISK_DEBUG", "flag", False, "on an unexpected error",
                 "the command line shows an unexpected error's traceback, not one line")
API_KEY = _declare("BRISK_API_KEY", "text", None, "at `brisk serve`",
                   "the key `brisk serve` requires as `Authorization: Bearer` (as --api-key)", shown_default="none")

# ---------------------------------------------------------------- brisk's native CPU kernels (quant/native.py)

NATIVE = _declare("BRISK_NATIVE", "switch", True, "at import",
                  "0: the native kernels stay off and torch's kernels run (tests of the fallbacks)")
NATIVE_LEVEL = _declare("BRISK_NATIVE_LEVEL", "int", None, "once, at first use (native.level.cache_clear() rereads it)",
                        "caps the kernels' instruction set: 0 plain C, 1 AVX2, 2 AVX-512 (tests of each path)",
                        shown_default="the CPU's best")
THREADS = _declare("BRISK_THREADS", "int", 0, "when the kernels load",
                   "threads the native kernels split rows across (0: torch's, the physical cores)")
INT_DOT = _declare("BRISK_INT_DOT", "switch", True, "at import",
                   "0: every type's products take float32 activations, not 16-bit integer ones (A/B runs)")
ACT8 = _declare("BRISK_ACT8", "switch", True, "at import",
                "0: K-quant products take 16-bit activations, not 8-bit ones (llama.cpp's grid; A/B runs)")
ACT8_OUTLIERS = _declare("BRISK_ACT8_OUTLIERS", "float", 2.5e-4, "at import",
                         "an 8-bit activation block rounding worse than this keeps its largest inputs exact "
                         "(0: off); takes precedence over the split")
ACT8_SPLIT = _declare("BRISK_ACT8_SPLIT", "float", 0.0, "at import",
                      "an 8-bit activation row whose relative squared rounding error is above this also runs "
                      "its remainder as a second row (0: off; the outlier remedy is cheaper)")
OUTLIER_CACHE = _declare("BRISK_OUTLIER_CACHE", "float", 0.0625, "at import",
                         "the outliers' dequantized float columns a weight keeps, as a share of its own bytes "
                         "(a column not kept is dequantized again, to the same floats)")
INTERLEAVE = _declare("BRISK_INTERLEAVE", "switch", True, "per GGUF weight loaded",
                      "0: GGUF rows keep the file's layout, not interleaved by 8 for the kernels (A/B runs)")

# ---------------------------------------------------------------- other kernels

BLAS = _declare("BRISK_BLAS", "switch", True, "at import",
                "0: single-row float32 CPU products stay with torch, not NumPy's OpenBLAS (core/blas.py)")
BLAS_THREADS = _declare("BRISK_BLAS_THREADS", "int", 1, "at the first such product",
                        "OpenBLAS threads; more trade robustness on a busy machine for speed on an idle one")
CUDA_GRAPHS = _declare("BRISK_CUDA_GRAPHS", "switch", True, "per call (each decoder set up)",
                       "0: CUDA decode steps run eagerly, not as CUDA-graph replays")
TP_SHM = _declare("BRISK_TP_SHM", "switch", True, "when --tp's ranks start",
                  "0: the all-reduces and all-gathers between --tp ranks on one host go over gloo, not a "
                  "shared-memory segment (core/tp_shm.py)")
CUDA_INT4 = _declare("BRISK_CUDA_INT4", "choice", "tinygemm", "at import",
                     "int4 layers' CUDA kernel: torch's tinygemm, or the Triton planes kernel that reads each "
                     "weight once for up to 64 rows (batched, speculative)", choices=("tinygemm", "planes"))


def markdown() -> str:
    """docs/configuration.md: the table of every setting."""
    lines = ["# Configuration", "",
             "The environment variables brisk reads. Generated from quant/settings.py, where each is declared:",
             "`python -m brisk.quant.settings > docs/configuration.md` regenerates this file.", "",
             "Types: a switch is on unless set to 0; a flag is on when set to anything non-empty. A value that",
             "does not parse (an int, a float, a choice) stops brisk with one error line naming the variable.", "", "| Variable | Type | Default | Read | What it is for |", "| --- | --- | --- | --- | --- |"]
    return "\n".join(lines + [s.row() for s in ALL]) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
