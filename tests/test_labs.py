"""The lab machinery (tools/labs/FORMAT.md): generation, sync, structure, and
the lessons' references to real files and symbols."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import subprocess
import sys
from pathlib import Path

import httpx
import nbformat
import pytest
import torch

from tools.labs.execute import CellResult, execute_notebook
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
    nb.cells[3].metadata["execution"] = {"shell.execute_reply": "2026-11-25T18:56:25Z"}
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
    # Tags stay; the solution run's timestamps do not.
    assert lab.cells[3].metadata == {"tags": ["checker"]}
    kept = [{k: v for k, v in c.metadata.items() if k != "execution"} for c in nb.cells]
    assert [c.metadata for c in lab.cells] == kept
    assert nb.cells[2].outputs and "execution" in nb.cells[3].metadata  # solution untouched


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
    summary = result.stdout.split("exercises whose checker failed")[1]
    assert summary.splitlines()[1] == "Day 1, exercise 1 (day1_the_map.ipynb)"


# Crashes in the learner's component become hints ------------------------------------


def test_a_crash_in_the_learners_code_names_their_line():
    from tools.labs.checks._engine_runs import learner_code

    def allocate_twice(table):
        return [table[key] for key in ["missing"]]

    with pytest.raises(AssertionError) as caught:
        with learner_code("MyBlockManager", lambda e: f"likely: {type(e).__name__}"):
            allocate_twice({})
    assert str(caught.value) == (
        "MyBlockManager raised KeyError: 'missing', in your `allocate_twice`, "
        "at the line `return [table[key] for key in [\"missing\"]]`.\nHint: likely: KeyError"
    )


def _progress_status(checker_call) -> str:
    """What tools.labs.progress reports for a checker cell running this call."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            checker_call()
        error = None
    except Exception as caught:  # noqa: BLE001 - a cell's error, by its class name
        error = type(caught).__name__
    return exercise_status([CellResult(0, ["checker"], "", error, out.getvalue())])[1]


def _penalties(logits, prompt_token_ids, output_token_ids, presence, frequency, repetition,
               *, unfinished=False):
    """Day 9's apply_penalties, or the lab's placeholder while unfinished. Its
    bug: torch.tensor of an empty list of ids is float32, which torch.bincount
    refuses with NotImplementedError."""
    if unfinished:
        raise NotImplementedError("Day 9, exercise 1")
    counts = torch.stack([torch.bincount(torch.tensor(ids), minlength=logits.shape[1])
                          for ids in output_token_ids])
    return logits - frequency.unsqueeze(-1) * counts


def test_an_unfinished_exercise_is_todo_and_a_pytorch_not_implemented_error_fails():
    """Only the lab's own placeholder passes through learner_code as
    NotImplementedError ("todo"); PyTorch's, for an operator at a dtype it
    has no kernel for, is the learner's bug, reported with a hint."""
    from tools.labs.checks import day9

    assert _progress_status(
        lambda: day9.exercise_1(functools.partial(_penalties, unfinished=True))) == "todo"
    assert _progress_status(lambda: day9.exercise_1(_penalties)) == "FAIL (AssertionError)"
    with pytest.raises(AssertionError) as caught:
        day9.exercise_1(_penalties)
    message = str(caught.value)
    assert message.startswith("your apply_penalties raised NotImplementedError: "
                              "\"bincount_cpu\" not implemented for 'Float', in your `_penalties`")
    assert "build token ids with dtype=torch.long" in message


def test_a_crash_in_the_engine_says_it_is_not_in_the_learners_code():
    """The engine tripping over what the learner's code left behind is
    reported at the engine's line, without claiming a line of theirs."""
    from minivllm.core.block_allocator import BlockAllocator, Device
    from tools.labs.checks._engine_runs import where_it_failed

    allocator = BlockAllocator(Device.GPU, block_size=16, num_blocks=2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match="Double free") as caught:
        allocator.free(block)
    # In a checker the frame that calls the engine is the checker's own, not
    # the learner's: drop this test's frame to see the traceback a checker sees.
    error = caught.value.with_traceback(caught.value.__traceback__.tb_next)
    assert re.fullmatch(
        r"not in your code but in the engine's `free` \(minivllm/core/block_allocator\.py, "
        r"line \d+\), which tripped over something your code returned or left behind",
        where_it_failed(error),
    )


