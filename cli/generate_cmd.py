"""`brisk generate`: one prompt in, streamed text out; or a JSONL file of requests, batched."""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..core.errors import BriskError, FileError
from ..core.files import read_user_text
from . import common as c
from .openai_logprobs import TokenTexts
from .app import app


@app.command()
def generate(
    args: Optional[List[str]] = typer.Argument(None, metavar="[MODEL] [PROMPT]",
                                               help="Model then prompt; with one argument it is the prompt "
                                                    "(or the model, when the prompt comes from stdin or --file)."),
    model: Optional[str] = c.ModelArg,
    prompt_opt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt, as an option (llama-cli's "
                                             "-p); the positional argument is then the model."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from this file."),
    max_tokens: int = c.MaxTokOpt,
    temperature: Optional[float] = c.TempOpt,
    top_k: Optional[int] = c.TopKOpt,
    top_p: Optional[float] = c.TopPOpt,
    min_p: Optional[float] = c.MinPOpt,
    repetition_penalty: Optional[float] = c.RepOpt,
    presence_penalty: Optional[float] = c.PresenceOpt,
    frequency_penalty: Optional[float] = c.FrequencyOpt,
    loop_stop: bool = c.LoopOpt,
    seed: Optional[int] = c.SeedOpt,
    stop: Optional[List[str]] = c.StopOpt,
    draft: Optional[str] = c.DraftOpt,
    draft_k: str = c.DraftKOpt,
    lookahead: Optional[str] = c.LookaheadOpt,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as is, without the chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (chat-template models)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token counts, speeds) at the end."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Answer with JSON that follows this "
                                               "JSON schema file (every token is held to it)."),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar", help="Answer in the language of this grammar "
                                                "file: Lark, or llama.cpp's GBNF (rules written with ::=)."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", min=0, max=20, help="With --json: each generated "
                                           "token's log-probability under the model (the end token's too), and "
                                           "this many most likely alternatives."),
    batch: Optional[Path] = typer.Option(None, "--batch", help="A JSONL file of requests, generated together with "
                                         "continuous batching: one object a line with \"prompt\" or \"messages\" "
                                         "and optional max_tokens, temperature, top_p, top_k, min_p, "
                                         "repetition_penalty, seed, stop, id. The options above are the defaults."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="--batch: write the results here (JSONL, "
                                          "input order; default stdout)."),
    max_concurrency: int = typer.Option(16, "--max-concurrency", help="--batch: sequences generated at once.", min=1),
    device: str = c.DeviceOpt,
    dtype: str = c.DtypeOpt,
    threads: Optional[int] = c.ThreadsOpt,
    quantize: str = c.QuantizeOpt,
    ctx: Optional[int] = c.CtxOpt,
    kv_type: str = c.KvTypeOpt,
    tp: int = c.TpOpt,
):
    """Generate text for one prompt, streamed to stdout.

    Examples:  brisk generate "Why is the sky blue?"  ·  brisk generate model.gguf "Hi" --temperature 0
    ·  echo "Hi" | brisk generate  ·  brisk generate -m org/name -f prompt.txt --json
    """
    with c.user_errors():
        from ..core.load_options import check_kv_type

        check_kv_type(kv_type)  # before any model loads
        if batch is not None:
            if json_schema is not None or grammar_file is not None:
                raise BriskError("--json-schema and --grammar go with a single prompt (not with --batch)")
            if logprobs is not None:
                raise BriskError("--logprobs goes with a single prompt's --json (not with --batch)")
            if prompt_opt is not None:
                raise BriskError("--prompt goes with a single prompt (with --batch the prompts come from the file)")
            return _generate_batch(args or [], model, batch, output, max_concurrency, file, draft or lookahead,
                                   as_json, raw,
                                   system, max_tokens, tuple(stop or ()), device, dtype, ctx, kv_type, threads,
                                   quantize, tp, (temperature, top_k, top_p, min_p, repetition_penalty, seed, loop_stop,
                                    presence_penalty, frequency_penalty))
        if output is not None:
            raise BriskError("-o/--output goes with --batch (a single answer streams to stdout)")
        if logprobs is not None and not as_json:
            raise BriskError("--logprobs goes with --json (the logprobs are part of its object)")
        if prompt_opt is not None:
            if len(args or []) > 1 or file is not None:
                raise BriskError("prompt given twice (--prompt, and an argument or --file)")
            if args and model:
                raise BriskError("model given twice (positional and --model)")
            args = [args[0] if args else model, prompt_opt] if (args or model) else [prompt_opt]
            model = None
        model_name, prompt = _split_args(args or [], model, file)
        c.sampling_params(None, temperature, top_k, top_p, min_p, repetition_penalty, seed, False,
                          presence_penalty, frequency_penalty)  # fail fast
        draft_options = c.check_draft(draft, draft_k, lookahead)
        if json_schema is not None and grammar_file is not None:
            raise BriskError("give --json-schema or --grammar, not both")
        source = read_user_text(json_schema or grammar_file) if json_schema or grammar_file else None
        llm = c.load_llm(model_name, device, dtype, ctx, quiet=as_json, quantize=quantize, threads=threads,
                         kv_type=kv_type, tp=tp)
        grammar = _grammar(llm, source, json_schema, grammar_file) if source is not None else None
        speculator = c.load_speculator(llm, draft_options, quiet=as_json)
        sampling = c.sampling_params(llm, temperature, top_k, top_p, min_p, repetition_penalty, seed, loop_stop,
                                     presence_penalty, frequency_penalty)
        from ..core.generate import PREFILL_CHUNK, Session

        session = Session(llm, speculator=speculator)
        ids = llm.prompt_ids(prompt, raw=raw, system=system)
        try:
            pieces = session.stream(ids, sampling, max_tokens, tuple(stop or ()), logprobs, grammar)
            if len(ids) > 2 * PREFILL_CHUNK and not as_json and sys.stderr.isatty():
                with c.loading_bar(f"reading the prompt ({len(ids)} tokens)"):  # until the first piece
                    first = next(pieces, "")
                pieces = itertools.chain([first], pieces)
            for piece in pieces:
                if not as_json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            session.last.finish_reason = "interrupted"
        res = session.last
        if as_json:
            out = {"model": llm.name, "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
                   "kv_type": llm.kv_type.name, **res.to_dict(), "sampling": c.sampling_summary(sampling)}
            if res.logprobs is not None:
                out["logprobs"] = _logprobs_json(res.logprobs, TokenTexts(llm.tokenizer))
            sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
        else:
            sys.stdout.write("\n")
            if res.finish_reason == "loop":
                print(c.LOOP_NOTE, file=sys.stderr)
            elif not res.text and res.finish_reason in ("stop", "eos"):  # an empty answer, explained
                print("(the answer is empty: " + ("it began with a --stop string" if res.finish_reason == "stop"
                      else "the model ended it at once, with its end-of-sequence token") + ")", file=sys.stderr)
        if res.finish_reason == "interrupted":  # what was generated is printed; the exit says Ctrl-C
            raise typer.Exit(130)


