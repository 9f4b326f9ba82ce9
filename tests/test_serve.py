"""`brisk serve`'s OpenAI API, driven by the official openai client and by raw HTTP: answers equal
single-stream generation, streaming equals non-streaming, bad requests get 4xx JSON errors,
concurrent clients all get complete answers, and a client that disconnects frees its blocks."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from brisk.core import GREEDY, LLM, Session
from brisk.core.batching import Engine, EngineThread, SerialEngine

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from brisk.cli.http_limits import HEAD_TIMEOUT_S, server_options  # noqa: E402
from brisk.cli.openai_api import create_app  # noqa: E402

from test_distill import heads_dir  # noqa: E402,F401 (fixture: heads trained on the tiny model in seconds)

KEY = "sk-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn on a thread, on a free loopback port, around one engine thread."""

    def __init__(self, llm, name="tiny", api_key=KEY, max_batch=8, step_delay=0.0, engine=None,
                 head_timeout_s=HEAD_TIMEOUT_S):
        self.runner = EngineThread(engine or Engine(llm, max_batch=max_batch))
        self.submitted = []
        submit = self.runner.submit

        def recording_submit(request, on_event):
            seq = submit(request, on_event)
            self.submitted.append(seq)
            return seq

        self.runner.submit = recording_submit
        if step_delay:  # slows generation down so a test can act in the middle of one
            step = self.runner.engine.step
            self.runner.engine.step = lambda: (time.sleep(step_delay), step())[1]
        app = create_app(llm, self.runner, GREEDY, name, api_key, max_tokens=16)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    **server_options(head_timeout_s)))  # as brisk serve runs it
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY, timeout=60,
                                    max_retries=0)

    def raw(self, method, path, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, data, {"Authorization": f"Bearer {KEY}", **(headers or {})})
        r = conn.getresponse()
        out = r.status, r.read()
        conn.close()
        return out[0], json.loads(out[1]) if out[1] else None

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.runner.close()


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(tiny)
    yield s
    s.close()


def reference(llm, ids, max_tokens, stop=()):
    s = Session(llm)
    list(s.stream(ids, GREEDY, max_tokens, stop))
    return s.last


def chat_ids(llm, content):
    return llm.prompt_ids(content)


def test_models(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]


def test_chat_and_completion_equal_single_stream(server, tiny):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris is"}],
                                              max_tokens=12, temperature=0)
    ref = reference(tiny, chat_ids(tiny, "Paris is"), 12)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, len(ref.tokens))
    c = server.client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0)
    ref = reference(tiny, tiny.tokenizer.encode("The quick brown"), 10)  # completions take the prompt as is
    assert c.choices[0].text == ref.text and c.usage.completion_tokens == len(ref.tokens)


def test_streaming_equals_non_streaming(server):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=14, temperature=0)
    whole = server.client.chat.completions.create(**kw)
    chunks = list(server.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    kw = dict(model="tiny", prompt="Hello, world", max_tokens=9, temperature=0)
    whole = server.client.completions.create(**kw)
    text = "".join(ch.choices[0].text for ch in server.client.completions.create(**kw, stream=True))
    assert text == whole.choices[0].text


def test_stop_strings_and_defaults(server, tiny):
    ref = reference(tiny, chat_ids(tiny, "Paris is"), 16)
    stop = ref.text[4:7]
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Paris is"}],
                                              stop=[stop], temperature=0)  # max_tokens: the server's 16
    assert r.choices[0].message.content == ref.text[:ref.text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    c = server.client.completions.create(model="tiny", prompt="Paris is", temperature=0)
    assert c.usage.completion_tokens <= 16


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
    ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "'n'"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x " * 400}]}, 400, "context"),
])
def test_malformed_chat_requests_get_4xx_json(server, body, status, words):
    code, out = server.raw("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert code == status, out
    assert words.lower() in out["error"]["message"].lower() and out["error"]["type"] == "invalid_request_error"


def test_a_request_without_model_gets_the_served_one(server):
    """As vLLM and llama-server do: one model is served, so a body without `model` means it."""
    code, out = server.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
    assert code == 200 and out["model"] == "tiny" and out["choices"][0]["message"]["role"] == "assistant", out


def test_raw_http_errors(server):
    code, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": 42})
    assert code == 400 and "prompt" in out["error"]["message"]
    code, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": "x " * 400})
    assert code == 400 and out["error"]["code"] == "context_length_exceeded"
    code, out = server.raw("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert code == 401 and out["error"]["code"] == "invalid_api_key"
    code, out = server.raw("GET", "/v1/nowhere")
    assert code == 404 and "error" in out
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="nope", max_retries=0).models.list()


def ask_concurrently(client, prompts, stops=None, workers=8) -> list[str]:
    """Each prompt's greedy chat answer (20 tokens at most), odd ones streamed, from `workers` clients."""
    def ask(i):
        kw = dict(model="tiny", messages=[{"role": "user", "content": prompts[i]}], max_tokens=20, temperature=0,
                  **({"stop": stops[i]} if stops and stops[i] else {}))
        if i % 2:
            return "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True))
        return client.chat.completions.create(**kw).choices[0].message.content

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(ask, range(len(prompts)), timeout=120))


