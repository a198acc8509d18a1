#!/usr/bin/env python3
"""Clear outputs and execution counts of notebooks, so git holds only their source.

    python3 scripts/strip_notebooks.py            # strip notebooks/*.ipynb in place
    python3 scripts/strip_notebooks.py --check    # exit 1 and list the ones that hold outputs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def has_outputs(nb) -> bool:
    return any(c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None)
               for c in nb.cells)


def strip(nb) -> None:
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = []
            c.execution_count = None
        c.get("metadata", {}).pop("execution", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    ap.add_argument("--check", action="store_true", help="only report notebooks with outputs")
    args = ap.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    dirty = []
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        if has_outputs(nb):
            dirty.append(p)
            if not args.check:
                strip(nb)
                nbformat.write(nb, p)
    for p in dirty:
        print(f"{'has outputs' if args.check else 'stripped'}: {p}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
