"""`python -m benchmarks.results`: validate the figures and regenerate or check the documents."""

from __future__ import annotations

import argparse
import sys

from benchmarks.results.docs import stale, update_docs
from benchmarks.results.figures import ROOT, ResultsError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0].strip("`"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--update-docs",
        action="store_true",
        help="rewrite BENCHMARKS.md's table and the figures quoted in README.md and docs/",
    )
    mode.add_argument("--check", action="store_true", help="exit 1 if a document is stale")
    args = parser.parse_args(argv)
    try:
        results = load()
        if args.update_docs:
            for path in update_docs(results):
                print(f"updated {path.relative_to(ROOT)}")
        elif args.check:
            behind = stale(results)
            for path in behind:
                print(f"stale: {path.relative_to(ROOT)} (run with --update-docs)")
            return 1 if behind else 0
        else:
            print(f"{len(results.figures)} figures, valid")
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