def test_concurrent_clients_get_complete_answers(server, tiny):
    prompts = [f"question {i}: {'why ' * (i % 4)}the sky" for i in range(12)]
    want = [reference(tiny, chat_ids(tiny, p), 20) for p in prompts]
    assert ask_concurrently(server.client, prompts) == [w.text for w in want]
    engine = server.runner.engine
    assert engine.pool.n_free == engine.pool.n_blocks


def wait_for(cond, seconds=20.0):
    deadline = time.time() + seconds
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_blocks(tiny, stream):
    s = Server(tiny, step_delay=0.02)  # 200 tokens take >= 4 s: the client leaves long before
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        body = json.dumps({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "stream": stream})
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        assert wait_for(lambda: s.submitted and s.runner.engine.running)
        if stream:  # wait for the answer to start
            got = b""
            while b"data:" not in got:
                got += sock.recv(4096)
        sock.close()
        engine = s.runner.engine
        assert wait_for(lambda: s.submitted[0].finished, 10)
        assert s.submitted[0].result.finish_reason == "cancelled"
        assert wait_for(lambda: engine.pool.n_free == engine.pool.n_blocks and not engine.running, 10)
    finally:
        s.close()


@pytest.mark.slow
def test_smollm2_real_chat_answer(smollm2):
    s = Server(smollm2, name="smollm2")
    try:
        r = s.client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
    finally:
        s.close()


def test_health_needs_no_key(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    r = conn.getresponse()
    out = json.loads(r.read())
    assert r.status == 200 and out["status"] == "ok"
    engine = server.runner.engine  # the pool's free blocks, for scripts that watch for leaks
    assert out["kv_blocks"] == {"free": engine.pool.n_free, "total": engine.pool.n_blocks}


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("function_call", "auto"), ("best_of", 2),
                                         ("suffix", "x")])
def test_unsupported_fields_are_refused(server, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    status, out = server.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == field and "not supported" in out["error"]["message"]
    off = {**body, field: {"functions": [], "function_call": None, "best_of": 1, "suffix": None}[field]}
    assert server.raw("POST", "/v1/chat/completions", off)[0] == 200


def test_serve_refuses_a_busy_port_before_loading(tiny_llama_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-c", "from brisk.cli.main import run; run()", "serve", "no/such-model",
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr  # not a model error


@pytest.mark.parametrize("path, body, code, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "invalid_value", "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "invalid_value", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]},
     "invalid_value", "messages[1].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}]}, "context_length_exceeded",
     "messages"),
    ("/v1/completions", {"prompt": "x " * 400}, "context_length_exceeded", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, None, None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "invalid_value", "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": "high"}, "invalid_value", "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "invalid_value", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, "invalid_value", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 1}}, "invalid_value", "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}},
     "invalid_value", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "x"}}, "invalid_value", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [5]}, "invalid_value", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "invalid_value",
     "logit_bias"),
])
def test_core_errors_map_to_openai_codes_by_class(server, path, body, code, param):
    """The error's class picks the code and names the field (param); messages name fields, not flags."""
    status, out = server.raw("POST", path, {"model": "tiny", **body})
    err = out["error"]
    assert status == 400 and (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), out
    assert "--" not in err["message"]


