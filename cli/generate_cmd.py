"""`brisk generate`: one prompt in, streamed text out."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from . import common as c
from .main import app


@app.command()
def generate(
    args: Optional[List[str]] = typer.Argument(None, metavar="[MODEL] [PROMPT]",
                                               help="Model then prompt; with one argument it is the prompt "
                                                    "(or the model, when the prompt comes from stdin or --file)."),
    model: Optional[str] = c.ModelArg,
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from this file."),
    max_tokens: int = c.MaxTokOpt,
    temperature: Optional[float] = c.TempOpt,
    top_k: Optional[int] = c.TopKOpt,
    top_p: Optional[float] = c.TopPOpt,
    min_p: Optional[float] = c.MinPOpt,
    repetition_penalty: float = c.RepOpt,
    seed: Optional[int] = c.SeedOpt,
    stop: Optional[List[str]] = c.StopOpt,
    draft: Optional[str] = c.DraftOpt,
    draft_k: str = c.DraftKOpt,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (chat-template models)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token counts, speeds) at the end."),
    device: str = c.DeviceOpt,
    dtype: str = c.DtypeOpt,
    quantize: str = c.QuantizeOpt,
    ctx: Optional[int] = c.CtxOpt,
):
    """Generate text for one prompt, streamed to stdout.

    Examples:  brisk generate "Why is the sky blue?"  ·  brisk generate model.gguf "Hi" --temperature 0
    ·  echo "Hi" | brisk generate  ·  brisk generate -m org/name -f prompt.txt --json
    """
    with c.user_errors():
        model_name, prompt = _split_args(args or [], model, file)
        c.sampling_params(None, temperature, top_k, top_p, min_p, repetition_penalty, seed)  # fail fast
        c.check_draft(draft, draft_k)
        llm = c.load_llm(model_name, device, dtype, ctx, quiet=as_json, quantize=quantize)
        speculator = c.load_speculator(llm, draft, draft_k, quiet=as_json)
        sampling = c.sampling_params(llm, temperature, top_k, top_p, min_p, repetition_penalty, seed)
        from ..core.generate import Session

        session = Session(llm, speculator=speculator)
        ids = llm.prompt_ids(prompt, raw=raw, system=system)
        try:
            for piece in session.stream(ids, sampling, max_tokens, tuple(stop or ())):
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            session.last.finish_reason = "interrupted"
        res = session.last
        if as_json:
            out = {"model": llm.name, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
                   **res.to_dict()}
            sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write("\n")


def _split_args(args: list[str], model: Optional[str], file: Optional[Path]) -> tuple[Optional[str], str]:
    from ..core.errors import BriskError

    if len(args) > 2:
        raise BriskError(f"expected [MODEL] [PROMPT], got {len(args)} arguments (quote the prompt)")
    external = file is not None or not sys.stdin.isatty()
    if len(args) == 2:
        model_arg, prompt = args
    elif len(args) == 1 and model is None and external and _looks_like_model(args[0]):
        model_arg, prompt = args[0], None
    elif len(args) == 1:
        model_arg, prompt = None, args[0]
    else:
        model_arg, prompt = None, None
    if model is not None and model_arg is not None:
        raise BriskError("model given twice (positional and --model)")
    model = model or model_arg
    if prompt is None:
        if file is not None:
            try:
                prompt = file.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise BriskError(f"{file}: cannot read the prompt ({e.strerror if isinstance(e, OSError) else e})") from None
        elif not sys.stdin.isatty():
            prompt = sys.stdin.read()
        else:
            raise BriskError("no prompt: pass it as an argument, with --file, or on stdin")
    if not prompt.strip():
        raise BriskError("the prompt is empty")
    return model, prompt


def _looks_like_model(arg: str) -> bool:
    from ..core.checkpoint import HUB_ID

    return Path(arg).expanduser().exists() or arg.endswith(".gguf") or bool(HUB_ID.match(arg))
