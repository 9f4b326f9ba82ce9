"""The command line, through Typer's runner and as a real subprocess; bad inputs fail cleanly."""
from __future__ import annotations

import contextlib
import json
import re
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import default_sigint
from typer.testing import CliRunner

from brisk.cli.main import app

runner = CliRunner()
BRISK = [sys.executable, "-c", "from brisk.cli.main import run; run()"]


def brisk(*args, input=None, timeout=300, env=None):
    """The command in a subprocess; stdin is `input`, or /dev/null (not the test runner's stdin,
    which brisk would read as part of the prompt if it were a pipe)."""
    stdin = subprocess.DEVNULL if input is None else None
    return subprocess.run(BRISK + list(args), input=input, stdin=stdin, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200", **(env or {})}, preexec_fn=default_sigint)


def assert_clean_error(r, *words):
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr + r.stdout
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w.lower() in err.lower(), err


def test_version_and_help():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("brisk ")
    for cmd in ("generate", "chat", "bench", "quantize", "eval", "serve"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "--help" in r.output
        assert "<bool>" not in r.output  # flags take no value: no type shown


# What only loading or running a model needs: help, a usage error or a value refused by its checks
# must not pay for it (`import torch` alone takes seconds on a small machine).
HEAVY = ("torch", "numpy", "transformers", "jinja2", "tokenizers", "gguf", "safetensors", "fastapi", "uvicorn",
         "llguidance", "huggingface_hub", "scipy", "sympy")
NO_HEAVY_IMPORTS = """
import json, sys
from typer.testing import CliRunner
from brisk.cli.main import app
heavy = lambda: sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
seen = {"app built": heavy()}
runner = CliRunner()
for args in CASES:
    r = runner.invoke(app, args)
    seen[" ".join(args)] = [r.exit_code, r.output, heavy()]
print(json.dumps(seen))
"""


def test_help_and_refusals_import_no_model_stack(tmp_path):
    """Building the app, --help of every command, a bad flag, a missing file and a bad value, in one
    fresh interpreter: none imports torch (or numpy, tokenizers, ...), and each refusal says what is
    wrong (test_errors.py checks the one-line form through the console script)."""
    missing, text = str(tmp_path / "missing.gguf"), tmp_path / "t.txt"
    text.write_text("some text")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "a"}\n{oops\n')
    busy = socket.socket()  # held while the refusals run: serve must refuse its port before loading
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    commands = ["generate", "chat", "bench", "info", "quantize", "eval", "serve", "distill", "cache", "pull", "list", "rm"]
    refused = {  # arguments -> words of the error
        ("generate", "--bogus"): "no such option",
        ("generate", "-m", missing, "Hi"): "no such file",
        ("generate", "--temperature", "-1", "Hi"): "--temperature",
        ("generate", "--device", "tpu", "Hi"): "--device",
        ("generate", "--dtype", "f8", "Hi"): "--dtype",
        ("generate", "-q", "int3", "Hi"): "--quantize",
        ("generate", "--threads", "0", "Hi"): "--threads",
        ("generate", "--json-schema", str(tmp_path / "s.json"), "Hi"): "no such file",
        ("generate", "--draft", missing, "Hi"): "no such file",
        ("generate", "--batch", str(tmp_path / "b.jsonl")): "cannot read",
        ("chat", "-m", missing): "no such file",
        ("chat", "--top-p", "2"): "--top-p",
        ("serve", "-m", missing): "no such file",
        ("bench", "-m", missing): "no such file",
        ("info", missing): "no such file",
        ("eval", "-m", missing, "-f", str(text)): "no such file",
        ("quantize", missing, "-o", str(tmp_path / "q"), "--method", "gptq"): "no such file",
        ("distill", missing, "-o", str(tmp_path / "d")): "no such file",
        ("quantize", "-o", str(tmp_path / "q"), "--method", "gptq", "--calib", missing): "no such file",
        ("distill", "-o", str(tmp_path / "d"), "--lr", "-1"): "--lr",
        ("distill", "-o", str(tmp_path / "d"), "--temperature", "0"): "--temperature",
        ("distill", "-o", str(tmp_path / "d"), "--data", missing): "no such file",
        ("distill", "-o", str(tmp_path / "d"), "--data", str(bad_jsonl)): "invalid json",
        ("distill", "-o", str(tmp_path / "no" / "d")): "no such folder",
        ("distill", "-o", str(text)): "already exists",
        ("quantize", "-o", str(tmp_path / "q"), "--method", "gptq", "--bits", "5"): "not 5",
        ("quantize", "-o", str(tmp_path / "q"), "--method", "awq", "--group-size", "7"): "--group-size",
        ("quantize", "-o", str(text), "--method", "int8", "--samples", "0"): "already exists",
        ("serve", "--port", str(busy_port)): "--port",
        ("serve", "--host", "no-such-host.invalid"): "--host",
    }
    cases = [["--help"]] + [[cmd, "--help"] for cmd in commands] + [list(a) for a in refused]
    script = f"HEAVY = {HEAVY!r}\nCASES = {cases!r}\n" + NO_HEAVY_IMPORTS
    with busy:
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen.pop("app built") == []
    for args, (code, output, heavy) in seen.items():
        assert heavy == [], f"brisk {args} imported {heavy}"
        words = refused.get(tuple(args.split(" ")))
        if words is None:
            assert code == 0, (args, output)
        else:
            assert code != 0 and words in output.lower() and "Traceback" not in output, (args, output)


def test_cpu_generate_imports_only_what_it_runs(tiny_gguf_path):
    """A CPU run of a GGUF imports no triton (its kernels need a GPU) and not the gguf package (brisk
    reads the file itself; the package only dequantizes types brisk has no reader for)."""
    script = ("import atexit, sys; from brisk.cli.main import run; sys.argv[1:] = ['generate', '-m', %r, 'hi', '-n', "
              "'2', '--device', 'cpu']\natexit.register(lambda: print(sorted({m.split('.')[0] for m in sys.modules} "
              "& {'triton', 'gguf', 'transformers'}), file=sys.stderr))\nrun()" % str(tiny_gguf_path))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as users run it
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "[]", r.stderr


def test_generate_runner_json(tiny_llama_dir):
    r = runner.invoke(app, ["generate", str(tiny_llama_dir), "hello", "--temperature", "0", "-n", "6", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["generated_tokens"] <= 6 and out["prompt_tokens"] > 0
    assert {"text", "decode_tok_s", "prefill_tok_s", "ttft_s"} <= out.keys()


def test_generate_json_logprobs(tiny_llama_dir):
    """--logprobs N adds each token's logprob (the model's, as serve reports them) and N alternatives."""
    import torch
    from brisk.core import LLM

    r = runner.invoke(app, ["generate", str(tiny_llama_dir), "hello", "-t", "0", "-n", "5", "--raw", "--json",
                            "--logprobs", "3"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    lps = out["logprobs"]
    assert len(lps) - out["generated_tokens"] == (out["finish_reason"] == "eos") and all(len(e["top"]) == 3 for e in lps)
    assert all(e["top"][0]["id"] == e["id"] for e in lps)  # greedy: the chosen token is the most likely
    llm = LLM.load(str(tiny_llama_dir), device="cpu", dtype="float32")
    ids = llm.prompt_ids("hello", raw=True) + [e["id"] for e in lps]
    with torch.inference_mode():
        ref = torch.log_softmax(llm.model(torch.tensor([ids]), 0, llm.new_cache())[0].float(), -1)
    n = len(ids) - len(lps)
    assert [e["logprob"] for e in lps] == pytest.approx([float(ref[n - 1 + i, e["id"]]) for i, e in enumerate(lps)],
                                                        abs=1e-4)
    bad = runner.invoke(app, ["generate", str(tiny_llama_dir), "hello", "--logprobs", "2"])
    assert bad.exit_code != 0 and "--json" in bad.output


def test_generate_presence_and_frequency_penalty_flags(tiny_gguf_path):
    """The flags reach the sampler (the looping random model answers differently) and --json names them."""
    args = ["generate", str(tiny_gguf_path), "hi", "-t", "0", "-n", "40", "--json", "--no-loop-stop"]
    plain = json.loads(runner.invoke(app, args).stdout.strip().splitlines()[-1])
    pen = runner.invoke(app, args + ["--frequency-penalty", "2", "--presence-penalty", "1.5"])
    out = json.loads(pen.stdout.strip().splitlines()[-1])
    assert out["sampling"]["frequency_penalty"] == 2.0 and out["sampling"]["presence_penalty"] == 1.5
    assert "frequency_penalty" not in plain["sampling"] and out["text"] != plain["text"]
    bad = runner.invoke(app, args + ["--presence-penalty", "3"])
    assert bad.exit_code != 0 and "--presence-penalty" in bad.output


def test_generate_stops_a_loop_by_default_and_reports_its_sampling(tiny_gguf_path):
    """The random-weight model loops under greedy: generate ends it (and says so) unless told not to;
    --json names the settings used, the model's own where a flag does not override them."""
    args = ["generate", str(tiny_gguf_path), "hi", "-t", "0", "-n", "200", "--json"]
    looped = json.loads(runner.invoke(app, args).stdout.strip().splitlines()[-1])
    plain = json.loads(runner.invoke(app, args + ["--no-loop-stop"]).stdout.strip().splitlines()[-1])
    assert looped["finish_reason"] == "loop" and plain["finish_reason"] == "length"
    assert looped["generated_tokens"] < 200 and plain["text"].startswith(looped["text"])
    assert looped["sampling"] == {"temperature": 0.0, "repetition_penalty": 1.0, "stop_loops": True}
    assert plain["sampling"]["stop_loops"] is False
    r = brisk(*args[:-1])  # on a terminal-less stderr, one line says why the answer ended early
    assert r.returncode == 0 and "repeats itself" in r.stderr


def test_generate_stdin_and_file(tiny_llama_dir, tmp_path):
    a = brisk("generate", str(tiny_llama_dir), "--temperature", "0", "-n", "5", "--raw", input="The fox")
    f = tmp_path / "p.txt"
    f.write_text("The fox")
    b = brisk("generate", "-m", str(tiny_llama_dir), "--file", str(f), "--temperature", "0", "-n", "5", "--raw")
    c = brisk("generate", str(tiny_llama_dir), "The fox", "--temperature", "0", "-n", "5", "--raw")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert a.stdout == b.stdout == c.stdout and a.stdout.strip()


def test_a_prompt_far_beyond_the_context_is_refused_from_its_head(tiny_llama_dir, tmp_path):
    """A 45 MB prompt file is not tokenized whole (8.8 GB and minutes; under a memory bound, an
    abort): its head alone shows it cannot fit. Peak memory is read in a wrapper process whose only
    child is brisk."""
    words = ["alpha", "beta", "gamma", "the", "fox", "jumps", "over", "dog"]
    f = tmp_path / "big.txt"
    f.write_text(" ".join(words[i * 7 % 8] for i in range(7_500_000)))
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True, "
               "stdin=subprocess.DEVNULL); print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(r.stderr, end='')")
    r = subprocess.run([sys.executable, "-c", wrapper, *BRISK, "generate", str(tiny_llama_dir), "-f", str(f), "--raw",
                        "-n", "2"], capture_output=True, text=True, timeout=300)
    (code, peak_kb), err = r.stdout.split("\n", 1)[0].split(), r.stdout.split("\n", 1)[1]
    assert code == "1" and len(err.strip().splitlines()) == 1, err
    assert "characters; its first" in err and "but the context is 256" in err, err
    assert int(peak_kb) < 1_500_000, peak_kb


def test_a_silent_open_stdin_pipe_is_announced_and_then_read(tiny_llama_dir):
    """A script's inherited pipe that never closes used to keep brisk waiting in silence: after a
    second without data it says so on stderr; what then arrives is still part of the prompt."""
    r, w = os.pipe()
    p = subprocess.Popen(BRISK + ["generate", str(tiny_llama_dir), "Translate:", "--raw", "-n", "2", "-t", "0", "--json"],
                         stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(r)
    try:
        lines = [p.stderr.readline()]  # blocks until brisk speaks (an import's warning may come first)
        while "waiting for the prompt" not in lines[-1] and lines[-1] and len(lines) < 20:
            lines.append(p.stderr.readline())
        assert "waiting for the prompt" in lines[-1] and "</dev/null" in lines[-1], lines
        os.write(w, b"The fox")
    finally:
        os.close(w)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    b = brisk("generate", str(tiny_llama_dir), "Translate:\n\nThe fox", "--raw", "-n", "2", "-t", "0", "--json")
    assert json.loads(out)["prompt_tokens"] == json.loads(b.stdout)["prompt_tokens"]


def test_chat_on_a_base_model_is_refused_before_the_weights_load(tiny_llama_dir, tmp_path):
    """Known from the tokenizer files: the weights here are not even readable, and the error is
    still the missing template (it came after a long load before)."""
    import shutil

    d = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"not weights")
    assert_clean_error(brisk("chat", str(d)), "has no chat template", "--raw")


def test_a_system_message_without_a_chat_template_is_refused(tiny_gguf_path):
    """It was dropped without a word with --raw or on a base model."""
    assert_clean_error(brisk("generate", str(tiny_gguf_path), "hi", "--system", "Be brief.", "-n", "1"),
                       "system message", "has none")
    assert_clean_error(brisk("generate", "hi", "--system", "Be brief.", "--raw", "-n", "1"), "system message", "--raw")


def test_an_empty_answer_says_why(tiny_llama_dir):
    """A --stop string the answer begins with left empty output and exit 0 without a word."""
    first = brisk("generate", str(tiny_llama_dir), "The fox", "--raw", "-n", "3", "-t", "0")
    assert first.returncode == 0 and first.stdout.strip(), first.stderr
    r = brisk("generate", str(tiny_llama_dir), "The fox", "--raw", "-n", "3", "-t", "0", "--stop", first.stdout[:1])
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout
    assert "answer is empty" in r.stderr and "--stop" in r.stderr, r.stderr


def test_llama_cpp_flag_names_are_aliases(tiny_llama_dir):
    """-p PROMPT, -c/--ctx-size, --n-predict: what llama-cli users type gives the same answer."""
    a = brisk("generate", str(tiny_llama_dir), "The fox", "--raw", "-n", "3", "-t", "0", "--ctx", "64", "--json")
    b = brisk("generate", str(tiny_llama_dir), "-p", "The fox", "--raw", "--n-predict", "3", "-t", "0", "-c", "64",
              "--json")
    c = brisk("generate", "-m", str(tiny_llama_dir), "--prompt", "The fox", "--raw", "-n", "3", "-t", "0",
              "--ctx-size", "64", "--json")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + b.stderr + c.stderr
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"] == json.loads(c.stdout)["text"]
    assert_clean_error(brisk("generate", str(tiny_llama_dir), "The fox", "-p", "again"), "prompt given twice")


def _stderr_on_a_terminal(args) -> tuple[int, str, str]:
    """Run brisk with stderr on a pty (spinners show there) and stdout a pipe: (exit, stdout, stderr)."""
    import pty
    import threading

    master, slave = pty.openpty()
    p = subprocess.Popen(BRISK + args, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL,
                         env={**os.environ, "COLUMNS": "200"})
    os.close(slave)
    chunks = []

    def drain():  # a pty holds a few kB: unread, the spinner would block the process
        with contextlib.suppress(OSError):
            while data := os.read(master, 65536):
                chunks.append(data)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    out, _ = p.communicate(timeout=300)
    t.join(10)
    os.close(master)
    return p.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def test_long_work_shows_progress_on_a_terminal_and_keeps_stdout_clean(tmp_path, tiny_gguf_path):
    """A prompt of a few thousand tokens and each bench row took tens of seconds without a sign:
    a transient spinner on stderr (a terminal) now says what runs; stdout holds the same answer and
    rows as without one."""
    f = tmp_path / "long.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 120)  # > 1024 tokens
    code, out, err = _stderr_on_a_terminal(["generate", "-f", str(f), "--raw", "-n", "3", "-t", "0"])
    plain = brisk("generate", "-f", str(f), "--raw", "-n", "3", "-t", "0")
    assert code == 0 and out == plain.stdout and out.strip(), (out, plain.stdout)
    assert "reading the prompt" in err and "prompt tokens read" in err
    code, out, err = _stderr_on_a_terminal(["bench", str(tiny_gguf_path), "-p", "32", "-n", "8", "-r", "2"])
    assert code == 0 and "| pp32 |" in out and "| tg8 |" in out, out
    assert "measuring" not in out and "measuring prefill of 32 tokens" in err, (out, err)


def test_piped_stdin_is_appended_to_a_prompt_argument(tiny_llama_dir):
    """`echo TEXT | brisk generate MODEL "Translate:"`: the prompt is the argument, a blank line,
    then stdin (as ollama does); invalid UTF-8 on stdin is a one-line error."""
    a = brisk("generate", str(tiny_llama_dir), "Translate:", "--raw", "-n", "3", "-t", "0", "--json", input="The fox")
    b = brisk("generate", str(tiny_llama_dir), "Translate:\n\nThe fox", "--raw", "-n", "3", "-t", "0", "--json")
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["prompt_tokens"] == jb["prompt_tokens"] and ja["text"] == jb["text"]
    r = subprocess.run(BRISK + ["generate", str(tiny_llama_dir), "-n", "2"], input=b"\xff\xfe bad", capture_output=True,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.decode().startswith("error: stdin is not UTF-8") and b"Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_default_model_subprocess():
    r = brisk("generate", "What is the capital of France?", "--temperature", "0", "-n", "20")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_piped_with_commands(tiny_llama_dir, tmp_path):
    save = tmp_path / "conv.json"
    lines = f"hello\n/stats\nagain\n/save {save}\n/reset\n/stats\n/bogus\n"
    r = brisk("chat", str(tiny_llama_dir), "--temperature", "0", "-n", "5", input=lines)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    saved = json.loads(save.read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert "prefilled" in r.stdout and "unknown command" in r.stdout
    assert "sampling: temperature 0.0, repetition_penalty 1.0, stop_loops True" in r.stdout


def test_chat_set_changes_sampling_for_the_answers_that_follow(tiny_llama_dir):
    """/set NAME VALUE as ollama's /set parameter: checked as the flags are, in force from the next
    answer."""
    script = "/set temperature 0\n/set max-tokens 3\n/set top_k x\n/set nope 1\nhello\n/stats\n"
    r = brisk("chat", str(tiny_llama_dir), "--temperature", "0.9", "--seed", "3", "-n", "20", input=script)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert "(temperature 0.0," in r.stdout and "max_tokens 3)" in r.stdout
    assert "must be an integer, got 'x'" in r.stdout and "/set NAME VALUE" in r.stdout
    assert "last answer: 3 tokens" in r.stdout and "sampling: temperature 0.0" in r.stdout


def test_bench_json(tiny_llama_dir):
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "16", "-n", "8", "-r", "2", "--json",
                            "--dtype", "float32,bfloat16"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["dtype"], x["test"]) for x in rows] == [("float32", "pp16"), ("float32", "tg8"),
                                                         ("bfloat16", "pp16"), ("bfloat16", "tg8")]
    assert all(x["tok_s"] > 0 and x["model_bytes"] > 0 for x in rows)
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "8", "-n", "4", "-r", "1", "--csv"])
    assert r.exit_code == 0 and r.stdout.startswith("model,")


def test_bench_depth_rows_run_after_the_context(tiny_llama_dir):
    """-d as llama-bench's: rows named "pp8 @ d16", and the timed tokens attend over the depth
    tokens fill_context put in the cache (their logits are those of one pass over both)."""
    import torch

    from brisk.core import benchmark
    from brisk.core.llm import LLM
    from brisk.core.model import LAST

    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "8", "-n", "4", "-d", "0,16", "-r", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert [x["test"] for x in json.loads(r.stdout)] == ["pp8", "tg4", "pp8 @ d16", "tg4 @ d16"]
    llm = LLM.load(str(tiny_llama_dir), dtype="float32")
    cache = llm.new_cache(32)
    benchmark.fill_context(llm, cache, 16, torch.Generator().manual_seed(0))
    ids = torch.randint(0, llm.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    more = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        after = llm.model(more, 16, cache, logit_rows=LAST)
        whole = llm.model(torch.cat([ids, more], 1), 0, llm.new_cache(32), logit_rows=LAST)
    torch.testing.assert_close(after, whole, rtol=1e-4, atol=1e-4)
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-d", "-1"])
    assert r.exit_code != 0 and "-d/--n-depth" in r.output
    r = runner.invoke(app, ["bench", str(tiny_llama_dir), "-p", "8", "-n", "4", "-d", "250"])  # 256 positions
    assert r.exit_code != 0 and "-d/--n-depth 250" in r.output and "holds 256" in r.output
    assert "Traceback" not in r.output


# ------------------------------------------------------------------ bad inputs

@pytest.mark.parametrize("name, value", [("BRISK_THREADS", "x"), ("BRISK_ACT8_SPLIT", "lots")])
def test_a_bad_env_setting_is_one_error_line(tiny_gguf_path, name, value):
    """A BRISK_ variable that does not parse (quant/settings.py) names itself, with no traceback,
    whether it is read at import (BRISK_ACT8_SPLIT) or when the kernels load (BRISK_THREADS)."""
    r = brisk("generate", str(tiny_gguf_path), "hi", "-n", "1", env={name: value})
    assert_clean_error(r, f"{name}={value!r} is not")


def test_missing_path():
    assert_clean_error(brisk("generate", "-m", "/no/such/model.gguf", "hi"), "no such file")


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_llama_dir, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    assert_clean_error(brisk("generate", str(bad), "hi"), "safetensors")


def test_corrupt_gguf_header(tiny_gguf_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    data = bytearray(tiny_gguf_path.read_bytes()[:4096])
    data[8:16] = b"\xff" * 8  # absurd tensor count
    bad.write_bytes(bytes(data))
    assert_clean_error(brisk("generate", str(bad), "hi"), "gguf")
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"hello world, not a model")
    assert_clean_error(brisk("generate", str(notgguf), "hi"), "gguf")


def test_unknown_architecture(tiny_llama_dir, tmp_path):
    bad = tmp_path / "arch"
    shutil.copytree(tiny_llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mamba", ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(brisk("generate", str(bad), "hi"), "unsupported architecture", "llama", "gemma3")


def test_empty_prompt(tiny_llama_dir):
    assert_clean_error(brisk("generate", str(tiny_llama_dir), "   "), "empty")


def test_prompt_over_context(tiny_llama_dir):
    r = brisk("generate", str(tiny_llama_dir), "fox " * 300, "--raw", "--ctx", "64")
    assert_clean_error(r, "context")


@pytest.mark.parametrize("flags,word", [(["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top-p"),
                                        (["--min-p", "2"], "min-p"), (["--top-k", "-5"], "top-k")])
def test_invalid_sampling_values(tiny_llama_dir, flags, word):
    assert_clean_error(brisk("generate", str(tiny_llama_dir), "hi", *flags), word)


def test_bad_device_and_dtype(tiny_llama_dir):
    assert_clean_error(brisk("generate", str(tiny_llama_dir), "hi", "--dtype", "float8"), "dtype")
    if not __import__("torch").cuda.is_available():
        assert_clean_error(brisk("generate", str(tiny_llama_dir), "hi", "--device", "cuda"), "cuda")


def test_pickle_weights_are_not_unpickled(tiny_llama_dir, tmp_path):
    bad = tmp_path / "pickle"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, bad / f)
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    (bad / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
    assert_clean_error(brisk("generate", str(bad), "hi"), "refused")
    assert not (tmp_path / "pwned").exists()


def _fake_hub_cache(root: Path, repo: str, src: Path, revision: str = "main") -> None:
    """The layout huggingface_hub writes: blobs are plain files here, which it accepts."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / "hub" / ("models--" + repo.replace("/", "--"))
    shutil.copytree(src, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / revision).write_text(commit)


def test_hub_id_resolves_offline_from_cache(tiny_llama_dir, tmp_path):
    _fake_hub_cache(tmp_path, "brisk-test/tiny-llama", tiny_llama_dir)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = lambda *a: subprocess.run(BRISK + list(a), capture_output=True, text=True, env=env, timeout=300)  # noqa: E731
    ok = run("generate", "brisk-test/tiny-llama", "The fox", "--raw", "--temperature", "0", "-n", "4")
    direct = brisk("generate", str(tiny_llama_dir), "The fox", "--raw", "--temperature", "0", "-n", "4")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == direct.stdout
    assert run("generate", "brisk-test/tiny-llama@main", "The fox", "--raw", "-n", "2").returncode == 0
    assert_clean_error(run("generate", "brisk-test/not-cached", "hi"), "not in the local hugging face cache")


@pytest.mark.slow
def test_chat_ctrl_c_interrupts_the_answer_not_the_session():
    import signal
    import time

    p = subprocess.Popen(BRISK + ["chat", "-n", "4000", "--temperature", "0", "--stop", "@@@@"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "COLUMNS": "200"}, preexec_fn=default_sigint)
    p.stdin.write(b"Write a very long story about a dragon, in ten chapters.\n")
    p.stdin.flush()
    first = os.read(p.stdout.fileno(), 1)  # the answer has started streaming (unbuffered read)
    time.sleep(1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(b"/stats\n", timeout=120)
    out = (first + out).decode()
    assert p.returncode == 0, err
    assert "[interrupted]" in out and "turns 1" in out
    decode = float(re.search(r"decode ([0-9.]+) tok/s", out).group(1))  # it read 0.0 when Ctrl-C came mid-step
    assert decode > 0, out
    assert b"Traceback" not in err


def _chat_in_pty(args, keys: list[bytes], timeout=120) -> tuple[int | None, str]:
    """Run `brisk chat` on a terminal (a pty): before sending keys[i], wait for prompt i+1.
    Returns the exit code (None if it did not exit within 30 s after the last keys) and the output."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    p = subprocess.Popen(BRISK + ["chat", *args], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out, deadline = b"", time.time() + timeout

    def read(until_prompts: int) -> None:
        nonlocal out
        while out.count(b">>> ") < until_prompts and time.time() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    out += os.read(master, 4096)
                except OSError:  # the process closed the terminal
                    return
            elif p.poll() is not None:
                return

    try:
        for i, k in enumerate(keys, 1):
            read(i)
            os.write(master, k)
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        read(len(keys) + 1)  # what it printed after the last keys (another prompt, if it stayed)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return rc, out.decode(errors="replace")


def test_chat_ctrl_d_leaves(tiny_llama_dir):
    rc, out = _chat_in_pty([str(tiny_llama_dir), "-n", "4"], [b"\x04"])
    assert rc == 0 and out.count(">>> ") == 1, out


def test_chat_save_errors_keep_the_session(tiny_llama_dir, tmp_path, monkeypatch):
    """/save to a missing folder is an error line, not the end of the chat; ~ is expanded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    script = f"hello\n/save {tmp_path}/missing/dir/x.json\n/save ~/saved.json\n/stats\n"
    r = brisk("chat", str(tiny_llama_dir), "-n", "4", input=script)
    assert r.returncode == 0, r.stderr
    assert "cannot save" in r.stdout + r.stderr and "turns 1" in r.stdout
    assert json.loads((tmp_path / "saved.json").read_text())["messages"][0]["content"] == "hello"
    assert not list(tmp_path.glob(".*.partial"))


def test_long_prompt_argument_with_stdin_not_a_terminal():
    """In a script (stdin not a terminal) a prompt longer than a file name can be is a prompt,
    not an OSError from asking whether it is a path."""
    prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 7  # 312 bytes
    r = subprocess.run(BRISK + ["generate", prompt, "-n", "3", "--json"],  # the default model
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_tokens"] >= 1


@pytest.mark.parametrize("args,words", [
    (["generate", "--nope", "hi"], ["no such option", "--nope"]),
    (["generate", "-n", "abc", "hi"], ["--max-tokens", "valid integer"]),
    (["quantize", "x"], ["missing option", "--out"]),
])
def test_usage_errors_are_clicks_own(args, words):
    """Usage errors: click's usage message naming the option, exit 2; no exception class names,
    no BRISK_DEBUG hint (typer vendors click, whose classes are not click's own)."""
    r = brisk(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    for w in words:
        assert w.lower() in r.stderr.lower(), r.stderr
    assert "BRISK_DEBUG" not in r.stderr and "Error:" in r.stderr and "NoSuchOption" not in r.stderr


def test_bare_brisk_prints_help_only():
    r = brisk()
    assert "Usage: brisk" in r.stdout and "error" not in r.stderr.lower() and "Traceback" not in r.stderr


def test_chat_multiline_message_is_one_turn(tiny_llama_dir):
    """Between two \"\"\" lines, pasted lines are one user message (one turn), on a terminal too."""
    r = brisk("chat", str(tiny_llama_dir), "-n", "2", input='"""\nfirst line\nsecond line\n"""\n/stats\n')
    assert r.returncode == 0 and "turns 1" in r.stdout, r.stdout + r.stderr
    rc, out = _chat_in_pty([str(tiny_llama_dir), "-n", "2"], [b'"""\ra\rb\r"""\r/stats\r\x04'])
    assert rc == 0 and "turns 1" in out, out


def test_chat_paste_on_a_terminal_is_one_message(tiny_llama_dir, tmp_path):
    """Lines pasted at once on a terminal (already waiting when the first is read) are one message;
    lines typed one by one stay one turn each, as do piped lines (test_chat_piped_with_commands)."""
    pasted, typed = tmp_path / "pasted.json", tmp_path / "typed.json"
    rc, out = _chat_in_pty([str(tiny_llama_dir), "-n", "2"],
                           [b"first line\rsecond line\rthird line\r", f"/save {pasted}\r".encode(), b"\x04"])
    assert rc == 0, out
    users = [m["content"] for m in json.loads(pasted.read_text())["messages"] if m["role"] == "user"]
    assert users == ["first line\nsecond line\nthird line"], out
    rc, out = _chat_in_pty([str(tiny_llama_dir), "-n", "2"], [b"one\r", b"two\r", f"/save {typed}\r".encode(), b"\x04"])
    assert rc == 0, out
    assert [m["content"] for m in json.loads(typed.read_text())["messages"] if m["role"] == "user"] == ["one", "two"]
    # a paste that ends with Ctrl-D: its message is answered, then the chat ends
    rc, out = _chat_in_pty([str(tiny_llama_dir), "-n", "2"], [f"/save {typed}\r".encode(), b"a\rb\r\x04"])
    assert rc == 0 and out.count(">>> ") == 2, out


def test_generate_interrupted_exits_130():
    """Ctrl-C (SIGINT) mid-answer: what was generated is printed, and the exit status says so."""
    import signal
    import time

    # --no-loop-stop: a greedy answer that starts repeating itself would end before the signal comes
    p = subprocess.Popen(BRISK + ["generate", "Write a long story about a dragon who learns to fly.", "-n", "3000",
                                  "--temperature", "0", "--no-loop-stop"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, preexec_fn=default_sigint)
    try:
        first = p.stdout.read(8)  # the answer has started
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert first and p.returncode == 130, (p.returncode, err)
    assert "Traceback" not in err.decode()


def test_warnings_during_generation_are_one_line(tiny_llama_dir):
    """-q nf4 on the CPU warns (no kernel) at its first matmul: one 'warning:' line, no source line."""
    r = brisk("generate", str(tiny_llama_dir), "hi", "-n", "2", "-q", "nf4")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and all(x.startswith("warning: ") for x in lines), r.stderr


def test_cache_lists_and_clears(tiny_gguf_path, tmp_path):
    env = {**os.environ, "BRISK_CACHE": str(tmp_path / "cache")}
    run = lambda *a: subprocess.run(BRISK + list(a), capture_output=True, text=True, env=env,  # noqa: E731
                                    stdin=subprocess.DEVNULL, timeout=300)
    assert run("generate", str(tiny_gguf_path), "hi", "-n", "1").returncode == 0
    r = run("cache")
    assert r.returncode == 0 and str(tiny_gguf_path.resolve()) in r.stdout, r.stdout + r.stderr
    r = run("cache", "--clear")
    assert r.returncode == 0 and r.stdout.startswith("freed ")
    assert str(tiny_gguf_path.resolve()) not in run("cache").stdout


def test_bench_table_rows_and_format_words(tiny_llama_dir):
    """The table is printed row by row (a markdown line per measurement, after its header) and
    names formats as users write them (int4, not Int4Linear)."""
    r = brisk("bench", str(tiny_llama_dir), "-p", "8", "-n", "4", "-r", "1", "-q", "int4,none")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| model |") and len(lines) == 5  # the header, then pp8 and tg4 per format
    assert [x.split(" | ")[3] for x in lines[1:]] == ["int4", "int4", "none", "none"]
    assert "Linear" not in r.stdout


def test_invalid_values_name_the_flag_and_batch_lines_the_field(tiny_llama_dir, tmp_path):
    """The core names an option as the Python API does (top_p); the command line prints its flag,
    and for a line of a --batch file the field as the file spells it."""
    r = runner.invoke(app, ["generate", str(tiny_llama_dir), "hi", "--top-p", "2"])
    assert r.exit_code == 1 and r.stderr.strip() == "error: --top-p must be in (0, 1], got 2.0", r.output
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"prompt": "hi", "top_p": 2}) + "\n")
    r = runner.invoke(app, ["generate", str(tiny_llama_dir), "--batch", str(batch)])
    assert r.exit_code == 1 and r.stderr.strip() == f"error: {batch}:1: top_p must be in (0, 1], got 2.0", r.output


def test_model_sampling_settings_sit_between_flags_and_defaults():
    """A GGUF's general.sampling.* keys (as llama.cpp's converter writes them) are the model's
    recommended settings, like generation_config.json: flags override them, they override brisk's."""
    from types import SimpleNamespace

    from brisk.cli.common import sampling_params
    from brisk.core.checkpoint import gguf_generation
    from brisk.core.sampling import SamplingParams

    gen = gguf_generation({"general.sampling.temp": 0.2, "general.sampling.top_p": 0.9, "general.sampling.top_k": 20,
                           "general.sampling.min_p": True, "general.sampling.penalty_repeat": 1.05,
                           "general.sampling.sequence": "kpt", "general.name": "x"})
    assert gen == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    llm = SimpleNamespace(checkpoint=SimpleNamespace(generation=gen))
    p = sampling_params(llm, None, None, None, None, None, None)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.2, 20, 0.9, SamplingParams().min_p, 1.05)
    p = sampling_params(llm, 0.7, None, 1.0, None, 1.0, 3, True)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed, p.stop_loops) == (0.7, 20, 1.0, 1.0, 3, True)


def test_a_stale_gguf_header_cache_is_replaced_in_place(tiny_gguf_path, tmp_path, monkeypatch):
    """A header cache from an older brisk (no "generation" key) is parsed again and rewritten in its
    folder, beside the float caches there, so the next open is fast again."""
    import brisk.core.checkpoint as ck

    monkeypatch.setattr(ck, "CACHE_DIR", tmp_path / "cache")
    gguf = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf_path, gguf)
    ck._gguf_header(gguf)
    folder = ck._gguf_cache_dir(gguf)
    info = json.loads((folder / "brisk.json").read_text())
    del info["generation"]
    (folder / "brisk.json").write_text(json.dumps(info))
    (folder / "float.safetensors").write_bytes(b"kept")
    assert ck._gguf_header(gguf)[4] == {}
    assert "generation" in json.loads((folder / "brisk.json").read_text())
    assert (folder / "float.safetensors").read_bytes() == b"kept" and not list(tmp_path.glob("cache/gguf/*.tmp*"))
