"""Fuzz brisk's model loading: `python scripts/fuzz.py -n 2000 --seed 1`, `--replay SEED:INDEX`.
See tests/fuzz/harness.py."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=2000, help="cases to run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds before a case counts as a hang")
    ap.add_argument("--replay", metavar="SEED:INDEX", help="run one case again, with its traceback and the CLI's output")
    ap.add_argument("--cli-checks", type=int, default=10, help="cases also run through the real CLI")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every case")
    a = ap.parse_args()
    from tests.fuzz import harness

    if a.replay:
        harness.replay(a.replay, a.timeout)
        return 0
    results = harness.run(a.seed, a.n, a.start, a.timeout, verbose=a.verbose, cli_checks=a.cli_checks)
    bad = [r for r in results if r.category not in ("ok", "clean") or getattr(r, "cli_ok", True) is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
