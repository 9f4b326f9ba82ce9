"""`brisk serve`: an OpenAI-compatible HTTP server over continuous batching."""
from __future__ import annotations

from typing import Optional

import typer

from . import common as c
from ..quant import settings
from .app import app


@app.command()
def serve(
    model_pos: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="Model (default: embedded SmolLM2)."),
    model: Optional[str] = c.ModelArg,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="TCP port.", min=0, max=65535),
    max_concurrency: int = typer.Option(16, "--max-concurrency", help="Sequences generated at once; more "
                                        "requests wait their turn.", min=1),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=settings.API_KEY.name,
                                          help="Require 'Authorization: Bearer KEY' on every request."),
    served_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients send "
                                              "(default: MODEL as given, or the default model's name)."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Default max_tokens for chat requests "
                                   "that give none (completions default to 16, as OpenAI's).", min=1),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV pool size in tokens, shared by all "
                                            "sequences (default: max(2 x ctx, 16384)).", min=16),
    temperature: Optional[float] = c.TempOpt,
    top_k: Optional[int] = c.TopKOpt,
    top_p: Optional[float] = c.TopPOpt,
    min_p: Optional[float] = c.MinPOpt,
    device: str = c.DeviceOpt,
    dtype: str = c.DtypeOpt,
    threads: Optional[int] = c.ThreadsOpt,
    quantize: str = c.QuantizeOpt,
    ctx: Optional[int] = c.CtxOpt,
    kv_type: str = c.KvTypeOpt,
    draft: Optional[str] = typer.Option(None, "--draft", help="Speculative decoding for each request (as generate's "
                                        "--draft: a draft model, self:int8|self:int4, ngram, lookahead or heads:PATH). "
                                        "Requests then run one at a time, the rest queued: drafts and continuous "
                                        "batching fill the same pass."),
    draft_k: str = c.DraftKOpt,
    lookahead: Optional[str] = c.LookaheadOpt,
    tp: int = c.TpOpt,
):
    """Serve /v1/chat/completions, /v1/completions and /v1/models (OpenAI's API), streamed or not.

    Requests are batched continuously; the sampling options are defaults that request fields
    override. Example: brisk serve --port 8000, then any OpenAI client with
    base_url="http://127.0.0.1:8000/v1".
    """
    with c.user_errors():
        from ..core.errors import BriskError

        if model and model_pos:
            raise BriskError("model given twice (positional and --model)")
        name = model or model_pos
        sampling = c.sampling_params(None, temperature, top_k, top_p, min_p, 1.0, None)  # fail fast
        draft_options = c.check_draft(draft, draft_k, lookahead)
        from ..core.load_options import check_kv_type

        check_kv_type(kv_type)
        if draft and kv_tokens is not None:
            raise BriskError("--kv-tokens sizes the batching pool, which --draft does not use (one sequence at a time)")
        _check_port(host, port)  # before the model load, which takes a while
        from ..core.load_options import check_load_options

        check_load_options(name, device, dtype, quantize, threads, tp)  # before the server's stack is imported
        import uvicorn

        from ..core.batching import Engine, EngineThread, SerialEngine
        from .openai_api import create_app
        from .http_limits import server_options

        llm = c.load_llm(name, device, dtype, ctx, quantize=quantize, threads=threads, kv_type=kv_type, tp=tp)
        sampling = c.sampling_params(llm, temperature, top_k, top_p, min_p, 1.0, None)
        served = served_name or name or llm.name.removesuffix(" (default)")
        speculator = c.load_speculator(llm, draft_options)
        engine = (SerialEngine(llm, speculator) if speculator is not None
                  else Engine(llm, max_batch=max_concurrency, kv_tokens=kv_tokens))
        runner = EngineThread(engine)
        api = create_app(llm, runner, sampling, served, api_key, max_tokens)
        batching = (f"one sequence at a time, drafts: {speculator.describe()}" if speculator is not None
                    else f"{max_concurrency} sequences at once")
        c.err_console.print(f"serving {served} on http://{host}:{port}/v1 · {batching} · "
                            f"KV {'pool ' if speculator is None else ''}{engine.kv.nbytes / 2**20:.0f} MiB"
                            + (" · API key required" if api_key else ""), highlight=False)
        try:
            # "info": uvicorn's access log, one line per request
            uvicorn.run(api, host=host, port=port, log_level="info", timeout_graceful_shutdown=2, **server_options())
        finally:
            runner.close()


def _check_port(host: str, port: int) -> None:
    import socket

    from ..core.errors import InvalidValue

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:  # not an address nor a name this machine resolves
        raise InvalidValue("host", host, "", template=f"{{option}} {host!r}: {e.strerror or e}") from None
    try:
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(infos[0][4])
    except OSError as e:
        raise InvalidValue("port", port, "", template=f"{{option}} {port}: cannot listen on {host}:{port} "
                           f"({e.strerror or e})") from None
