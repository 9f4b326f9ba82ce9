"""The OpenAI-compatible HTTP API of `brisk serve`: /v1/models, /v1/completions and
/v1/chat/completions, streamed as server-sent events or not. Requests go to one continuous-
batching engine running on its own thread; each request waits on an asyncio queue that the
engine thread feeds. A client that goes away cancels its request, which frees its blocks.
Errors are OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid

from fastapi import Depends, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..core.errors import BriskError, InvalidValue, PromptTooLong
from ..core.jobs import request_from
from ..core.sampling import SamplingParams
from ..core.batching import EngineThread, Sequence

# A request's body is read into memory before anything else: bounded (a context's worth of text
# is well under 1 MiB; a long chat history under a few)
MAX_BODY_BYTES = 8 << 20
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "loop": "stop", "cancelled": "stop"}
# OpenAI fields brisk does not implement: refused (400) rather than silently ignored, unless they
# hold their "off" value (false, null, an empty list, a plain-text response format)
UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
               "best_of", "echo", "suffix")


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
    def check_key(request: HTTPRequest):
        # a dependency rather than middleware: BaseHTTPMiddleware hides client disconnects
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
        return {"status": "ok", "model": served_name}

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
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return await _complete(request, body, dict(max_tokens=max_tokens, max_tokens_key=key), chat=True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            body["prompt"] = prompt[0]
        elif not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string (or a list of one string)", param="prompt")
        if body.get("echo"):
            raise APIError(400, "echo is not supported", param="echo")
        body.pop("messages", None)
        return await _complete(request, body, dict(max_tokens=16, template_prompt=False, system=None), chat=False)

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
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if not isinstance(body.get("model"), str):
            raise APIError(400, "'model' (a string) is required", param="model")
        if body["model"] not in names:
            raise APIError(404, f"model {body['model']!r} does not exist; this server has {served_name!r}",
                           "model_not_found", "model")
        if body.get("n", 1) != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if not isinstance(body.get("stream", False), bool):
            raise APIError(400, "'stream' must be true or false", param="stream")
        for key in UNSUPPORTED:
            if key in body and not _is_off(key, body[key]):
                raise APIError(400, f"'{key}' is not supported by brisk serve", "unsupported_parameter", key)
        return body

    async def _complete(request: HTTPRequest, body: dict, options: dict, chat: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            req = request_from(llm, body, sampling, stop=(), **options)
            seq = runner.submit(req, lambda s, text, done: loop.call_soon_threadsafe(queue.put_nowait, (text, done)))
        except BriskError as e:
            raise api_error(e, "messages" if chat else "prompt") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        meta = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": served_name}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(seq, queue, meta, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text = ""
        async for piece, _ in _events(seq, queue, request):
            text += piece
        if seq.error:
            raise APIError(500, f"generation failed: {seq.error}")
        if seq.result.finish_reason == "cancelled":
            return error_response(499, "client closed the request")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = FINISH[seq.result.finish_reason]
        return {**meta, "choices": [choice], "usage": _usage(seq)}

    async def _events(seq: Sequence, queue: asyncio.Queue, request: HTTPRequest | None):
        """The engine's (text, finished) events for seq. When the client disconnects (noticed by
        polling when not streaming, by cancellation when streaming), the request is cancelled."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
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
                    if event[1]:
                        return
        finally:
            if not seq.finished:
                runner.cancel(seq)

    async def _stream(seq: Sequence, queue: asyncio.Queue, meta: dict, chat: bool, usage: bool):
        meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return f"data: {json.dumps({**meta, 'choices': [choice]}, ensure_ascii=False)}\n\n"

        if chat:
            yield chunk("", None, role=True)
        async for piece, done in _events(seq, queue, None):
            if piece:
                yield chunk(piece, None)
            if done and not seq.error:
                yield chunk(None, FINISH.get(seq.result.finish_reason, "stop"))
        if seq.error:
            err = {"error": {"message": f"generation failed: {seq.error}", "type": "server_error",
                             "param": None, "code": None}}
            yield f"data: {json.dumps(err)}\n\n"
        elif usage:
            yield f"data: {json.dumps({**meta, 'choices': [], 'usage': _usage(seq)})}\n\n"
        yield "data: [DONE]\n\n"

    return app


def _usage(seq: Sequence) -> dict:
    n_in, n_out = seq.result.prompt_tokens, len(seq.result.tokens)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
