"""A long job that keeps its work in OUT.partial (`brisk quantize`, `brisk distill`) on the command
line: its progress on stderr, its end on Ctrl-C (how to resume), its summary. The subcommands add
only the events of their own job."""
from __future__ import annotations

import json
import sys

import typer

from .common import err_console


class JobProgress:
    """A job's report(event, **info) callback as rich progress bars on stderr: a spinner while the
    model loads, one Progress (description, bar, n/total, elapsed, eta, a note) started on first
    use, stop(). Subclasses show their own events in `show`."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.enabled, self.started, self.status = enabled, False, None
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                            console=err_console, disable=not enabled)

    def start_bar(self) -> None:
        if not self.started:
            self.bar.start()
            self.started = True

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        if self.started:
            self.bar.stop()
            self.started = False

    def log(self, text: str) -> None:
        """A line above the bars."""
        self.bar.console.print(text)

    def __call__(self, event: str, **info) -> None:
        if not self.enabled:
            return
        if event != "loading" and self.status is not None:
            self.status.stop()
            self.status = None
        if event == "loading":
            if sys.stderr.isatty():
                self.status = err_console.status(f"loading {info['model']}…", spinner="dots")
                self.status.start()
        elif event == "restart":
            self.log(f"starting over: {info['reason']}")
        else:
            self.show(event, info)

    def show(self, event: str, info: dict) -> None:
        raise NotImplementedError


def run_resumable_job(run, progress: JobProgress, out, as_json: bool, print_summary,
                      interrupted: str | None = None) -> None:
    """run() a job that keeps its work in OUT.partial: Ctrl-C ends it with how to resume (exit 130),
    or with the line `interrupted` for a job that starts over; then its summary as one line of JSON
    or as print_summary prints it."""
    try:
        summary = run()
    except KeyboardInterrupt:
        progress.stop()
        print(interrupted or f"interrupted: run the same command again to resume from {out}.partial", file=sys.stderr)
        raise typer.Exit(130)
    finally:
        progress.stop()
    if as_json:
        sys.stdout.write(json.dumps(summary.to_dict()) + "\n")
    else:
        print_summary(summary)
