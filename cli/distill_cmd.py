"""`brisk distill`: train Medusa-style draft heads for a model on its own answers (self-distillation)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..core.distill_options import DistillOptions, checked_out
from . import common as c
from .app import app
from .resumable_job import JobProgress, run_resumable_job

_D = DistillOptions()  # the defaults, shown in --help


@app.command()
def distill(
    model: Optional[str] = typer.Argument(None, metavar="[MODEL]",
                                          help="HF folder, hub id, .gguf file (default: embedded SmolLM2)."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder: heads.safetensors + config.json."),
    data: Optional[Path] = typer.Option(None, "--data", help="Prompts the model answers to make its training text: "
                                        ".jsonl with \"prompt\" (or \"text\") or \"messages\" per line, or plain text "
                                        "with prompts separated by blank lines. Default: brisk's built-in set."),
    heads: int = typer.Option(_D.heads, "--heads", help="Heads K: head k guesses the token k+2 ahead.", min=1, max=16),
    steps: int = typer.Option(_D.steps, "--steps", help="Training steps.", min=1),
    samples: int = typer.Option(_D.samples, "--samples", help="Answers generated (a tenth from held-out prompts).",
                                min=2),
    max_tokens: int = typer.Option(_D.max_tokens, "--max-tokens", help="Most tokens per answer.", min=2),
    batch: int = typer.Option(_D.batch, "--batch", help="Positions per training step.", min=1),
    lr: float = typer.Option(_D.lr, "--lr", help="Peak learning rate (warmup, then cosine decay)."),
    vocab: int = typer.Option(_D.vocab, "--vocab", help="Draft vocabulary: the heads choose among the N tokens "
                              "that carry the most of the model's probability on its answers (0: all).", min=0),
    temperature: float = typer.Option(_D.temperature, "--temperature", help="Sampling temperature of the answers."),
    tree_nodes: int = typer.Option(_D.tree_nodes, "--tree-nodes", help="Nodes of the stored candidate tree (the "
                                   "default size used is picked by measurement, at most this).", min=1),
    checkpoint_every: int = typer.Option(_D.checkpoint_every, "--checkpoint-every",
                                         help="Save a resumable checkpoint every N steps.", min=1),
    seed: int = typer.Option(_D.seed, "--seed", help="Seed of the answers and of the batch order."),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="Time target passes and replay greedy "
                                 "decoding on held-out prompts to pick the tree size (a few seconds)."),
    device: str = c.DeviceOpt,
    threads: Optional[int] = c.ThreadsOpt,
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
):
    """Train draft heads for speculative decoding (--draft heads:OUT) on the model's own answers.

    The model answers prompts; its hidden states and next-token distributions on those answers
    train K small heads (the model itself stays frozen). Interrupted (Ctrl-C, crash), the same
    command resumes from the last checkpoint and gives the same heads.
    Examples:  brisk distill -o smol-heads  ·  brisk distill model.gguf -o heads --data prompts.jsonl
    """
    with c.user_errors():
        from ..core.files import regular_file
        from ..core.load_options import check_load_options

        check_load_options(model, device, threads=threads)  # before the stack that loads it is imported
        opts = DistillOptions(heads=heads, steps=steps, samples=samples, max_tokens=max_tokens, batch=batch, lr=lr,
                              vocab=vocab, temperature=temperature, tree_nodes=tree_nodes,
                              checkpoint_every=checkpoint_every, seed=seed, measure=measure,
                              data=str(data) if data else None).checked()
        checked_out(out, force)
        if data is not None:
            regular_file(data)
            from ..core.distill_options import load_prompts

            load_prompts(data)  # a malformed file is refused before torch loads
        from ..core.distill import distill as run_distill
        from ..core.device import set_cpu_threads

        set_cpu_threads(threads)
        progress = _Progress(enabled=not as_json)
        run_resumable_job(lambda: run_distill(model, out, opts, force=force, report=progress, device=device),
                            progress, out, as_json, _print_summary)


class _Progress(JobProgress):
    """The pipeline's events: a bar for generating the answers, one for training."""

    def __init__(self, enabled: bool):
        super().__init__(enabled)
        self.gen = self.train = None
        self.held = ""  # the last held-out evaluation, shown next to the loss

    def show(self, event: str, info: dict) -> None:
        log = self.log
        if event == "prompts":
            log(f"{info['prompts']} prompts ({info['held_out']} held out), {info['samples']} answers to generate")
        elif event == "generate_start":
            if info["done"]:
                log(f"resuming: {info['done']} answers already generated")
            if info["done"] < info["total"]:
                self.start_bar()
                self.gen = self.bar.add_task("generating", total=info["total"], completed=info["done"], note="")
        elif event == "generated":
            self.bar.update(self.gen, completed=info["done"], note=f"{info['tokens']:,} tokens")
        elif event == "data_ready":
            log(f"data: {info['train']:,} training positions, {info['held_out']:,} held out; draft vocabulary "
                f"{info['vocab']:,} tokens ({info['coverage']:.1%} of the model's held-out choices)")
        elif event == "resume":
            log(f"resuming: step {info['step']} of {info['total']} from the last checkpoint")
        elif event == "train_start":
            self.start_bar()
            if info.get("evaluation"):
                self.held = _top1(info["evaluation"])
            self.train = self.bar.add_task("training", total=info["total"], completed=info["done"], note="")
        elif event == "step":
            self.bar.update(self.train, completed=info["step"], note=f"loss {info['loss']:.3f}  {self.held}")
        elif event == "checkpoint":
            self.held = _top1(info["evaluation"])
            self.bar.update(self.train, completed=info["step"], note=f"loss {info['loss']:.3f}  {self.held}")
        elif event == "measure":
            log(f"measuring: {info['what']}")
        elif event == "writing":
            log(f"writing {info['out']}")