# Day 13: every listed mistake is rejected with its teaching message ----------------
#
# Each mistake is injected into the solution's code and the checker must refuse it
# with the message that names it; the solution and a differently written correct
# answer must pass. Exercises 1 and 3 read a real server (tools/labs/server.py).

import asyncio  # noqa: E402
import json  # noqa: E402

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.engine.async_llm_engine import RequestTracker  # noqa: E402


def _sse_solution(lines, *, keep_prefix=False, no_stop=False, decode_done=False,
                  drop_empty=False, concat=False):
    choices = {}
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line if keep_prefix else line[len("data: "):]
        if payload == "[DONE]" and not decode_done:
            if no_stop:
                continue
            break
        for choice in json.loads(payload)["choices"]:
            if drop_empty and not choice["text"]:
                continue
            index = 0 if concat else choice["index"]
            deltas, reason = choices.get(index, ([], None))
            deltas.append(choice["text"])
            choices[index] = (deltas, choice["finish_reason"] or reason)
    return choices


def _sse_alternative(lines):
    """Correct, written otherwise: stop at [DONE], group by index afterwards."""
    events = []
    for line in filter(None, lines):
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        events += json.loads(data)["choices"]
    out = {}
    for i in sorted({e["index"] for e in events}):
        mine = [e for e in events if e["index"] == i]
        reasons = [e["finish_reason"] for e in mine if e["finish_reason"]]
        out[i] = ([e["text"] for e in mine], reasons[-1] if reasons else None)
    return out


def _tracker(*, no_finish=False, pop_before_put=False, pop_always=False, never_pop=False,
             abort_not_queued=False, abort_leaks_stream=False, strict_lookup=False,
             ignore_queue=False, queued_no_finish=False, queued_no_pop=False,
             queued_strict_pop=False):
    class Tracker(RequestTracker):
        def process_request_output(self, request_output):
            rid = request_output.request_id
            finished = request_output.finished
            if strict_lookup:
                stream = self._request_streams[rid]
                stream.put(request_output)
                if finished:
                    del self._request_streams[rid]
                    stream.finish()
                return
            if pop_before_put and finished:
                stream = self._request_streams.pop(rid, None)
                if stream is not None:
                    stream.finish()
                return
            if (finished and not never_pop) or pop_always:
                stream = self._request_streams.pop(rid, None)
            else:
                stream = self._request_streams.get(rid)
            if stream is not None:
                stream.put(request_output)
                if finished and not no_finish:
                    stream.finish()

        def abort_request(self, request_id, exception=None):
            if queued_no_pop and request_id in self._new_requests:
                self._new_requests[request_id][0].finish(exception or asyncio.CancelledError())
                return
            if queued_strict_pop:
                queued = self._new_requests.pop(request_id)
            else:
                queued = None if ignore_queue else self._new_requests.pop(request_id, None)
            if queued is not None:
                if not queued_no_finish:
                    queued[0].finish(exception or asyncio.CancelledError())
                return
            if not abort_not_queued:
                self._aborted_requests.add(request_id)
            if abort_leaks_stream:
                return
            stream = self._request_streams.pop(request_id, None)
            if stream is not None:
                stream.finish(exception or asyncio.CancelledError())

    return Tracker


class _AlternativeTracker(RequestTracker):
    """Correct, written otherwise: look up first, pop with del; the engine's
    stream first, then the queue."""

    def process_request_output(self, request_output):
        rid = request_output.request_id
        if rid not in self._request_streams:
            return
        stream = self._request_streams[rid]
        stream.put(request_output)
        if request_output.finished:
            del self._request_streams[rid]
            stream.finish()

    def abort_request(self, request_id, exception=None):
        stream = self._request_streams.pop(request_id, None)
        if stream is None and request_id in self._new_requests:
            stream, _ = self._new_requests.pop(request_id)  # the engine never saw it
        else:
            self._aborted_requests.add(request_id)
        if stream is not None:
            stream.finish(exception or asyncio.CancelledError())


def _ttft(text, *, which="time_to_first_token", sum_only=False, bucket=False):
    for family in text_string_to_metric_families(text):
        if family.name == f"vllm:{which}_seconds":
            values = {s.name: s.value for s in family.samples if s.name != family.name + "_bucket"}
            if bucket:
                return max(s.value for s in family.samples if s.name.endswith("_bucket"))
            total = values[family.name + "_sum"]
            return total if sum_only else total / values[family.name + "_count"]