def _grammar(llm, source: str, json_schema, grammar_file):
    """The compiled grammar of --json-schema or --grammar; errors name the file."""
    from ..core.errors import InvalidValue
    from ..core.grammar import Vocabulary, grammar_kind

    vocab = Vocabulary.of(llm.tokenizer, llm.config.vocab_size)
    try:
        if json_schema is not None:
            try:
                schema = json.loads(source)
            except ValueError as e:
                raise FileError(f"not JSON ({e})", json_schema) from None
            return vocab.compile("json_schema", schema, "json_schema")
        return vocab.compile(grammar_kind(source), source, "grammar")
    except InvalidValue as e:
        raise FileError(e.render("").lstrip(": "), json_schema or grammar_file) from None


def _logprobs_json(entries, texts) -> list[dict]:
    def one(t, lp):
        return {"token": texts(t)[0], "id": t, "logprob": round(lp, 6)}
    return [one(e.token, e.logprob) | ({"top": [one(t, v) for t, v in e.top]} if e.top else {}) for e in entries]


def _generate_batch(args, model, batch, output, max_concurrency, file, draft, as_json, raw, system, max_tokens,
                    stop, device, dtype, ctx, kv_type, threads, quantize, tp, flags):
    """Every request of the file through one continuous-batching engine; results in input order."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..core.jobs import read_jsonl, request_from, summary, unknown_keys

    if len(args) > 1 or (args and model):
        raise BriskError("with --batch, give only the model (the prompts come from the file)")
    if file is not None or draft or as_json:
        raise BriskError("--batch does not combine with --file, --draft or --json")
    objs = read_jsonl(batch)  # before loading a model: a bad file fails at once
    for obj in objs:
        for key in unknown_keys(obj):
            print(f"warning: {batch}:{obj['_line']}: unknown key {key!r} (ignored)", file=sys.stderr)
    llm = c.load_llm(model or (args[0] if args else None), device, dtype, ctx, quantize=quantize, threads=threads,
                     kv_type=kv_type, tp=tp)
    from ..core.batching import Engine

    defaults = c.sampling_params(llm, *flags)
    requests = []
    for obj in objs:
        try:
            requests.append(request_from(llm, obj, defaults, max_tokens, stop, template_prompt=not raw, system=system))
        except BriskError as e:  # named as the file names them (temperature, not --temperature)
            raise FileError(str(e), batch, obj["_line"]) from None
    engine = Engine(llm, max_batch=max_concurrency)
    seqs = []
    for obj, req in zip(objs, requests):
        try:
            seqs.append(engine.add(req))
        except BriskError as e:
            raise FileError(str(e), batch, obj["_line"]) from None
    t0 = time.perf_counter()
    show = sys.stderr.isatty()
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=c.err_console, disable=not show, transient=True) as bar:
        task = bar.add_task("batch", total=len(seqs), rate="")
        done = tokens = 0
        while engine.has_work():
            events = engine.step()
            tokens += len(events)
            done += sum(1 for _, _, finished in events if finished)
            bar.update(task, completed=done, rate=f"{tokens / (time.perf_counter() - t0):.1f} tok/s")
    wall = time.perf_counter() - t0
    lines = []
    for i, (obj, seq) in enumerate(zip(objs, seqs)):
        out = {"index": i, **({"id": obj["id"]} if "id" in obj else {}), **seq.result.to_dict(),
               "latency_s": round(seq.latency_s, 4)}
        lines.append(json.dumps(out, ensure_ascii=False) + "\n")
    if output is None:
        sys.stdout.writelines(lines)
    else:
        _write_output(output, "".join(lines))
    s = summary(seqs, wall, engine)
    mb = 1 / 2**20
    print(f"{s['requests']} requests in {s['wall_s']:.1f} s · {s['requests_per_s']:.2f} req/s · "
          f"{s['generated_tokens']} tokens generated, {s['generated_tok_s']:.1f} tok/s · latency mean "
          f"{s['latency_mean_s']:.2f} s, p95 {s['latency_p95_s']:.2f} s · KV pool {s['kv_pool_bytes'] * mb:.0f} MiB, "
          f"peak in use {s['kv_peak_used_bytes'] * mb:.1f} MiB (tokens need {s['kv_peak_needed_bytes'] * mb:.1f})"
          + (f" · {s['shared_prefix_tokens']} prompt tokens shared" if s["shared_prefix_tokens"] else "")
          + (f" · {s['preemptions']} preemptions" if s["preemptions"] else "")
          + (f" · wrote {output}" if output else ""), file=sys.stderr)


def _write_output(path: Path, text: str) -> None:
    from ..core.files import write_text_atomic

    try:
        write_text_atomic(path, text)
    except OSError as e:
        raise FileError(f"cannot write ({e.strerror})", path) from None


def _split_args(args: list[str], model: Optional[str], file: Optional[Path]) -> tuple[Optional[str], str]:
    """(model, prompt) from the positional arguments, --file and stdin. The rule: piped or
    redirected stdin is the prompt, or is appended to a prompt argument after a blank line (as
    ollama does: `echo TEXT | brisk generate "Translate:"`); a terminal or /dev/null is not read.
    With one argument and the prompt coming from stdin or --file, the argument is the model when
    it names one."""
    from ..core.errors import BriskError

    if len(args) > 2:
        raise BriskError(f"expected [MODEL] [PROMPT], got {len(args)} arguments (quote the prompt)")
    piped = None if file is not None else _stdin_text()
    external = file is not None or piped is not None
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
    if prompt is not None and file is not None:  # the file would be ignored without a word
        raise BriskError(f"prompt given twice (the argument {prompt[:40]!r} and --file)")
    model = model or model_arg
    if prompt is None:
        if file is not None:
            try:
                prompt = file.read_text()
            except (OSError, UnicodeDecodeError) as e:
                reason = e.strerror if isinstance(e, OSError) else e
                raise FileError(f"cannot read the prompt ({reason})", file) from None
        elif piped is not None:
            prompt = piped
        else:
            raise BriskError("no prompt: pass it as an argument, with --file, or on stdin")
    elif piped and piped.strip():
        prompt = f"{prompt}\n\n{piped}"
    if not prompt.strip():
        raise BriskError("the prompt is empty")
    return model, _valid_text(prompt)


def _valid_text(prompt: str) -> str:
    """A prompt argument with bytes that are not UTF-8 (Python keeps them as lone surrogates, which
    the tokenizer cannot take): those bytes become U+FFFD, said once on stderr."""
    try:
        prompt.encode("utf-8")
        return prompt
    except UnicodeEncodeError as e:
        print(f"warning: the prompt is not valid UTF-8 (character {e.start}): undecodable bytes replaced "
              "with U+FFFD", file=sys.stderr)
        return prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace") \
            if all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in prompt) \
            else prompt.encode("utf-8", "replace").decode("utf-8")


def _stdin_text() -> Optional[str]:
    """stdin's text when it is piped or redirected from a file; None for a terminal or a device
    such as /dev/null (never read: a script's `brisk generate PROMPT` must not wait on it)."""
    import os
    import stat

    from ..core.errors import BriskError

    if sys.stdin is None or sys.stdin.isatty():
        return None
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)):
            return None
        if not stat.S_ISREG(mode):
            _say_when_stdin_is_silent(sys.stdin.fileno())
        data = sys.stdin.buffer.read()
    except (OSError, ValueError, AttributeError):  # an in-memory stream (tests, embedding): read it
        data = sys.stdin.read()
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BriskError(f"stdin is not UTF-8 text (byte {e.start})") from None
    return data


STDIN_QUIET_SECONDS = 1.0


def _say_when_stdin_is_silent(fd: int) -> None:
    """A pipe inherited from a script, a CI step or subprocess that never closes would keep brisk
    waiting in silence (piped stdin is part of the prompt): after a second without data or EOF,
    say on stderr what brisk waits for and how not to."""
    import select

    ready, _, _ = select.select([fd], [], [], STDIN_QUIET_SECONDS)
    if not ready:
        print("brisk: waiting for the prompt's text on stdin (a pipe, still open, has sent nothing yet); "
              "run brisk with </dev/null when there is none", file=sys.stderr, flush=True)


def _looks_like_model(arg: str) -> bool:
    from ..core.model_path import HUB_ID

    try:
        exists = Path(arg).expanduser().exists()
    except (OSError, ValueError):  # not a possible path (too long, NUL): a prompt
        exists = False
    return exists or arg.endswith(".gguf") or bool(HUB_ID.match(arg))
