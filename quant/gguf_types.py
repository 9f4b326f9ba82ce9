"""The GGUF tensor types brisk knows, one row each: brisk's own facts about how it runs them.

The `gguf` package stays the reader of files (every type's sizes, the reference dequantization);
this table says, per type brisk handles, which native kernel runs it, in which layouts, with
which activation grid, and what brisk does without those kernels. Every module that needs such a
fact reads it here (quant/native.py, gguf_blocks.py, gguf_interleave.py, core's loaders), so a new
type is one row here, its kernel (kernels/*.h, with its row in kernels/gguf_types.h's traits
table) and its tests. tests/test_gguf_quant.py checks the sizes against gguf.GGML_QUANT_SIZES.
"""
from __future__ import annotations

from dataclasses import dataclass

# ggml's type ids (the numbers GGUF files store)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16, MXFP4 = 10, 11, 12, 13, 14, 30, 39

# Activation grids: (bits, inputs per scale); 32 bits is float32, not quantized.
FLOAT = (32, 1)
INT16_32 = (16, 32)  # kernels/int_dot.h: exact int32 sums, scaled in float
INT16_256 = (16, 256)  # the same per K-quant super-block
INT8_256 = (8, 256)  # kernels/int8_dot.h: llama.cpp's grid for the K-quants

# Without the native kernels (BRISK_NATIVE=0, or on a GPU) a quantized weight is repacked for torch's
# kernels (gguf_blocks.py: INT4 into Int4Linear, exact; INT8 into Int8Linear, requantized per row) or
# widened to float at load (WIDEN). FLOAT rows are floats already.
INT4, INT8, WIDEN = "int4", "int8", "widen"


@dataclass(frozen=True)
class GGUFType:
    id: int  # ggml's type id
    name: str
    block_weights: int  # weights per block (1 for the float types)
    block_bytes: int
    kernels: tuple[str, ...] = ()  # the native kernel files that multiply it (interleaved layout first); () none
    grid: tuple[int, int] = FLOAT  # the activations the native kernels take with it (BRISK_INT_DOT=0: FLOAT)
    grid_act8_off: tuple[int, int] | None = None  # BRISK_ACT8=0's grid, where it differs from `grid`
    interleave: str | None = None  # gguf_interleave.py's layout of rows by 8 (native.X8); None: the file's only
    fallback: str = WIDEN  # without the native kernels: INT4, INT8, WIDEN, or "float"
    written: bool = False  # brisk writes it (`brisk quantize --format gguf`: kernels/gguf_quantize.h)

    @property
    def native(self) -> bool:
        """Whether brisk's native kernels read this type's blocks in place."""
        return bool(self.kernels)

    @property
    def quantized(self) -> bool:
        return self.block_weights > 1


TYPES = (
    GGUFType(F32, "F32", 1, 4, ("tiles.c",), fallback="float"),
    GGUFType(F16, "F16", 1, 2, fallback="float"),
    GGUFType(Q4_0, "Q4_0", 32, 18, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="small", fallback=INT4, written=True),
    GGUFType(Q4_1, "Q4_1", 32, 20, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="small", fallback=INT4),
    GGUFType(Q5_0, "Q5_0", 32, 22, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="small", written=True),
    GGUFType(Q5_1, "Q5_1", 32, 24, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="small", written=True),
    GGUFType(Q8_0, "Q8_0", 32, 34, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="small", fallback=INT8, written=True),
    # Q2_K and Q3_K have no 16-bit path: float32 activations where 8-bit ones are off
    GGUFType(Q2_K, "Q2_K", 256, 84, ("q3k_x8.h", "int8_dot.h"), INT8_256, FLOAT, interleave="moved", written=True),
    GGUFType(Q3_K, "Q3_K", 256, 110, ("q3k_x8.h", "int8_dot.h"), INT8_256, FLOAT, interleave="moved", written=True),
    GGUFType(Q4_K, "Q4_K", 256, 144, ("q4k_x8.h", "int8_dot.h", "int_dot.h"), INT8_256, INT16_256,
             interleave="k_groups", fallback=INT4, written=True),
    GGUFType(Q5_K, "Q5_K", 256, 176, ("q4k_x8.h", "int8_dot.h", "int_dot.h"), INT8_256, INT16_256,
             interleave="k_groups", written=True),
    GGUFType(Q6_K, "Q6_K", 256, 210, ("q4k_x8.h", "int8_dot.h", "int_dot.h"), INT8_256, INT16_256, interleave="q6_k",
             written=True),
    GGUFType(BF16, "BF16", 1, 2, fallback="float"),
    GGUFType(MXFP4, "MXFP4", 32, 17, ("q8_x8.h", "int_dot.h"), INT16_32, interleave="mxfp4"),
)
BY_ID = {t.id: t for t in TYPES}

FLOAT_IDS = frozenset(t.id for t in TYPES if not t.quantized)  # widened cheaply at load, no cache needed
# the quantized types the native kernels read in place (F32 rows take their own path: native.F32)
NATIVE = tuple(t for t in TYPES if t.quantized and t.native)
INTERLEAVED = tuple(t for t in TYPES if t.interleave)  # the types with a layout of rows by 8
WRITTEN = tuple(t for t in TYPES if t.written)  # the types brisk quantizes float rows into
REPACKED = tuple(t for t in TYPES if t.fallback in (INT4, INT8))  # gguf_blocks.py's: kept quantized without the kernels


def interleavable(qtype: int, rows: int, cols: int) -> bool:
    """Whether a [rows, cols] matrix of qtype takes its rows-by-8 layout (gguf_interleave.py)."""
    t = BY_ID.get(qtype)
    return t is not None and t.interleave is not None and rows >= 8 and cols % t.block_weights == 0


def block(qtype: int) -> tuple[int, int]:
    """(weights, bytes) per block of a type in the table."""
    t = BY_ID[qtype]
    return t.block_weights, t.block_bytes


def names(types) -> str:
    """'A, B and C' (messages that list types)."""
    n = [t.name for t in types]
    return n[0] if len(n) == 1 else ", ".join(n[:-1]) + " and " + n[-1]
