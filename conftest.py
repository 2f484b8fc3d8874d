"""Repository-wide pytest set-up for the notebooks (format: tools/labs/FORMAT.md).

`make test` runs `solutions/*.ipynb` under nbval (`--nbval` in pyproject's
addopts). Here: the kernel is this environment's Python, outputs are
sanitised with solutions/sanitize.cfg, progress bars are off, stderr (library
warnings) is not compared, and cells tagged `gpu` are skipped without a GPU.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

SANITIZE = Path(__file__).parent / "solutions" / "sanitize.cfg"


def pytest_configure(config):
    opt = config.option
    if getattr(opt, "nbval", False) or getattr(opt, "nbval_lax", False):
        opt.nbval_current_env = True
        if opt.nbval_sanitize_with is None:
            opt.nbval_sanitize_with = str(SANITIZE)
        os.environ["TQDM_DISABLE"] = "1"  # the kernel inherits it


def pytest_collection_modifyitems(config, items):
    checkers_seen: dict[str, int] = {}
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None:  # not a notebook cell
            continue
        _name_checker_cell(item, cell, checkers_seen)
        if "stderr" not in item.parent.skip_compare:
            item.parent.skip_compare += ("stderr",)
        if "gpu" in cell.metadata.get("tags", []) and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))


def _name_checker_cell(item, cell, checkers_seen: dict[str, int]) -> None:
    """Head a checker cell's failure "Cell 10 (Day N, exercise k)":
    the k-th checker cell of dayN_*.ipynb checks exercise k (FORMAT.md)."""
    if "checker" not in cell.metadata.get("tags", []):
        return
    path = Path(str(item.parent.path))
    day = re.match(r"day(\d+)_", path.name)
    if day is None:
        return
    k = checkers_seen[str(path)] = checkers_seen.get(str(path), 0) + 1
    label = f"Day {int(day.group(1))}, exercise {k}"
    where, line, description = item.reportinfo()
    # The heading of a failure's report comes from reportinfo(); the node id
    # keeps nbval's "Cell N", so the run's end lists the exercises by name too.
    item.reportinfo = lambda: (where, line, f"{description} ({label})")
    _EXERCISE_OF[item.nodeid] = f"{label} ({path.name})"


# node id of a checker cell -> "Day N, exercise k (dayN_x.ipynb)"; and those that failed.
_EXERCISE_OF: dict[str, str] = {}
_FAILED_EXERCISES: list[str] = []


def pytest_runtest_logreport(report):
    if report.failed and report.nodeid in _EXERCISE_OF:
        _FAILED_EXERCISES.append(_EXERCISE_OF[report.nodeid])


def pytest_terminal_summary(terminalreporter):
    if _FAILED_EXERCISES:
        terminalreporter.section("exercises whose checker failed")
        for exercise in _FAILED_EXERCISES:
            terminalreporter.line(exercise)
