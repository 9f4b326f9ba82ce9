"""`brisk chat`: a terminal conversation that keeps the KV cache across turns."""
from __future__ import annotations

import sys
from typing import List, Optional

import typer
from rich.console import Console

from . import common as c
from .app import app

HELP = ("/reset  forget the conversation · /system TEXT  set the system message · /set NAME VALUE  a sampling "
        "setting (temperature, top_k, ..., max_tokens) · /save FILE · "
        "/load FILE · /stats · /exit (or Ctrl-D). Ctrl-C stops an answer. \"\"\" on a line of its own "
        "starts and ends a multi-line message.")


@app.command()
def chat(
    model_pos: Optional[str] = typer.Argument(None, metavar="[MODEL]", help="Model (default: embedded SmolLM2)."),
    model: Optional[str] = c.ModelArg,
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", "--n-predict", help="Most tokens per answer.", min=1),
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
    device: str = c.DeviceOpt,
    dtype: str = c.DtypeOpt,
    threads: Optional[int] = c.ThreadsOpt,
    quantize: str = c.QuantizeOpt,
    ctx: Optional[int] = c.CtxOpt,
    kv_type: str = c.KvTypeOpt,
    tp: int = c.TpOpt,
):
    """Chat with a model in the terminal, using its own chat template.

    Reads lines from stdin when it is not a terminal (one user turn per line). On a terminal,
    lines pasted at once are one message.
    """
    from ..core.errors import BriskError

    interactive = sys.stdin.isatty()
    out = Console(highlight=False, soft_wrap=True)
    with c.user_errors():
        if model and model_pos:
            raise BriskError("model given twice (positional and --model)")
        c.sampling_params(None, temperature, top_k, top_p, min_p, repetition_penalty, seed, False,
                          presence_penalty, frequency_penalty)
        draft_options = c.check_draft(draft, draft_k, lookahead)
        from ..core.load_options import check_kv_type

        check_kv_type(kv_type)
        from ..core.model_info import has_chat_template

        if has_chat_template(model or model_pos) is False:  # known from the header: before a long load
            raise BriskError(f"{model or model_pos or 'the model'} has no chat template (a base model?); "
                             "use `brisk generate --raw`")
        llm = c.load_llm(model or model_pos, device, dtype, ctx, quantize=quantize, threads=threads, kv_type=kv_type,
                         tp=tp)
        sampling = c.sampling_params(llm, temperature, top_k, top_p, min_p, repetition_penalty, seed, loop_stop,
                                     presence_penalty, frequency_penalty)
        from ..core.chat import Chat

        conv = Chat(llm, system=system, sampling=sampling, max_tokens=max_tokens, stop=tuple(stop or ()))
        conv.session.speculator = c.load_speculator(llm, draft_options)
    if interactive:
        try:  # line editing and history for input() (arrow keys, Ctrl-R)
            import readline  # noqa: F401
        except ImportError:  # not on every platform; input() still works
            pass
        out.print(f"[bold]{llm.name}[/bold] on {llm.device} ({str(llm.dtype).removeprefix('torch.')}), "
                  f"context {llm.ctx}. {HELP}", style="dim")
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:  # Ctrl-D at the prompt, or the end of piped input: leave
            if interactive:
                out.print()
            break
        except KeyboardInterrupt:
            out.print()
            continue
        if line == "" and not interactive:
            break  # end of piped input
        line = line.rstrip("\n")
        ended = False
        if line.strip() == '"""':  # a multi-line message (a paste), up to the next """ line
            line = _read_block(interactive)
        elif interactive and not line.startswith("/"):
            try:
                more, ended = _pasted_lines()
            except KeyboardInterrupt:  # Ctrl-C while the paste was read: the message is dropped
                out.print()
                continue
            line = "\n".join([line, *more])
        if not line.strip():
            if ended:
                break
            continue
        if line.startswith("/"):
            if not _command(line, conv, out):
                break
            continue
        try:
            with c.user_errors():
                answer = conv.send(line)
                try:
                    for piece in answer:
                        out.print(piece, end="", markup=False)
                except KeyboardInterrupt:
                    answer.close()
                    out.print(" [interrupted]", style="dim", end="", markup=False)
        except typer.Exit:  # the error was printed; the session goes on
            if ended:
                break
            continue
        out.print()
        if conv.session.last is not None and conv.session.last.finish_reason == "loop":
            out.print(c.LOOP_NOTE, style="dim", markup=False)
        if conv.last_dropped:
            out.print(f"(dropped the {conv.last_dropped} oldest turn(s) to fit the context)", style="dim")
        if ended:  # Ctrl-D came with the paste: leave after its answer
            out.print()
            break