def _ttft_alternative(text):
    """Correct, written otherwise: by hand, line by line."""
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for part in ("sum", "count"):
            if name.startswith(f"vllm:time_to_first_token_seconds_{part}{{"):
                found[part] = float(value)
    return found["sum"] / found["count"]


@pytest.fixture(scope="module")
def lab_server():
    from tools.labs.server import LabServer

    with LabServer() as server:
        yield server
    assert not server.running


@pytest.fixture
def day13():
    from tools.labs.checks import day13

    return day13


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("keep_prefix", "strip it before json.loads"),
    ("decode_done", "`data: [DONE]` is not JSON"),
    ("no_stop", "`data: [DONE]` ends the stream"),
    ("drop_empty", "its finish_reason is not"),
    ("concat", "keep one list and one finish_reason per index"),
])
def test_day13_exercise_1_rejects(day13, lab_server, mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day13.exercise_1(lambda lines: _sse_solution(lines, **{mistake: True}),
                         lab_server.base_url)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_sse_solution, _sse_alternative])
def test_day13_exercise_1_passes(day13, lab_server, answer, capsys):
    day13.exercise_1(answer, lab_server.base_url)
    assert capsys.readouterr().out == "Day 13, exercise 1: passed\n"


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("no_finish", "call `stream.finish()` after putting a finished output"),
    ("pop_before_put", "put the last output into the stream before finishing it"),
    ("pop_always", "pop it only when the output is finished"),
    ("never_pop", "must leave `_request_streams`"),
    ("abort_not_queued", "never reached `LLMEngine.abort_request`"),
    ("abort_leaks_stream", "`abort_request` must finish the stream"),
    ("strict_lookup", "use `.get` or `.pop(request_id, None)` and skip the output"),
    # A request aborted while still in `_new_requests` (the lab's answer before the queue
    # became a dict): ignored, popped but never finished, finished but left queued.
    ("ignore_queue", "yet the loop handed it to `LLMEngine.add_request` a step later"),
    ("queued_no_pop", "did get asyncio.CancelledError, but the request stayed in "
                      "`self._new_requests`"),
    ("queued_no_finish", "must be finished too"),
    ("queued_strict_pop", "a client's abort failed inside your code: KeyError"),
])
def test_day13_exercise_2_rejects(day13, monkeypatch, mistake, message):
    monkeypatch.setattr(day13, "STALL_S", 8.0)
    with pytest.raises(AssertionError, match=re.escape(message)):
        day13.exercise_2(_tracker(**{mistake: True}))


@pytest.mark.slow
def test_day13_exercise_2_behind_the_server_sees_a_hang_up_that_is_never_aborted(day13):
    """The checker's last stage, the tracker behind the real server, on its
    own: a client that hangs up must become an engine abort."""
    with pytest.raises(AssertionError, match=re.escape("a client hung up mid-stream")):
        day13._check_through_the_server(_tracker(abort_not_queued=True))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_tracker(), _AlternativeTracker], ids=["solution", "other"])
def test_day13_exercise_2_passes(day13, answer, capsys):
    day13.exercise_2(answer)
    assert capsys.readouterr().out == "Day 13, exercise 2: passed\n"


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, message", [
    ({"sum_only": True}, "That is the _sum alone"),
    ({"which": "e2e_request_latency"}, "end-to-end latency's mean"),
    ({"which": "time_per_output_token"}, "time per output token's mean"),
    ({"bucket": True}, "are cumulative counts, not times"),
])
def test_day13_exercise_3_rejects(day13, lab_server, kwargs, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day13.exercise_3(lambda text: _ttft(text, **kwargs), lab_server.base_url)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_ttft, _ttft_alternative])
def test_day13_exercise_3_passes(day13, lab_server, answer, capsys):
    httpx.post(lab_server.url("v1/completions"), timeout=120,
               json={"model": "minivllm-stories", "prompt": "Hi", "max_tokens": 3})
    day13.exercise_3(answer, lab_server.base_url)
    assert capsys.readouterr().out == "Day 13, exercise 3: passed\n"