def _top1(ev: dict) -> str:
    return "held-out top-1 " + " ".join(f"{a:.0%}" for a in ev["top1"])


def _print_summary(s) -> None:
    console = Console(highlight=False)
    table = Table(title=f"{s.n_heads} draft heads for {s.model}", title_justify="left")
    for col in ("head", "guesses", "held-out top-1", "top-5", "KL"):
        table.add_column(col, justify="right")
    for k, (t1, t5, kl) in enumerate(zip(s.top1, s.top5, s.held_out_kl)):
        table.add_row(str(k), f"token +{k + 2}", f"{t1:.1%}", f"{t5:.1%}", f"{kl:.3f}")
    console.print(table)
    console.print(f"data: {s.samples} answers, {s.train_tokens:,} training / {s.held_out_tokens:,} held-out "
                  f"positions ({s.data_seconds:.0f} s this run); draft vocabulary {s.vocab:,} tokens "
                  f"({s.vocab_coverage:.1%} coverage)")
    console.print(f"training: {s.steps} steps, loss (KL per head) {s.loss:.3f}, {s.train_seconds:.0f} s"
                  + (f" (resumed at step {s.resumed_step})" if s.resumed_step else ""))
    if s.measured_tokens_per_pass:
        sizes = ", ".join(f"{b}: {v:.2f}" for b, v in s.measured_tokens_per_pass.items())
        console.print(f"tokens per target pass by tree size (greedy replay, held-out): {sizes}")
        console.print("target pass ms by tokens: " + ", ".join(f"{t}: {v:g}" for t, v in s.pass_ms.items())
                      + f"; heads {s.draft_ms:g} ms")
        console.print(f"tree: {s.tree_budget} nodes, predicted {s.predicted_speedup:.2f}x plain decoding")
    else:
        console.print(f"tree: {s.tree_budget} nodes (estimated {s.estimated_tokens_per_pass:.2f} tokens per pass)")
    console.print(f"time: {s.seconds:.0f} s   ->  {s.out}   (use: --draft heads:{s.out})")
