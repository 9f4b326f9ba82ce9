"""Tensor parallelism (core/tensor_parallel.py) on the CPU over gloo: N ranks give the
single-process model's float32 logits and tokens; a rank that dies ends the run with one error
and no process left; `brisk generate --tp 2` prints what it prints without.

Rank 0 runs in a subprocess (it owns a process group and starts the other ranks), the reference
in this one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import default_sigint

from brisk.core import LLM
from brisk.core.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "the quick brown fox jumps over the lazy dog and then the fox"  # past Gemma's window of 8
IDS = list(range(3, 43))

RANK0 = """
import sys, torch
from brisk.core import LLM
from brisk.core.sampling_params import SamplingParams
llm = LLM.load(sys.argv[1], device="cpu", dtype="float32", tp=int(sys.argv[2]), quantize=sys.argv[6])
out = {"logits": llm.logits(eval(sys.argv[4]))}
for name, p in [("greedy", SamplingParams(temperature=0.0)), ("sampled", SamplingParams(temperature=0.8, seed=7))]:
    out[name] = llm.generate(sys.argv[5], p, max_tokens=12, raw=True).tokens
torch.save(out, sys.argv[3])
"""

HOLD = """
import signal, sys
from brisk.core import LLM, tensor_parallel
from brisk.core.errors import BriskError
llm = LLM.load(sys.argv[1], device="cpu", dtype="float32", tp=2)
llm.logits([3, 4, 5])
child = tensor_parallel._group.children[0]
print(child.pid, flush=True)
if sys.argv[2] == "kill-follower":
    child.send_signal(signal.SIGKILL)
    try:
        llm.logits([3, 4, 5, 6])
    except BriskError as e:
        print(e, flush=True)
        sys.exit(3)
sys.stdin.read()  # held until the test kills this rank 0
"""


def python(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, preexec_fn=default_sigint, **kw)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("kind,ranks,quantize", [
    ("tiny_llama_dir", 2, "none"), ("tiny_qwen2_dir", 2, "none"), ("tiny_gemma3_dir", 4, "none"),
    ("tiny_qwen2_dir", 2, "int8"), ("tiny_llama_dir", 2, "int4")],
    ids=["llama-2", "qwen2-bias-2", "gemma3-window-4", "qwen2-int8-2", "llama-int4-2"])
def test_ranks_match_one_process(kind, ranks, quantize, request, tmp_path):
    """llama: KV heads split 1 per rank; qwen2: q/k/v biases, tied head; gemma3: 1 KV head
    replicated over 4 ranks, sliding windows, a vocabulary split in 4. Quantized at load, the
    shards hold the single-process codes (int8: o/down cut from whole-row scales; qwen2's tied
    table read whole); the quantized kernels round their partial sums in another order, hence
    the wider tolerance there."""
    path = str(request.getfixturevalue(kind))
    out = tmp_path / "rank0.pt"
    r = python(RANK0, path, str(ranks), str(out), repr(IDS), PROMPT, quantize)
    assert r.returncode == 0, r.stderr
    got = torch.load(out)
    ref = LLM.load(path, device="cpu", dtype="float32", quantize=quantize)
    assert ref.quantization == ("none" if quantize == "none" else quantize)
    want = ref.logits(IDS)
    assert got["logits"].shape == want.shape
    torch.testing.assert_close(got["logits"], want, atol=1e-5 if quantize == "none" else 5e-5, rtol=0)
    assert got["greedy"] == ref.generate(PROMPT, SamplingParams(temperature=0.0), max_tokens=12, raw=True).tokens
    assert got["sampled"] == ref.generate(PROMPT, SamplingParams(temperature=0.8, seed=7), max_tokens=12,
                                          raw=True).tokens


def test_a_killed_rank_ends_the_run(tiny_llama_dir):
    """A follower killed mid-run: rank 0 raises one error naming it; nothing is left running.
    Rank 0 killed: its follower ends by itself."""
    r = python(HOLD, str(tiny_llama_dir), "kill-follower")
    assert r.returncode == 3, r.stderr
    pid, message = r.stdout.strip().splitlines()
    assert message == "--tp: rank 1 (killed by signal 9) ended, so the run stops"
    assert gone(int(pid))

    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tiny_llama_dir), "hold"], stdout=subprocess.PIPE,
                         stdin=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        pid = int(p.stdout.readline())
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 10
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(pid), "the follower outlived rank 0"
    finally:
        p.kill()


def brisk(*args):
    return subprocess.run([sys.executable, "-c", "from brisk.cli.main import run; run()", *args], text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=120, preexec_fn=default_sigint)


def test_generate_tp_2_prints_the_same(tiny_llama_dir):
    common = ["generate", str(tiny_llama_dir), "hello there", "-n", "16", "--temperature", "0", "--device", "cpu",
              "--dtype", "float32"]
    one, two = brisk(*common), brisk(*common, "--tp", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert one.stdout and two.stdout == one.stdout


@pytest.mark.parametrize("args,words", [
    (["generate", "--tp", "0", "hi"], "--tp must be a whole number"),
    (["generate", "--tp", "2", "-q", "nf4", "hi"], "--tp 2 with --quantize nf4"),
    (["serve", "--tp", "2"], "--tp: brisk serve does not run tensor parallel yet"),
    (["generate", "--tp", "2", "--draft", "ngram", "hi"], "--tp does not combine"),
], ids=["zero", "nf4", "serve", "draft"])
def test_refusals_name_the_flag(args, words):
    r = brisk(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {r.stderr.strip().removeprefix('error: ')}"]
    assert words in r.stderr


def test_refused_before_any_rank_starts(tiny_llama_dir):
    """Heads that do not split, and a kept-quantized GGUF (the default model), are refused before
    any rank starts."""
    r = brisk("generate", str(tiny_llama_dir), "hi", "--tp", "3")
    assert r.returncode == 1 and r.stderr.strip() == "error: --tp 3: the model's 4 attention heads do not split over 3 ranks"
    r = brisk("generate", "hi", "--tp", "3")
    assert r.returncode == 1 and r.stderr.startswith("error: --tp 3: ") and "loads quantized" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