def test_request_limits_refuse_one_request_and_serve_the_next(server, tiny):
    """An oversized body (413, whether or not its length is declared) and too many or too long stop
    strings (400) are refused without harming the requests after them."""
    from brisk.cli.openai_api import MAX_BODY_BYTES
    from brisk.core.jobs import MAX_STOP_CHARS, MAX_STOPS

    big = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 1)})
    code, out = server.raw("POST", "/v1/completions", big)
    assert code == 413 and "MiB" in out["error"]["message"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # chunked: no length declared
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    try:
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            conn.send(b"100000\r\n" + b"x" * (1 << 20) + b"\r\n")
        conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may answer and close before the sender is done
    assert conn.getresponse().status == 413
    conn.close()
    for stop in (["a"] * (MAX_STOPS + 1), "s" * (MAX_STOP_CHARS + 1)):
        code, out = server.raw("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": stop})
        assert code == 400 and "stop" in out["error"]["message"], out
    r = server.client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert r.choices[0].text == reference(tiny, tiny.prompt_ids("Hello", raw=True), 4).text


def test_nesting_bound_refuses_deep_bodies(server):
    """A body nested past MAX_JSON_DEPTH (or past the JSON parser's own bound) is a 400 in OpenAI's shape,
    not a server error; one at the bound passes the check."""
    from brisk.cli.openai_api import NESTED
    from brisk.cli.http_limits import MAX_JSON_DEPTH

    def nested(depth):
        inner = "[" * (depth - 1) + "]" * (depth - 1)  # the body object is the first level
        return '{"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": ' + inner + "}"

    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        status, out = server.raw("POST", "/v1/completions", nested(depth))
        assert status == 400 and out["error"]["message"] == NESTED, out
        assert out["error"]["type"] == "invalid_request_error"
    assert server.raw("POST", "/v1/completions", nested(MAX_JSON_DEPTH))[0] == 200


def test_slow_request_head_is_timed_out_while_others_are_served(tiny):
    """A connection trickling its headers (slow-loris) gets a 408 and is closed once the head timeout
    passes, while normal requests are answered meanwhile; a request whose head arrived in time may run
    (and stream) for longer than the timeout."""
    s = Server(tiny, step_delay=0.05, head_timeout_s=0.5)
    try:
        slow = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t0 = time.time()
        r = s.client.completions.create(model="tiny", prompt="Hello", max_tokens=40, stream=True)
        chunks = list(r)
        assert chunks[-1].choices[0].finish_reason and time.time() - t0 > 0.5  # outlived the head timeout
        for sock in slow:
            got = b""
            try:
                while True:
                    sock.sendall(b"a")  # a byte at a time, never the end of the head
                    part = sock.recv(4096)
                    if not part:
                        break
                    got += part
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert got.startswith(b"HTTP/1.1 408") and time.time() - t0 < 5, got
            sock.close()
    finally:
        s.close()


def test_key_check_runs_no_worker_threads(server):
    """Concurrent requests do not each take a worker thread (a sync dependency would run on anyio's pool)."""
    before = {t.name for t in threading.enumerate()}
    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(lambda _: server.raw("GET", "/v1/models")[0], range(32))) == {200}
    assert not [t.name for t in threading.enumerate() if t.name not in before and "AnyIO" in t.name]


# ---------------------------------------------------------------- --draft: one request at a time, speculative

@pytest.mark.parametrize("draft", ["ngram", "lookahead", "heads"])
def test_draft_server_answers_as_single_stream(tiny, draft, request):
    """brisk serve --draft: concurrent clients queue and each gets plain greedy's answer, streamed or
    not, through the speculative loop (trees for lookahead and heads)."""
    from brisk.core.spec.build import make_speculator

    spec = make_speculator(tiny, f"heads:{request.getfixturevalue('heads_dir')}" if draft == "heads" else draft)
    proposals = []
    propose = spec.propose
    spec.propose = lambda *a, **k: proposals.append(1) or propose(*a, **k)
    s = Server(tiny, engine=SerialEngine(tiny, spec))
    try:
        prompts = [f"question {i}: {'why ' * (i % 3)}the sky the sky" for i in range(6)]
        stops = [["sky"] if i == 5 else None for i in range(6)]
        want = [reference(tiny, chat_ids(tiny, p), 20, stop=tuple(st or ())) for p, st in zip(prompts, stops)]
        assert ask_concurrently(s.client, prompts, stops, workers=4) == [w.text for w in want]
        assert len(proposals) >= sum(len(w.tokens) for w in want) // 4  # the speculative loop ran them
        assert not s.runner.engine.has_work()
    finally:
        s.close()


