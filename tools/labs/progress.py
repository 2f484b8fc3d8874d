"""Which exercises pass: run every lab found and read its checker cells.

    python -m tools.labs.progress                 # labs/ of this checkout
    python -m tools.labs.progress learners/       # every notebook below a folder
    python -m tools.labs.progress a.ipynb b.ipynb

An exercise is "pass" when its checker printed "passed", "todo" while it
still raises NotImplementedError, and "FAIL (Error)" otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tools.labs.execute import execute_notebook
from tools.labs.generate import LABS_DIR

_CHECK_LINE = re.compile(r"Day \d+, exercise (\d+): passed")


def exercise_status(results) -> dict[int, str]:
    """Checker cells, numbered in order, -> pass / todo / FAIL (...)."""
    status = {}
    for number, cell in enumerate((c for c in results if "checker" in c.tags), start=1):
        if cell.error is None and _CHECK_LINE.search(cell.text):
            status[number] = "pass"
        elif cell.error == "NotImplementedError":
            status[number] = "todo"
        else:
            status[number] = f"FAIL ({cell.error or 'no passed line'})"
    return status


def find_notebooks(paths: list[Path]) -> list[Path]:
    found = []
    for path in paths:
        if path.is_dir():
            notebooks = sorted(path.rglob("day*.ipynb"))
            found += [p for p in notebooks if ".ipynb_checkpoints" not in p.parts]
        else:
            found.append(path)
    return found


def format_table(rows: list[tuple[Path, dict[int, str]]]) -> str:
    """One row per notebook, one column per exercise, each column as wide as
    its longest status (a failure names its error)."""
    most = max((len(status) for _, status in rows), default=0)
    header = ["notebook"] + [f"ex{k}" for k in range(1, most + 1)]
    table = [header] + [
        [str(nb)] + [status.get(k, "-") for k in range(1, most + 1)] for nb, status in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    )


def summary_line(nb: Path, status: dict[int, str]) -> str:
    """What a finished notebook shows while the others still run."""
    counts = {kind: sum(s.startswith(kind) for s in status.values()) for kind in ("pass", "todo")}
    failed = [k for k, s in status.items() if s.startswith("FAIL")]
    text = f"{nb}: {counts['pass']} passed, {counts['todo']} to do"
    if failed:
        text += ", failing: " + ", ".join(f"exercise {k}" for k in failed)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Which lab exercises pass.")
    parser.add_argument("paths", nargs="*", type=Path, default=[LABS_DIR])
    args = parser.parse_args(argv)
    notebooks = find_notebooks(args.paths)
    rows = []
    for i, nb in enumerate(notebooks, start=1):
        # A notebook runs for tens of seconds: say which, then how it went.
        print(f"[{i}/{len(notebooks)}] running {nb} ...", file=sys.stderr, flush=True)
        rows.append((nb, exercise_status(execute_notebook(nb))))
        print(f"[{i}/{len(notebooks)}] {summary_line(*rows[-1])}", file=sys.stderr, flush=True)
    print(format_table(rows))


if __name__ == "__main__":
    main()
