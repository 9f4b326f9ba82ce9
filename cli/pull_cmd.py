"""`brisk pull`: download a hub model into the local Hugging Face cache (like `ollama pull`)."""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from . import common as c
from .app import app


@app.command()
def pull(
    name: str = typer.Argument(..., metavar="ORG/NAME[:QUANT]", help="A hub model; :QUANT picks its GGUF file of "
                               "that type (Q4_K_M, q8_0, ...), else its safetensors checkpoint."),
    revision: Optional[str] = typer.Option(None, "--revision", help="A branch, tag or commit (default: main)."),
    as_json: bool = typer.Option(False, "--json", help="Print what was downloaded as one JSON object "
                                 "(repo, revision, files, bytes, path; no progress bar)."),
):
    """Download a model from the Hugging Face hub into its local cache, where `brisk generate NAME`
    and the other commands then find it without a request.

    ORG/NAME takes the checkpoint's config, tokenizer, chat template and *.safetensors files (never
    pickles or other formats); ORG/NAME:Q4_K_M takes the repo's GGUF file of that quant type, all
    parts of a split one. A download cut off (a dropped connection, Ctrl-C) resumes where it
    stopped, at the next pull if need be; every file is checked against the checksum the hub lists
    for it.

    Examples:  brisk pull org/name  ·  brisk pull org/name-GGUF:Q4_K_M  ·  brisk pull org/name --revision v2
    """
    with c.user_errors():
        from ..core.hub import pull as pull_model

        result = pull_model(name, revision, progress=not as_json and sys.stderr.isatty())
    if as_json:
        print(json.dumps(result.to_dict(), indent=1))
        return
    print(f"pulled {name}: {len(result.files)} files, {result.bytes / 2**20:.1f} MiB "
          f"({result.downloaded} downloaded) at {result.revision[:12]}\n{result.path}")
