"""llama.cpp's own converter (convert_hf_to_gguf.py and its gguf-py, from the llama-cpp-python
sdist that `make test` unpacks into .cache/), run in its own process: tiny HF models become GGUF
files exactly as users get them. A reference for the tests, never part of brisk."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(os.environ.get("BRISK_LLAMA_CPP", ROOT / ".cache" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"))

# The tiny test tokenizers are trained here, so llama.cpp does not know their pre-tokenizer's hash;
# they split as GPT-2 does (ByteLevel with its regex), which is what the converter is told.
_RUN = """
import sys
sys.path.insert(0, {src!r})
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def converter():
    """The source folder, or a skip saying how to get it."""
    if not (SOURCE / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not at {SOURCE} (make test fetches it)")
    return SOURCE


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """hf_dir as a GGUF file of `outtype` (f32, f16, bf16, q8_0), written by llama.cpp's converter."""
    src = converter()
    args = [str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    r = subprocess.run([sys.executable, "-c", _RUN.format(src=str(src), args=args)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and out.is_file(), r.stderr[-3000:]
    return out


def template(name: str) -> str:
    """A real model's chat template as llama.cpp keeps it for its tests (models/templates)."""
    path = converter() / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path.read_text(encoding="utf-8")
