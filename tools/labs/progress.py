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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Which lab exercises pass.")
    parser.add_argument("paths", nargs="*", type=Path, default=[LABS_DIR])
    args = parser.parse_args(argv)
    rows = [(nb, exercise_status(execute_notebook(nb))) for nb in find_notebooks(args.paths)]
    width = max((len(str(nb)) for nb, _ in rows), default=10)
    most = max((len(s) for _, s in rows), default=0)
    print(f"{'notebook':<{width}}  " + "  ".join(f"ex{k:<10}" for k in range(1, most + 1)))
    for nb, status in rows:
        cells = "  ".join(f"{status.get(k, '-'):<12}" for k in range(1, most + 1))
        print(f"{str(nb):<{width}}  {cells}")


if __name__ == "__main__":
    main()
