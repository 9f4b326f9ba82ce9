"""A follower rank that `--tp N` started (core/tensor_parallel.py): loads the same model as rank 0,
its own shard, then runs rank 0's passes until told to stop. Never run by hand."""
from __future__ import annotations

import json
import sys
import warnings


def main() -> None:
    args = json.loads(sys.argv[1])
    from . import tensor_parallel
    from .device import set_cpu_threads
    from .llm import LLM

    tensor_parallel.become_follower()
    warnings.simplefilter("ignore")  # the load's warnings are rank 0's to print, once
    set_cpu_threads(args.pop("threads", None))
    LLM.load(**args)  # on a follower rank this runs rank 0's steps and does not return


if __name__ == "__main__":
    main()
