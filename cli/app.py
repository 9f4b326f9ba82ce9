"""The typer application that every command module registers on; cli/main.py puts it together
(importing the command modules) and runs it. Kept apart so no module imports main back."""
from __future__ import annotations

import typer


def _no_type_for_flags() -> None:
    """typer (0.29) shows flags as taking a value (`--json <bool>`, `--help <bool>`): show no type for
    an option that is a flag, as click does."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is not None:  # older typer releases show no type there at all
        TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else shown(self, ctx)


_no_type_for_flags()

app = typer.Typer(
    name="brisk",
    help="Run and quantize language models locally, fast.\n\n"
         "MODEL is a Hugging Face folder, a hub id (org/name[@revision], or org/name:QUANT for its GGUF "
         "of that type), a .gguf file, or omitted for the embedded default (SmolLM2-135M-Instruct).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        from importlib.metadata import version

        typer.echo(f"brisk {version('brisk')}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Show the version and exit.")):
    pass