# A paste reaches the terminal at once, so its lines are already waiting when the first is read
# (terminals without bracketed paste send them as typed lines; with it, readline returns one
# line holding them all). No one types Enter and then the next line within this time.
PASTE_GAP_S = 0.05


def _pasted_lines() -> tuple[list[str], bool]:
    """The lines already waiting on the terminal after the one just read: the rest of a paste, to
    send with it as one message. Also whether Ctrl-D (the end of input) came among them."""
    import select

    lines = []
    while select.select([sys.stdin.fileno()], [], [], PASTE_GAP_S)[0]:
        try:
            lines.append(input("... "))
        except EOFError:
            return lines, True
    return lines, False


def _read_block(interactive: bool) -> str:
    """Lines up to a line that is just \"\"\" (or the end of input), joined: one user turn."""
    lines = []
    while True:
        try:
            line = input("... ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        line = line.rstrip("\n")
        if line.strip() == '"""':
            break
        lines.append(line)
    return "\n".join(lines)


# /set NAME VALUE: the sampling flags, changed for the answers that follow (as ollama's /set parameter)
SETTABLE = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
            "presence_penalty": float, "frequency_penalty": float, "seed": int, "max_tokens": int}


def _set(conv, arg: str) -> None:
    """/set NAME VALUE, checked as the flags are; /set alone shows the settings."""
    from dataclasses import replace

    from ..core.errors import BriskError, InvalidValue

    if not arg:
        return
    name, _, value = arg.partition(" ")
    name = name.replace("-", "_")
    if name not in SETTABLE or not value.strip():
        raise BriskError(f"/set NAME VALUE, NAME one of {', '.join(SETTABLE)}")
    try:
        v = SETTABLE[name](value.strip())
    except ValueError:
        raise InvalidValue(name, value.strip(), f"must be {'an integer' if SETTABLE[name] is int else 'a number'}") from None
    if name == "max_tokens":
        if v < 1:
            raise InvalidValue(name, v, "must be >= 1")
        conv.max_tokens = v
    else:
        conv.sampling = replace(conv.sampling, **{name: v}).validate()


def _command(line: str, conv, out: Console) -> bool:
    """Run a /command; False means leave the session."""
    from ..core.errors import BriskError

    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    try:
        if cmd in ("/exit", "/quit", "/bye"):
            return False
        elif cmd == "/reset":
            conv.reset()
            out.print("(conversation cleared)", style="dim")
        elif cmd == "/system":
            conv.set_system(arg)
            out.print(f"(system message {'set' if arg else 'cleared'})", style="dim")
        elif cmd == "/save":
            if not arg:
                raise BriskError("/save needs a file name")
            conv.save(arg)
            out.print(f"(saved {len(conv.messages)} messages to {arg})", style="dim")
        elif cmd == "/load":
            if not arg:
                raise BriskError("/load needs a file name")
            conv.load(arg)
            out.print(f"(loaded {len(conv.messages)} messages from {arg})", style="dim")
        elif cmd == "/stats":
            r = conv.session.last
            t = conv.totals
            msg = (f"turns {t['turns']} · prompt tokens {t['prompt_tokens']} · prefilled {t['prefilled_tokens']} "
                   f"· generated {t['generated_tokens']} · cached {len(conv.session.ids)}/{conv.session.cache.max_len}")
            if r is not None:
                msg += (f"\nlast answer: {len(r.tokens)} tokens, prefill {r.prefilled_tokens} tokens at "
                        f"{r.prefill_tps:.1f} tok/s, decode {r.decode_tps:.1f} tok/s, first token {r.ttft_s:.2f} s")
            msg += "\nsampling: " + ", ".join(f"{k} {v}" for k, v in c.sampling_summary(conv.sampling).items())
            if r is not None and r.spec:
                sp = r.spec
                k = f"K {sp['k']}" if "options" not in sp else sp["k"]  # tree drafters: auto or their size
                msg += (f"\ndraft {sp['drafter']} ({k}): {sp['accepted']}/{sp['drafted']} drafted tokens "
                        f"accepted ({sp['acceptance_rate']:.0%}), {sp['mean_accepted']:.2f} per round "
                        f"over {sp['rounds']} rounds, {sp['passes']} target passes")
            out.print(msg, style="dim", markup=False)
        elif cmd == "/set":
            _set(conv, arg)
            out.print("(" + ", ".join(f"{k} {v}" for k, v in c.sampling_summary(conv.sampling).items())
                      + f", max_tokens {conv.max_tokens})", style="dim", markup=False)
        elif cmd in ("/help", "/?"):
            out.print(HELP, style="dim")
        else:
            raise BriskError(f"unknown command {cmd}; {HELP}")
    except BriskError as e:
        out.print(f"error: {e.cli_message()}", style="red", markup=False)
    return True
