"""The OpenAI-compatible HTTP API of `brisk serve`: /v1/models, /v1/completions and
/v1/chat/completions, streamed as server-sent events or not. Requests go to one continuous-
batching engine running on its own thread; each request waits on an asyncio queue that the
engine thread feeds. A client that goes away cancels its request, which frees its blocks.
Errors are OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from dataclasses import replace

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..core.errors import BriskError, InvalidValue, PromptTooLong
from ..core.jobs import request_from, response_grammar
from ..core.tool_calls import MAX_CALLS, checked_choice, checked_tools, tool_format
from ..core.logprobs import checked_count
from .openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs
from ..core.sampling_params import SamplingParams
from ..core.batching import Engine, EngineThread, Sequence
from .http_limits import MAX_BODY_BYTES, MAX_JSON_DEPTH, too_deep

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "loop": "stop", "cancelled": "stop"}
# OpenAI fields brisk does not implement: refused (400) rather than silently ignored, unless they
# hold their "off" value (false, null, an empty list, a plain-text response format)
UNSUPPORTED = ("functions", "function_call", "best_of", "suffix")
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per /v1/completions request (lm-eval sends batches of them)
NESTED = f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} deep"


def _is_off(key: str, value) -> bool:
    """Whether a field's value asks for nothing beyond plain generation."""
    if key == "response_format":
        return value is None or (isinstance(value, dict) and value.get("type") == "text")
    if key == "tool_choice":
        return value in (None, "none")
    if key == "best_of":
        return value in (None, 1)
    return value in (None, False, [], {}, 0, "")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def api_error(e: BriskError, prompt_field: str) -> APIError:
    """A request that brisk's core refused, as the OpenAI API reports it: by the error's class.
    prompt_field: the body field that holds the prompt ("messages" or "prompt")."""
    if isinstance(e, PromptTooLong):
        return APIError(400, str(e), "context_length_exceeded", prompt_field)
    if isinstance(e, InvalidValue):
        return APIError(400, str(e), "invalid_value", e.name)
    return APIError(400, str(e))


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def create_app(llm, runner: EngineThread, sampling: SamplingParams, served_name: str,
               api_key: str | None = None, max_tokens: int = 512) -> FastAPI:
    """The app for one loaded model. sampling: defaults for fields a request leaves out;
    max_tokens: the chat default (completions default to 16, as OpenAI's do)."""
    async def check_key(request: HTTPRequest):
        # a dependency rather than middleware: BaseHTTPMiddleware hides client disconnects; async,
        # as a plain def would run on a worker thread for every request
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")

    app = FastAPI(title="brisk", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(check_key)])
    names = {served_name, llm.name}
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.code, e.param)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # unknown routes, wrong methods
        return error_response(e.status_code, str(e.detail))

    @app.get("/health")
    async def health():  # for load balancers and scripts waiting for the server: no key needed
        out = {"status": "ok", "model": served_name}
        if isinstance(runner.engine, Engine):  # the batching pool: blocks that leak show here (--draft has none)
            out["kv_blocks"] = {"free": runner.engine.pool.n_free, "total": runner.engine.pool.n_blocks}
        return out

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "brisk"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await _body(request)
        if not llm.tokenizer.has_chat_template:
            raise APIError(400, f"{served_name} has no chat template; use /v1/completions")
        if "messages" not in body:
            raise APIError(400, "'messages' is required", param="messages")
        if not isinstance(body.get("logprobs") or False, bool):
            raise APIError(400, "'logprobs' must be true or false", "invalid_value", "logprobs")
        top = body.get("top_logprobs")
        if top is not None and not body.get("logprobs"):
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "invalid_value", "top_logprobs")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        logprobs = _count(top or 0, "top_logprobs") if body.get("logprobs") else None
        try:
            tools = checked_tools(body["tools"]) if not _is_off("tools", body.get("tools")) else None
            choice = checked_choice(body.get("tool_choice"), tools)
        except InvalidValue as e:
            raise APIError(400, str(e), "invalid_value", e.name.split("[")[0].split(".")[0]) from None
        fmt = tool_format(llm.tokenizer.chat_template)
        if choice == "none" and (fmt is None or fmt.name != "harmony"):
            fmt = None  # (gpt-oss's answers are read as harmony with or without tools: its final channel)
        elif choice != "none":
            if fmt is None:
                raise APIError(400, f"{served_name}'s chat template does not render tools", "unsupported_parameter",
                               "tools")
        return await _complete(request, body, [body], dict(max_tokens=max_tokens, max_tokens_key=key,
                                                           logprobs=logprobs, tools=tools if choice != "none" else None),
                               chat=True, tools=(fmt, choice))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _body(request)
        for key in ("tools", "tool_choice", "response_format"):
            if not _is_off(key, body.get(key)):
                raise APIError(400, f"'{key}' goes with /v1/chat/completions", "unsupported_parameter", key)
        prompts = _prompts(body.get("prompt"))
        body.pop("messages", None)
        logprobs = None if body.get("logprobs") is None else _count(body["logprobs"], "logprobs")
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise APIError(400, "'echo' must be true or false", "invalid_value", "echo")
        # echo with max_tokens 0 scores the prompt alone (its logprobs, computed even when not asked for)
        scoring = echo and body.get("max_tokens") == 0
        prompt_logprobs = (logprobs or 0) if scoring else logprobs if echo else None
        options = dict(max_tokens=16, template_prompt=False, system=None, logprobs=logprobs,
                       prompt_logprobs=prompt_logprobs)
        return await _complete(request, body, [{**body, "prompt": p} for p in prompts], options, chat=False,
                               echo=echo)

    async def _body(request: HTTPRequest) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        data = bytearray()
        async for part in request.stream():  # read up to the limit, whatever the header said
            data += part
            if len(data) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
        try:
            body = json.loads(bytes(data))
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        except RecursionError:  # past the parser's own bound, itself far deeper than ours
            raise APIError(400, NESTED) from None
        if too_deep(body):
            raise APIError(400, NESTED)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if "model" not in body:  # one model served: what else could be meant (vLLM, llama-server agree)
            body["model"] = served_name
        if not isinstance(body["model"], str):
            raise APIError(400, "'model' must be a string", param="model")
        if body["model"] not in names:
            raise APIError(404, f"model {body['model']!r} does not exist; this server has {served_name!r}",
                           "model_not_found", "model")
        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise APIError(400, f"'n' must be an integer in [1, {MAX_N}]", "invalid_value", "n")
        if not isinstance(body.get("stream", False), bool):
            raise APIError(400, "'stream' must be true or false", param="stream")
        for key in UNSUPPORTED:
            if key in body and not _is_off(key, body[key]):
                raise APIError(400, f"'{key}' is not supported by brisk serve", "unsupported_parameter", key)
        return body

    async def _complete(request: HTTPRequest, body: dict, objs: list[dict], options: dict, chat: bool,
                        echo: bool = False, tools: tuple = (None, "none")):
        """Submit n choices for each of objs (the chat body, or one object per completions
        prompt: choice index = prompt index * n + j) and answer, streamed or not."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        n, seqs = body.get("n", 1), []

        def on_event(i):  # the logprobs' and tokens' counts at the event travel with it: the lists grow on
            return lambda s, text, done: loop.call_soon_threadsafe(
                queue.put_nowait, (i, text, done, len(s.result.logprobs or ()), len(s.result.tokens)))
        fmt, choice = tools
        try:
            grammar = None
            if fmt is not None and choice not in ("auto", "none"):  # a call is required: a grammar makes it parse
                grammar = await loop.run_in_executor(None, call_grammar, llm, fmt, options["tools"], choice)
            elif not _is_off("response_format", body.get("response_format")):  # compiled off the event loop
                grammar = await loop.run_in_executor(None, response_grammar, llm, body["response_format"])
            for obj in objs:
                req = request_from(llm, obj, sampling, stop=(), grammar=grammar, **options)
                for j in range(n):  # copies share the prompt's KV blocks (prefix sharing)
                    seed = req.sampling.seed
                    r = req if j == 0 or seed is None else replace(req, sampling=replace(req.sampling, seed=seed + j))
                    seqs.append(runner.submit(r, on_event(len(seqs))))
        except BriskError as e:
            for seq in seqs:
                runner.cancel(seq)
            raise api_error(e, "messages" if chat else "prompt") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        meta = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": served_name}
        heads = [_echo_text(obj["prompt"]) if echo else "" for obj in objs for _ in range(n)]
        shape = Choices(seqs, chat, heads, TokenTexts(llm.tokenizer), options.get("logprobs"), fmt)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(seqs, queue, meta, shape, usage, n), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async for _ in _events(seqs, queue, request):
            pass
        failed = next((s.error for s in seqs if s.error), None)
        if failed:
            raise APIError(500, f"generation failed: {failed}")
        if any(s.result.finish_reason == "cancelled" for s in seqs):
            return error_response(499, "client closed the request")
        return {**meta, "choices": [shape.whole(i) for i in range(len(seqs))], "usage": _usage(seqs, n)}

    def _echo_text(prompt) -> str:
        """What echo puts before a completion: the prompt as sent (token ids as their text)."""
        return prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt, skip_special=True)

    async def _events(seqs: list[Sequence], queue: asyncio.Queue, request: HTTPRequest | None):
        """The engine's (choice, text, finished, logprobs so far) events for seqs until all are
        done. When the client disconnects (noticed by polling when not streaming, by cancellation
        when streaming), the requests are cancelled."""
        loop = asyncio.get_running_loop()
        checked, open_ = loop.time(), len(seqs)
        try:
            while open_:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    event = None
                if request is not None and loop.time() - checked >= 0.25:
                    checked = loop.time()
                    if await request.is_disconnected():
                        return
                if event is not None:
                    yield event
                    open_ -= bool(event[2])
        finally:
            for seq in seqs:
                if not seq.finished:
                    runner.cancel(seq)

    async def _stream(seqs: list[Sequence], queue: asyncio.Queue, meta: dict, shape: "Choices", usage: bool, n: int):
        meta = {**meta, "object": "chat.completion.chunk" if shape.chat else "text_completion"}

        def chunk(choice: dict) -> str:
            return f"data: {json.dumps({**meta, 'choices': [choice]}, ensure_ascii=False)}\n\n"

        if shape.chat:
            for i in range(len(seqs)):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for i, piece, done, n_logprobs, n_tokens in _events(seqs, queue, None):
            part = shape.part(i, piece, n_logprobs, n_tokens)
            if part is not None:
                yield chunk(part)
            if done and not seqs[i].error:
                for end in shape.end(i):
                    yield chunk(end)
        failed = next((s.error for s in seqs if s.error), None)
        if failed:
            err = {"error": {"message": f"generation failed: {failed}", "type": "server_error",
                             "param": None, "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
        elif usage:
            yield f"data: {json.dumps({**meta, 'choices': [], 'usage': _usage(seqs, n)})}\n\n"
        yield "data: [DONE]\n\n"

    return app


def _usage(seqs: list[Sequence], n: int) -> dict:
    """Prompt tokens once per prompt (the n choices of one prompt share it), completion tokens of every choice."""
    n_in = sum(s.result.prompt_tokens for s in seqs[::n])
    n_out = sum(len(s.result.tokens) for s in seqs)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _count(value, name: str) -> int:
    try:
        return checked_count(value, name)
    except InvalidValue as e:
        raise APIError(400, str(e), "invalid_value", name) from None


def _prompts(prompt) -> list:
    """/v1/completions' prompt: a string, a list of strings, a list of token ids, or a list of
    those lists; one choice (times n) each."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", "invalid_value", "prompt")
        return prompt
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                   "invalid_value", "prompt")


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def call_grammar(llm, fmt, tools: list[dict], choice: str):
    """The grammar of a required call ("required": any of the tools; else the one named)."""
    from ..core.grammar import Vocabulary

    tok = llm.tokenizer
    chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
    specials = {tok.backend.id_to_token(i): i for i in tok.special_ids}
    grammar = fmt.call_grammar(chosen, specials, MAX_CALLS if choice == "required" else 1)
    return Vocabulary.of(tok, llm.config.vocab_size).compile("lark", grammar, "tools")


