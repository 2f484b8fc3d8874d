"""Generate `labs/` from `solutions/` (the format: tools/labs/FORMAT.md).

    python -m tools.labs.generate            # rewrite every lab
    python -m tools.labs.generate --check    # exit 1 if a lab is out of date

Each solution region of an `exercise` cell becomes
`raise NotImplementedError("Day N, exercise k")`; outputs and execution
counts go; nothing else changes.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
SOLUTIONS_DIR = REPO / "solutions"
LABS_DIR = REPO / "labs"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXERCISE_TAG = "exercise"
_DAY = re.compile(r"day(\d+)_")


def day_of(path: Path) -> int:
    match = _DAY.match(path.name)
    if match is None:
        raise ValueError(f"notebook names start with 'dayN_', got {path.name!r}")
    return int(match.group(1))


def strip_solutions(source: str, day: int, exercise: int) -> str:
    """Replace every BEGIN..END region of one cell by a raise at its indentation."""
    out: list[str] = []
    in_region = False
    for line in source.split("\n"):
        stripped = line.strip()
        if stripped == BEGIN:
            if in_region:
                raise ValueError(f"Day {day}, exercise {exercise}: nested {BEGIN!r}")
            in_region = True
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("Day {day}, exercise {exercise}")')
        elif stripped == END:
            if not in_region:
                raise ValueError(f"Day {day}, exercise {exercise}: {END!r} without {BEGIN!r}")
            in_region = False
        elif not in_region:
            out.append(line)
    if in_region:
        raise ValueError(f"Day {day}, exercise {exercise}: {BEGIN!r} without {END!r}")
    return "\n".join(out)


def make_lab(solution: nbformat.NotebookNode, day: int) -> nbformat.NotebookNode:
    lab = copy.deepcopy(solution)
    exercise = 0
    for cell in lab.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)  # the solution run's timestamps
        if EXERCISE_TAG in cell.metadata.get("tags", []):
            exercise += 1
            cell.source = strip_solutions(cell.source, day, exercise)
        elif BEGIN in cell.source:
            raise ValueError(f"Day {day}: a solution region outside an 'exercise' cell")
    return lab


def lab_text(solution_path: Path) -> str:
    """The lab generated from one solution notebook, as it is written to disk."""
    solution = nbformat.read(solution_path, as_version=4)
    return nbformat.writes(make_lab(solution, day_of(solution_path))) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate labs/ from solutions/.")
    parser.add_argument("--check", action="store_true", help="only report stale labs")
    args = parser.parse_args(argv)
    stale = []
    for solution_path in sorted(SOLUTIONS_DIR.glob("day*.ipynb")):
        lab_path = LABS_DIR / solution_path.name
        text = lab_text(solution_path)
        if lab_path.exists() and lab_path.read_text() == text:
            continue
        stale.append(lab_path)
        if not args.check:
            lab_path.write_text(text)
            print(f"wrote {lab_path.relative_to(REPO)}")
    if args.check and stale:
        print("stale labs:", ", ".join(str(p.relative_to(REPO)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