def test_draft_server_client_disconnect(tiny):
    from brisk.core.spec.build import make_speculator

    engine = SerialEngine(tiny, make_speculator(tiny, "ngram"))
    s = Server(tiny, engine=engine, step_delay=0.02)
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        body = json.dumps({"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "stream": True})
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        got = b""
        while b"data:" not in got:
            got += sock.recv(4096)
        sock.close()
        assert wait_for(lambda: s.submitted[0].finished, 10)
        assert s.submitted[0].result.finish_reason == "cancelled"
        assert wait_for(lambda: not engine.has_work(), 10)
        r = s.client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0)
        assert r.choices[0].text == reference(tiny, tiny.tokenizer.encode("The quick brown"), 10).text
    finally:
        s.close()


@pytest.mark.parametrize("args, words", [
    (["--draft", "heads:/no/such/heads"], "heads"),
    (["--draft", "ngram", "--kv-tokens", "4096"], "--kv-tokens"),
    (["--draft-k", "3"], "--draft-k needs --draft"),
])
def test_serve_draft_arguments_fail_before_loading(tiny_llama_dir, args, words):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from brisk.cli.main import run; run()", "serve", "no/such-model",
                        "--port", str(free_port()), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and words in r.stderr, r.stderr


def greedy_tokens(server, **kw) -> list[int]:
    """The token ids of a greedy completion of a fixed prompt, with kw's extra fields."""
    server.client.completions.create(model="tiny", prompt="the the the the", max_tokens=24, temperature=0, **kw)
    return server.submitted[-1].result.tokens


def test_presence_and_frequency_penalties(server):
    """Greedy with a strong penalty answers differently; presence and frequency at their most
    (2 + 2 per repeat) keep a token from coming back on the tiny model; 0 is plain greedy."""
    plain = greedy_tokens(server)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself unpenalized
    assert greedy_tokens(server, presence_penalty=0, frequency_penalty=0) == plain
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        assert greedy_tokens(server, **kw) != plain
    penalized = greedy_tokens(server, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(penalized)) == len(penalized) == 24
    # negative penalties favour repeats
    assert len(set(greedy_tokens(server, presence_penalty=-2.0))) <= len(set(plain))


def test_logit_bias(server):
    plain = greedy_tokens(server)
    other = next(t for t in range(3, 100) if t not in plain)
    assert greedy_tokens(server, logit_bias={str(other): 100})[0] == other
    assert greedy_tokens(server, logit_bias={str(plain[0]): -100})[0] != plain[0]
    assert greedy_tokens(server, logit_bias={}) == plain


def sampled(server, chat: bool, stream: bool, **kw) -> str:
    kw = dict(model="tiny", max_tokens=20, temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "min_p": 0}, **kw)
    if chat:
        r = server.client.chat.completions.create(messages=[{"role": "user", "content": "tell me"}], stream=stream, **kw)
        return "".join(ch.choices[0].delta.content or "" for ch in r) if stream else r.choices[0].message.content
    r = server.client.completions.create(prompt="Once upon a time", stream=stream, **kw)
    return "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_same_seed_same_sampled_answer(server, chat):
    """A seed gives the same answer again, streamed or not; another seed (almost surely) another."""
    answers = {sampled(server, chat, stream, seed=1234) for stream in (False, True, False)}
    assert len(answers) == 1
    others = {sampled(server, chat, False, seed=s) for s in range(3)}
    assert len(others | answers) > 1


def test_seeded_penalized_answer_alone_or_batched(tiny):
    """The engine gives a seeded, penalized request the same answer alone as alongside other
    requests in the same steps (each sequence has its own generator and its own counts)."""
    s = Server(tiny, step_delay=0.01)
    try:
        kw = dict(seed=7, presence_penalty=1.0, frequency_penalty=0.5)
        alone = sampled(s, False, False, **kw)
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(sampled, s, i % 2 == 0, i % 3 == 0, seed=100 + i, frequency_penalty=1.0)
                       for i in range(5)]
            time.sleep(0.05)
            batched = pool.submit(sampled, s, False, True, **kw)
            [f.result(120) for f in futures]
            assert batched.result(120) == alone
        assert s.runner.engine.stats.decode_tokens > s.runner.engine.stats.decode_steps  # they did share steps
    finally:
        s.close()
