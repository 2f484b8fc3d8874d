"""The lab machinery (tools/labs/FORMAT.md): generation, sync, structure, and
the lessons' references to real files and symbols."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tools.labs.execute import execute_notebook
from tools.labs.generate import LABS_DIR, SOLUTIONS_DIR, lab_text, make_lab, strip_solutions
from tools.labs.progress import exercise_status, format_table, summary_line

REPO = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted(SOLUTIONS_DIR.glob("day*.ipynb"))
LESSONS = sorted((REPO / "lessons").glob("day*.md"))


def code_cell(source: str, tags=(), outputs=()) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": list(tags)} if tags else {})
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in outputs]
    cell.execution_count = 7 if outputs else None
    return cell


# Generation ------------------------------------------------------------------


def test_regions_become_raises_at_their_indentation():
    source = (
        "def f(x):\n"
        "    y = 1\n"
        "    ### BEGIN SOLUTION\n"
        "    return x + y\n"
        "    ### END SOLUTION\n"
        "\n"
        "### BEGIN SOLUTION\n"
        "z = f(1)\n"
        "### END SOLUTION"
    )
    assert strip_solutions(source, 3, 2) == (
        "def f(x):\n"
        "    y = 1\n"
        '    raise NotImplementedError("Day 3, exercise 2")\n'
        "\n"
        'raise NotImplementedError("Day 3, exercise 2")'
    )


@pytest.mark.parametrize(
    "source, problem",
    [
        ("### BEGIN SOLUTION\nx = 1", "without '### END"),
        ("x = 1\n### END SOLUTION", "without '### BEGIN"),
        ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "nested"),
    ],
)
def test_unbalanced_markers_are_errors(source, problem):
    with pytest.raises(ValueError, match=problem):
        strip_solutions(source, 1, 1)


def test_make_lab_numbers_exercise_cells_and_strips_only_outputs():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Day 2"),
        code_cell("import math", outputs=["hi\n"]),
        code_cell("def a():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                  tags=["exercise"], outputs=["x"]),
        code_cell("check.exercise_1(a)", tags=["checker"], outputs=["Day 2, exercise 1: passed\n"]),
        code_cell("### BEGIN SOLUTION\nb = 2\n### END SOLUTION", tags=["exercise"]),
    ]
    lab = make_lab(nb, 2)
    assert [c.source for c in lab.cells] == [
        "# Day 2",
        "import math",
        'def a():\n    raise NotImplementedError("Day 2, exercise 1")',
        "check.exercise_1(a)",
        'raise NotImplementedError("Day 2, exercise 2")',
    ]
    code = [c for c in lab.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert [c.metadata for c in lab.cells] == [c.metadata for c in nb.cells]
    assert nb.cells[2].outputs  # the solution itself is untouched


def test_a_region_outside_an_exercise_cell_is_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells = [code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION")]
    with pytest.raises(ValueError, match="outside an 'exercise' cell"):
        make_lab(nb, 1)


# The committed notebooks ---------------------------------------------------------


def test_there_is_a_lab_for_every_solution_and_nothing_else():
    assert [p.name for p in SOLUTIONS] == sorted(p.name for p in LABS_DIR.glob("*.ipynb"))


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_lab_is_generated_from_its_solution(solution):
    committed = (LABS_DIR / solution.name).read_text()
    assert committed == lab_text(solution), (
        f"labs/{solution.name} differs from what solutions/{solution.name} generates: "
        "run `python -m tools.labs.generate` (labs are never edited by hand)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_lab_runs_and_every_checker_waits_for_the_learner(solution):
    results = execute_notebook(LABS_DIR / solution.name)
    checkers = [r for r in results if "checker" in r.tags]
    assert checkers, "a lab needs at least one checker"
    for r in results:
        if "checker" in r.tags:
            assert r.error == "NotImplementedError", (
                f"cell {r.index} ({r.source!r}) must fail with NotImplementedError in the lab, "
                f"got {r.error}"
            )
        elif "gpu" not in r.tags:
            assert r.error is None, f"cell {r.index} ({r.source[:60]!r}) raised {r.error}"
    assert set(exercise_status(results).values()) == {"todo"}


# Lessons point at real code --------------------------------------------------------

# `reference_impl/minivllm/core/scheduler.py` or `...py::Scheduler.schedule`
_REFERENCE = re.compile(r"`((?:reference_impl|tools|tests|solutions|labs|lessons)/[\w./-]+)"
                        r"(?:::([\w.]+))?`")


def defined_names(path: Path) -> set[str]:
    """Dotted names of the classes, functions and methods a Python file defines."""
    names: set[str] = set()

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + child.name)
                visit(child, prefix + child.name + ".")
            elif isinstance(child, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))

    visit(ast.parse(path.read_text()), "")
    return names


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_lesson_references_exist(lesson):
    refs = _REFERENCE.findall(lesson.read_text())
    assert refs, f"{lesson.name} points at no code"
    for path, symbol in refs:
        file = REPO / path
        assert file.exists(), f"{lesson.name} mentions {path}, which does not exist"
        if symbol:
            assert symbol in defined_names(file), f"{lesson.name}: {path} defines no {symbol}"


def test_progress_table_aligns_long_statuses_and_names_failures():
    rows = [
        (Path("labs/day1_the_map.ipynb"), {1: "pass", 2: "FAIL (AssertionError)", 3: "todo"}),
        (Path("labs/day13_a_longer_name.ipynb"), {1: "todo", 2: "pass"}),
    ]
    lines = format_table(rows).splitlines()
    # Every column starts at the same place on every line.
    starts = [[m.start() for m in re.finditer(r"(?<=  )\S", line)] for line in lines]
    assert starts[0][:2] == starts[1][:2] == starts[2][:2]
    assert lines[2].split()[-1] == "-"  # day 13 has no third exercise
    assert summary_line(*rows[0]) == (
        "labs/day1_the_map.ipynb: 1 passed, 1 to do, failing: exercise 2"
    )


@pytest.mark.slow
def test_a_failing_checker_is_reported_by_day_and_exercise():
    """nbval heads a failing cell "Cell N"; the root conftest adds which
    exercise that checker is for."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         "--nbval-lax", str(LABS_DIR / "day1_the_map.ipynb")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1
    assert re.search(r"_ labs/day1_the_map\.ipynb::Cell \d+ \(Day 1, exercise 1\) _", result.stdout)