class Choices:
    """The choices of one response, from their sequences: whole (not streamed) or as stream parts.
    logprobs: the number of alternatives asked for per token (None: no logprobs); heads: what
    echo puts before each completion; tool_fmt: the format tool calls are read in (chat with
    tools), which makes content stream only up to where a call may begin."""

    def __init__(self, seqs: list[Sequence], chat: bool, heads: list[str], texts: TokenTexts, logprobs: int | None,
                 tool_fmt=None):
        self.seqs, self.chat, self.heads, self.texts, self.top = seqs, chat, heads, texts, logprobs
        self.tool_fmt = tool_fmt
        self.echo = any(seq.request.prompt_logprobs is not None for seq in seqs)
        self.sent = [0] * len(seqs)  # logprob entries already streamed, per choice
        self.offset = [0] * len(seqs)  # characters already streamed (completions' text_offset), per choice
        self.started = [False] * len(seqs)
        self.said = [""] * len(seqs)  # content already streamed, with tools
        self._specials = None

    def _logprobs(self, i: int, lo: int, hi: int, offset: int, prompt: bool) -> dict | None:
        """Tokens lo:hi's logprobs (with prompt: the prompt's before them), or None when not asked for."""
        if self.top is None:
            return None
        res = self.seqs[i].result
        if self.chat:  # the content's tokens: the end token is not part of the message
            return chat_logprobs(res.logprobs[lo:min(hi, len(res.tokens))], self.texts, self.top)
        entries = res.logprobs[lo:hi]  # the end token included, as lm-eval's echo scoring expects
        tokens = [e.token for e in entries]
        if prompt:
            tokens, entries = self.seqs[i].request.prompt_ids + tokens, res.prompt_logprobs + entries
        return completion_logprobs(entries, tokens, self.texts, offset)

    # ---- tool calls: read from the text with its special tokens (some formats are made of them)
    def _raw(self, i: int, n: int | None = None) -> str:
        tokens = self.seqs[i].result.tokens
        return self.texts.tok.decode(tokens if n is None else tokens[:n], skip_special=False)

    def _plain(self, text: str) -> str:
        """text without special tokens' spellings (as content is shown)."""
        if self._specials is None:
            tok = self.texts.tok
            names = sorted({tok.backend.id_to_token(t) or "" for t in tok.special_ids} - {""}, key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, names))) if names else None
        return self._specials.sub("", text) if self._specials is not None else text

    def _split(self, i: int) -> tuple[str, list]:
        content, calls = self.tool_fmt.split(self._raw(i))
        return self._plain(content), calls

    @staticmethod
    def _calls(calls: list) -> list[dict]:
        return [{"index": k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for k, c in enumerate(calls)]

    def whole(self, i: int) -> dict:
        res = self.seqs[i].result
        finish = FINISH[res.finish_reason]
        if self.chat:
            message = {"role": "assistant", "content": res.text}
            if self.tool_fmt is not None:
                content, calls = self._split(i)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in self._calls(calls)]}
                    finish = "tool_calls"
                if self.tool_fmt.name == "harmony":  # the answer is the final channel; the analysis is reasoning
                    message["content"] = content or None
                    message["reasoning_content"] = self._plain(self.tool_fmt.reasoning(self._raw(i))) or None
            return {"index": i, "message": message, "logprobs": self._logprobs(i, 0, len(res.logprobs or ()), 0, False),
                    "finish_reason": finish}
        return {"index": i, "text": self.heads[i] + res.text,
                "logprobs": self._logprobs(i, 0, len(res.logprobs or ()), 0, self.echo),
                "finish_reason": finish}

    def part(self, i: int, piece: str, n_logprobs: int, n_tokens: int) -> dict | None:
        """A stream chunk's choice for new text (and the logprob entries up to n_logprobs); None
        when there is nothing to send. With tools, content goes out up to where a call may begin."""
        lo, first = self.sent[i], not self.started[i]
        if self.chat and self.tool_fmt is not None:
            raw = self._raw(i, n_tokens)
            shown = self._plain(raw[:self.tool_fmt.call_start(raw)])
            piece = shown[len(self.said[i]):] if shown.startswith(self.said[i]) else ""
            self.said[i] += piece
        head = self.heads[i] if first and not self.chat else ""
        if not piece and not head and (self.top is None or n_logprobs == lo):
            return None
        self.started[i], self.sent[i] = True, n_logprobs
        if self.chat:
            return {"index": i, "delta": {"content": piece}, "logprobs": self._logprobs(i, lo, n_logprobs, 0, False),
                    "finish_reason": None}
        lp = self._logprobs(i, lo, n_logprobs, self.offset[i], first and self.echo)
        self.offset[i] += len(head) + len(piece)
        return {"index": i, "text": head + piece, "logprobs": lp, "finish_reason": None}

    def end(self, i: int) -> list[dict]:
        """The last chunks of a choice: with tools, the content held back and the calls; then the
        finish reason."""
        finish = FINISH.get(self.seqs[i].result.finish_reason, "stop")
        if not self.chat:
            return [{"index": i, "text": "", "logprobs": None, "finish_reason": finish}]
        out = []
        if self.tool_fmt is not None:
            content, calls = self._split(i)
            if not calls and self.tool_fmt.name != "harmony":
                content = self._plain(self._raw(i))
            rest = content[len(self.said[i]):] if content.startswith(self.said[i]) else ""
            if rest:
                out.append({"index": i, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
            if calls:
                out.append({"index": i, "delta": {"tool_calls": self._calls(calls)}, "logprobs": None,
                            "finish_reason": None})
                finish = "tool_calls"
        return out + [{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish}]
