"""Every `brisk` example in the README and in docs/ runs as written, in a shell, from a scratch
folder: the placeholder files it names are made there (model.gguf is the embedded default model's
file, MODEL the same, model-f16.gguf tinycoder's float one, hf-folder a tiny random Llama), and only small settings are added where
a command would take minutes (fewer tokens, fewer calibration samples). Lines that cannot run here
are listed in NOT_HERE with the reason. The files are read README first, then docs/ by name, and
each distinct line runs once, in that order (a later example may use what an earlier one wrote).
The Python examples run as written too."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_hf_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]
NOT_HERE = {  # a word of the line -> why it does not run on this machine
    "org/name": "a hub id: no network here",
    "brisk serve": "a server that runs until stopped: tests/test_serve.py drives it",
}
SMALL = [  # (command prefix, flags added unless the line has them): the same command, briefer
    ("brisk generate", "-n", "-n 4"),
    ("brisk chat", "-n", "-n 4"),
    ("brisk quantize", "--samples", "--samples 2 --seq-len 32"),
    ("brisk bench", "-n", "-n 4 -r 1"),
    ("brisk distill", "--samples", "--samples 4 --max-tokens 16 --steps 4 --batch 32 --no-measure"),
]


def blocks(lang: str, files: list[Path] = DOCS) -> list[str]:
    return [b for f in files for b in re.findall(rf"```{lang}\n(.*?)```", f.read_text(), re.S)]


def commands(files: list[Path] = DOCS) -> list[str]:
    lines = [line.split("  #")[0].strip() for b in blocks("sh", files) for line in b.splitlines()]
    return list(dict.fromkeys(line for line in lines if "brisk " in line))  # a repeated example runs once


def briefer(line: str) -> str:
    for prefix, flag, extra in SMALL:
        # --format gguf calibrates unless --method rtn, or a float --type that only converts
        calibrates = "--format gguf" not in line or not re.search(r"--method rtn|--type (F16|F32|BF16)\b", line)
        if prefix in line and f" {flag} " not in f" {line} " and calibrates:
            line += " " + extra
    return line


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, smollm2_path, tiny_gguf_path):
    d = tmp_path_factory.mktemp("readme")
    os.symlink(smollm2_path, d / "model.gguf")
    os.symlink(tiny_gguf_path, d / "model-f16.gguf")  # a float GGUF (F16/F32 tensors): --format gguf's source
    write_hf_checkpoint(d / "hf-folder", "llama")
    (d / "prompt.txt").write_text("Write one line about the sea.\n###\n")
    (d / "city.json").write_text('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, '
                                 '"required": ["name"]}')
    (d / "wiki.txt").write_text((README.parent / "bench" / "heldout.txt").read_text()[:3000])
    (d / "prompts.jsonl").write_text('{"prompt": "Hi"}\n{"messages": [{"role": "user", "content": "Hello"}]}\n')
    return d


def test_the_readme_has_examples_of_every_command():
    text = " ".join(commands([README]))
    for cmd in ("generate", "chat", "info", "bench", "quantize", "eval", "serve", "distill", "cache", "pull"):
        assert f"brisk {cmd}" in text, cmd
    assert len(blocks("python", [README])) == 1  # the Python API's example


@pytest.mark.slow
def test_readme_commands_run(scratch, smollm2_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "200"}
    ran = []
    for line in commands():
        if any(word in line for word in NOT_HERE):
            continue
        cmd = briefer(line.replace("MODEL", str(smollm2_path)))
        r = subprocess.run(cmd, shell=True, cwd=scratch, env=env, capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and "Traceback" not in r.stderr, f"{cmd}\n{r.stderr[-2000:]}"
        ran.append(line)
    assert len(ran) >= 20, ran  # most of them run here
    assert (scratch / "smol-gptq" / "config.json").exists() and (scratch / "out-nf4" / "config.json").exists()
    assert (scratch / "out.jsonl").read_text().count("\n") == 2


@pytest.mark.slow
def test_readme_python_example_runs(tmp_path):
    examples = blocks("python")
    assert examples
    out = ""
    for code in examples:
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out += r.stdout
    assert "Paris" in out
