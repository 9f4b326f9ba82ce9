"""Reading GGUF files: metadata as plain Python values, tensors dequantized to torch."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import BriskError


def open_gguf(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/KeyError/struct errors on bad files
        raise BriskError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader) -> dict[str, Any]:
    """All key/value fields; arrays become lists, strings str."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise BriskError(f"GGUF metadata field {key!r} is unreadable: {e}") from None
    return meta


def load_tensor(t) -> torch.Tensor:
    """One GGUF tensor as float32 torch, in PyTorch (row-major, out x in) shape."""
    import gguf

    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                         gguf.GGMLQuantizationType.BF16):
        arr = np.asarray(t.data)
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            out = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16).float()
        else:
            out = torch.from_numpy(arr.astype(np.float32, copy=False).copy())
        return out.reshape(shape)
    try:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise BriskError(f"GGUF tensor {t.name}: quantization type {t.tensor_type.name} is not supported") from None
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)
