"""Run a notebook top to bottom and report, cell by cell, what happened.

Used by the lab structure test and by `tools.labs.progress`. Errors do not
stop the run (a learner's unfinished exercise should not hide the rest).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient


@dataclass
class CellResult:
    index: int
    tags: list[str]
    source: str
    error: str | None  # the exception's class name, if the cell raised
    text: str  # everything the cell printed


def _run(path: Path, timeout: int) -> nbformat.NotebookNode:
    """The notebook at `path`, executed in its own folder, errors kept as outputs."""
    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("TQDM_DISABLE", "1")  # the kernel inherits it
    resources = {"metadata": {"path": str(path.parent)}}
    # record_timing=False: no timestamps in cell metadata, so re-runs change nothing.
    client = NotebookClient(
        nb, timeout=timeout, allow_errors=True, record_timing=False, resources=resources
    )
    client.execute()
    return nb


def execute_notebook(path: Path, timeout: int = 300) -> list[CellResult]:
    nb = _run(path, timeout)
    results = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error = next((o.ename for o in cell.outputs if o.output_type == "error"), None)
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        results.append(
            CellResult(index, cell.metadata.get("tags", []), cell.source, error, text)
        )
    return results


def refresh_solution(path: Path, timeout: int = 300) -> None:
    """Execute a solution notebook in place, storing its outputs; refuse to
    save one in which any cell raised (a solution must run cleanly)."""
    nb = _run(path, timeout)
    failed = [
        (i, o.ename)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "error"
    ]
    if failed:
        raise SystemExit(f"{path}: cells raised {failed}; nothing written")
    nbformat.write(nb, path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Run solution notebooks and store their outputs (then regenerate labs)."
    )
    parser.add_argument("notebooks", nargs="+", type=Path)
    for notebook in parser.parse_args().notebooks:
        refresh_solution(notebook)
        print(f"executed {notebook}")
