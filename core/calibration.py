"""Calibration text for GPTQ/AWQ: read it (a --calib file, or the set brisk ships), tokenize it and
cut it into `samples` sequences of `seq_len` tokens.

The windows are spread evenly over the token stream, with no randomness: the same text and
arguments always give the same batch, which is what lets an interrupted quantization resume
and still produce the same bytes.
"""
from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import torch

from .errors import FileError, InvalidValue
from .files import read_user_text

BUILTIN_NAME = "calibration_text.txt"  # shipped as package data; documents separated by blank lines


def builtin_texts() -> list[str]:
    """The default set: prose, dialogue, code, lists and numbers written for brisk."""
    text = resources.files(__package__).joinpath(BUILTIN_NAME).read_text(encoding="utf-8")
    return [doc.strip() for doc in text.split("\n\n\n") if doc.strip()]


def load_texts(path: str | Path | None) -> list[str]:
    """Documents from `path` (plain text: one document; .jsonl: one {"text": ...} per line),
    or the built-in set when path is None. Missing, unreadable or empty input is a FileError."""
    if path is None:
        return builtin_texts()
    path = Path(path)
    raw = read_user_text(path)
    if path.suffix == ".jsonl":
        texts = [_jsonl_text(path, n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
    else:
        texts = [raw]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise FileError("the file holds no text", path)
    return texts


def _jsonl_text(path: Path, lineno: int, line: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise FileError(f"invalid JSON ({e.msg})", path, lineno) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise FileError('expected an object with a "text" string', path, lineno)
    return obj["text"]


def texts_digest(texts: list[str]) -> str:
    """A fingerprint of the calibration data (part of what decides whether a run can resume)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def calibration_batch(tokenizer, texts: list[str], samples: int, seq_len: int) -> torch.Tensor:
    """[samples, seq_len] token ids: the documents tokenized into one stream (each starting with
    BOS where the model expects one), cut into evenly spaced windows. Windows overlap when the
    text is shorter than samples * seq_len tokens; a text shorter than one window is an error."""
    if samples < 1:
        raise InvalidValue("samples", samples, "must be >= 1")
    if seq_len < 2:
        raise InvalidValue("seq_len", seq_len, "must be >= 2")
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t + "\n\n", add_special=True)
    n = len(stream)
    if n < seq_len:
        raise InvalidValue("seq_len", seq_len, f"must be at most {n}, the calibration text's length in tokens",
                           template=f"the calibration text has {n} tokens, fewer than {{option}} {seq_len}: "
                           "give more text or a smaller {option}")
    ids = torch.tensor(stream, dtype=torch.long)
    last = n - seq_len
    starts = [round(i * last / (samples - 1)) if samples > 1 else 0 for i in range(samples)]
    batch = torch.stack([ids[s:s + seq_len] for s in starts])
    if tokenizer.add_bos:  # every window starts as a real sequence does (Gemma depends on it)
        batch[:, 0] = tokenizer.bos_id
    return batch
