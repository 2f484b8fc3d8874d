"""The tracer's views and scenarios: every shipped scenario shows what it
claims and validates; show, summary, render, timeline and the notebook
views print and draw what they should (dry runs, no model weights); every
command refuses bad input in one line, and takes long traces a range of
steps at a time."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

import minivllm.tracer.timeline as timeline_module
import minivllm.tracer.trace as trace_module
from minivllm.tracer.cli import main
from minivllm.tracer.notebook import trace_page
from minivllm.tracer.scenario import (
    CLAIMS,
    check_claims,
    load_scenario,
    run_scenario,
    shipped_scenarios,
)
from minivllm.tracer.schema import validate_trace
from minivllm.tracer.show import show
from minivllm.tracer.summary import summary
from minivllm.tracer.timeline import write_timeline
from minivllm.tracer.trace import load_trace

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz's dot is not installed (make setup installs it)"
)
needs_node = pytest.mark.skipif(
    shutil.which("node") is None, reason="Node.js runs the step page's script outside a browser"
)
REPO = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
XLINK_TITLE = "{http://www.w3.org/1999/xlink}title"


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Every shipped scenario, played in a dry run: name -> trace path."""
    out = tmp_path_factory.mktemp("scenarios")
    paths = {}
    for path in shipped_scenarios():
        scenario = load_scenario(path)
        paths[scenario.name] = out / f"{scenario.name}.jsonl"
        run_scenario(scenario, paths[scenario.name], tiny_model_dir("llama"), dry_run=True)
    return paths


def printed(render, *args) -> str:
    console = Console(width=140, record=True, file=io.StringIO())
    render(*args, console=console)
    return console.export_text()


# -- scenarios ----------------------------------------------------------------------


def test_shipped_scenarios_cover_the_classics():
    claims = {c for p in shipped_scenarios() for c in load_scenario(p).shows}
    assert claims == set(CLAIMS)


def test_every_shipped_scenario_validates_and_shows_its_claims(traces):
    for path in shipped_scenarios():
        scenario = load_scenario(path)
        assert scenario.shows and scenario.description
        trace_path = traces[scenario.name]
        assert validate_trace(trace_path) > 0
        trace = load_trace(trace_path)
        for claim, where in check_claims(scenario, trace).items():
            assert where is not None, f"{scenario.name} does not show {claim}"


@pytest.mark.slow
@pytest.mark.parametrize("path", shipped_scenarios(), ids=lambda p: p.stem)
def test_every_shipped_scenario_shows_its_claims_with_the_shipped_model(path, tmp_path):
    """`minivllm-trace run NAME` without --dry-run: the story model's real
    tokens (which end stories by themselves) must not hide what the scenario
    is for; a scenario that depends on growth sets ignore_eos."""
    args = ["run", path.stem, "-o", str(tmp_path / "run.jsonl")]
    assert main(args) == 0, f"{path.stem} does not show its claims with the shipped model"


def test_claims_are_not_shown_where_they_do_not_happen(traces):
    """Each claim fails on a scenario built to show something else."""
    plain = load_trace(traces["token_budget"])  # no preemption, copy, cache or chunk
    for claim in set(CLAIMS) - {"token_budget_split"}:
        assert CLAIMS[claim](plain) is None, claim
    assert CLAIMS["token_budget_split"](load_trace(traces["admission_blocked"])) is None


def test_scenario_specifics(traces):
    swap = load_trace(traces["preempt_swap"])
    (out_step,) = [s for s in swap.steps if s["swap_out"]]
    (in_step,) = [s for s in swap.steps if s["swap_in"]]
    # The 4 blocks that go out are the 4 that come back, and C resumes decoding.
    assert sorted(cpu for _, cpu in out_step["swap_out"]) == sorted(
        cpu for cpu, _ in in_step["swap_in"]
    )
    assert out_step["preempted"] == [{"request_id": "C", "mode": "swap"}]
    assert [e["is_prefill"] for e in in_step["scheduled"] if e["request_id"] == "C"] == [False]
    recompute = load_trace(traces["preempt_recompute"])
    refill = [
        s
        for s in recompute.steps
        if any(e["request_id"] == "C" and e["is_prefill"] for e in s["scheduled"])
    ]
    # C's prompt (40) plus the tokens it had generated are prefilled again:
    # 16 times (vLLM's can_append_slots preempts it at once while A and B
    # hold the cache; see lessons/day3_request_lifecycle.md, section 6).
    assert len(refill) == 17
    assert [s["scheduled"][0]["num_tokens"] for s in refill[1:]] == list(range(50, 66))
    cache = load_trace(traces["prefix_cache"])
    lives = cache.lifecycles()
    assert [lives[r].prefix_cache_hit_tokens for r in "ABCD"] == [0, 64, 64, 0]


# -- show and summary ---------------------------------------------------------------


def test_show_overview_lists_every_step(traces):
    text = printed(show, load_trace(traces["admission_blocked"]), None)
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) == 5
    assert "P A:100" in rows[0] and "3/10" in rows[0]
    assert "finish A (length)" in rows[2] and "10/10" in rows[2]
    assert "P B:50" in rows[3] and "6/10" in rows[3]


def test_show_step_details_queues_batch_blocks_and_changes(traces):
    text = printed(show, load_trace(traces["admission_blocked"]), 3)
    assert "step 3 · 50 tokens" in text
    assert "96-111, 80-95, 64-79, 48-49" in text  # B's slots, hand-worked in test_tracer.py
    assert "0-49" in text
    assert "free blocks: gpu 6/10" in text
    assert "device pool: ···■■■■···" in text  # blocks 3-6 are B's
    assert "seq 1 (B, running, 51 tokens) gpu blocks: 6 5 4 3" in text
    assert "B: waiting → running" in text
    assert "seq 1 gets blocks 6 5 4 3" in text


def test_show_step_marks_shared_blocks_and_copies(traces):
    text = printed(show, load_trace(traces["copy_on_write"]), 1)
    # After A's fork, seq 0 copied shared block 1 into 2; block 0 stays shared.
    assert "copy: 1→2" in text
    assert "device pool: 2■■" in text  # block 0 has ref count 2


def test_summary_per_request_and_totals(traces):
    text = printed(summary, load_trace(traces["admission_blocked"]))
    rows = {
        line.split()[1]: [cell.strip() for cell in line.split("│")[1:-1]]
        for line in text.splitlines()
        if line.startswith(("│ A ", "│ B "))
    }
    a, b = rows["A"], rows["B"]
    # request, prompt, output, arrived, waited, ttft, ttft ms, preempted, cached, finished
    assert a[:6] == ["A", "100", "3", "0", "0", "1"] and a[7:] == ["-", "0", "length @2"]
    assert b[:6] == ["B", "50", "2", "0", "3", "4"] and b[9] == "length @4"
    assert "150 prefill + 3 decode" in text
    assert "peak 70% of 10 blocks" in text  # 7 of 10 blocks after step 0
    assert "2, 2 finished" in text


# -- render, timeline, notebook -----------------------------------------------------


def assert_pool_cells(trace, step: dict, titles: set[str]) -> None:
    """The pool cells' titles (an SVG's or the HTML page's): each block of a
    sequence's table names its owner, on the pool the sequence is in, and
    every device block is drawn, free ones as free."""
    for seq_id, table in step["block_tables"].items():
        device = "cpu" if step["seqs"][seq_id]["status"] == "swapped" else "gpu"
        for block in table:
            owned = f"{device} block {block}: "
            assert any(t.startswith(owned) and f"seq {seq_id}" in t for t in titles)
    gpu_cells = {t.split(":")[0] for t in titles if t.startswith("gpu block ")}
    assert len(gpu_cells) == trace.num_gpu_blocks


@needs_dot
def test_render_svg_names_every_live_sequence_and_block(traces, tmp_path):
    for name, n in (("copy_on_write", 3), ("preempt_swap", 30), ("prefix_cache", 4)):
        trace = load_trace(traces[name])
        step = trace.steps[n]
        out = tmp_path / f"{name}.svg"
        assert main(["render", str(traces[name]), "--step", str(n), "-o", str(out)]) == 0
        root = ET.parse(out).getroot()  # well-formed XML
        assert root.tag == f"{SVG}svg"
        texts = {"".join(t.itertext()) for t in root.iter(f"{SVG}text")}
        titles = {a.get(XLINK_TITLE) for a in root.iter(f"{SVG}a")}
        for seq_id in step["block_tables"]:
            seq = step["seqs"][seq_id]
            assert any(t.startswith(f"seq {seq_id} · {seq['request_id']}") for t in texts)
        assert_pool_cells(trace, step, titles)
    # Shared blocks show their ref counts: block 3 and 4 are B's prompt, shared 3 ways.
    text = (tmp_path / "copy_on_write.svg").read_text()
    assert "3 ×3" in text and "4 ×3" in text


@needs_dot
def test_render_png(traces, tmp_path):
    path = str(traces["admission_blocked"])
    assert main(["render", path, "--step", "0", "-o", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")


def page_data(page: str) -> dict:
    found = re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_html_page_holds_each_block_table_layout_once(traces):
    page = trace_page(load_trace(traces["admission_blocked"]))
    assert 'type="range"' in page and 'max="4"' in page and "<svg" not in page
    data = page_data(page)
    assert [s["n"] for s in data["steps"]] == [0, 1, 2, 3, 4]
    # A holds blocks 0-6 in steps 0 and 1; nothing in 2 and 4; B holds 6 5 4 3 in step 3.
    assert data["layouts"] == [
        [[0, "A", "running", [0, 1, 2, 3, 4, 5, 6]]],
        [],
        [[1, "B", "running", [6, 5, 4, 3]]],
    ]
    assert [s["layout"] for s in data["steps"]] == [0, 0, 1, 2, 1]
    assert data["steps"][3]["lens"] == [[51, 50]] and data["steps"][3]["free"][0] == 6


def test_html_page_grows_by_a_few_hundred_bytes_a_step(traces):
    """A diagram per step made 20,000 steps 2.9 GB: the page now carries a
    step's data, and draws it in the browser."""
    trace = load_trace(traces["preempt_swap"])  # 70 steps, 3 requests
    small, large = (len(trace_page(trace, steps=range(n)).encode()) for n in (5, 70))
    assert (large - small) / 50 < 400


def test_html_page_data_cannot_end_its_script(traces, tmp_path):
    text = traces["admission_blocked"].read_text().replace('"B"', '"<!--<script></script>B"')
    odd = tmp_path / "odd.jsonl"
    odd.write_text(text)
    page = trace_page(load_trace(odd))
    assert page.count("</script>") == 2 and "<!--" not in page  # the page's own elements only
    assert page_data(page)["queues"][0][0] == ["<!--<script></script>B"]


def drawn_steps(page: Path) -> list[str]:
    """Each step of the page as its script draws it, run by Node."""
    harness = """
    const page = require("fs").readFileSync(process.argv[1], "utf8");
    const data = JSON.parse(page.match(/<script id="trace-data"[^>]*>(.*?)<\\/script>/s)[1]);
    const mod = { exports: {} };
    new Function("module", page.match(/<script>\\n(.*?)<\\/script>/s)[1])(mod);
    console.log(JSON.stringify(data.steps.map((_, i) => mod.exports.stepHtml(data, i))));
    """
    done = subprocess.run(["node", "-e", harness, str(page)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_node
def test_html_page_draws_every_block_table_and_pool_cell(traces, tmp_path):
    for name in ("copy_on_write", "preempt_swap"):
        trace = load_trace(traces[name])
        out = tmp_path / f"{name}.html"
        assert main(["render", str(traces[name]), "-o", str(out)]) == 0
        drawn = drawn_steps(out)
        assert len(drawn) == len(trace.steps)
        for step, fragment in zip(trace.steps, drawn, strict=True):
            assert f"step {step['step']}: {step['num_batched_tokens']} tokens" in fragment
            titles = set(re.findall(r'title="([^"]*)"', fragment))
            for seq_id, table in step["block_tables"].items():
                seq = step["seqs"][seq_id]
                assert f"seq {seq_id} · {seq['request_id']} · {seq['status']} · " in fragment
                assert "".join(f"L{i} → {b}</td>" for i, b in enumerate(table)) in re.sub(
                    r"<td[^>]*>", "", fragment
                )
            assert_pool_cells(trace, step, titles)
    # Shared blocks show their ref counts, as in the SVG.
    assert "3 ×3" in drawn_steps(tmp_path / "copy_on_write.html")[3]


def test_render_without_dot_says_how_to_install(traces, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it
    out = tmp_path / "x.svg"
    assert main(["render", str(traces["admission_blocked"]), "--step", "0", "-o", str(out)]) == 1
    assert "apt-get install graphviz" in capsys.readouterr().err
    assert not out.exists()


def test_timeline_json_is_chrome_trace_events(traces, tmp_path):
    out = tmp_path / "timeline.json"
    assert main(["timeline", str(traces["preempt_swap"]), "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert all(e["ph"] in ("X", "i", "M") and "pid" in e and "name" in e for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"request A", "request B", "request C"}
    tid_c = next(e["tid"] for e in events if e.get("args", {}).get("name") == "request C")
    c_states = [e["name"] for e in spans if e["pid"] == 1 and e["tid"] == tid_c]
    assert c_states == ["prefill", "decode", "preempted", "swapped", "decode"]
    instants = [e["name"] for e in events if e["ph"] == "i" and e["tid"] == tid_c]
    assert instants == ["preempted (swap)", "finished (length)"]
    # Spans follow each other without gaps, on the steps' measured time.
    c_spans = [e for e in spans if e["pid"] == 1 and e["tid"] == tid_c]
    for before, after in zip(c_spans, c_spans[1:], strict=False):
        assert after["ts"] == pytest.approx(before["ts"] + before["dur"])
    assert len([e for e in spans if e["pid"] == 0 and e["tid"] == 0]) == 70  # one per step


def test_timeline_png(traces, tmp_path):
    out = write_timeline(load_trace(traces["preempt_recompute"]), tmp_path / "t.png")
    assert out.read_bytes().startswith(b"\x89PNG")


def test_notebook_views(traces):
    trace = load_trace(traces["admission_blocked"])
    html = trace._repr_html_()
    assert html.count("<tr>") == 1 + 5 and "P B:50" in html
    with pytest.raises(IndexError, match="steps 0 to 4"):
        trace.step(5)
    if shutil.which("dot"):
        svg = trace.step(3)._repr_svg_()
        assert "<svg" in svg and "seq 1 · B" in svg


def test_lifecycle_of_a_chunked_prefill(traces):
    lives = load_trace(traces["chunked_prefill"]).lifecycles()
    b = lives["B"]
    # B arrives at step 2; 4 chunks of prefill (63, 63, 63, 11), then decodes.
    assert b.states[:5] == [(n, "prefill") for n in (2, 3, 4, 5)] + [(6, "decode")]
    assert b.first_token_step == 5 and b.steps_waited == 0


# -- the CLI ------------------------------------------------------------------------


def test_cli_run_show_summary_validate(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "140")
    out = tmp_path / "run.jsonl"
    model = tiny_model_dir("llama")
    args = ["run", "admission_blocked", "--dry-run", "--model", model, "-o", str(out)]
    args += ["-e", "num_gpu_blocks_override=20"]
    # With 20 blocks B is not blocked: the run writes its trace, says what it
    # does not show, and fails, since the scenario missed its purpose.
    assert main(args) == 1
    captured = capsys.readouterr()
    # Both prefill in step 0, A ends in step 2.
    assert f"wrote {out}: 3 steps, 2 requests (dry run)" in captured.out
    assert "admission_blocked: NOT SHOWN by this run" in captured.out
    assert "claims admission_blocked, which this run does not show" in captured.err
    assert main(["validate", str(out)]) == 0
    assert main(["show", str(out), "--step", "0"]) == 0
    text = capsys.readouterr().out
    assert "P A:100" not in text and "A: waiting → running" in text
    assert "B: waiting → running" in text  # both admitted at once
    assert main(["summary", str(out)]) == 0
    assert "150 prefill + 3 decode" in capsys.readouterr().out
    assert main(["show", str(out), "--step", "9"]) == 1
    assert "step 9 is not in this trace" in capsys.readouterr().err


def test_cli_run_prompts(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "prompts.jsonl"
    args = ["run", "-p", "Once upon a time", "-p", "The cat", "--max-tokens", "4", "--dry-run"]
    args += ["--model", tiny_model_dir("llama"), "-o", str(out)]
    assert main(args) == 0
    trace = load_trace(out)
    assert [r["prompt"] for r in trace.requests.values()] == ["Once upon a time", "The cat"]
    assert [f["request_id"] for s in trace.steps for f in s["finished"]] == ["0", "1"]


# -- bad input: one line, no traceback ------------------------------------------------

_STEP_LINE = 4  # in the admission trace: header, requests A and B, then steps


def _edit(lines: list[str], number: int, change) -> list[str]:
    line = json.loads(lines[number - 1])
    change(line)
    return lines[: number - 1] + [json.dumps(line) + "\n"] + lines[number:]


def _with_token(lines: list[str], token: str) -> list[str]:
    marked = _edit(lines, _STEP_LINE, lambda s: s["timings"].update(execute_ms=12345.5))
    return [line.replace("12345.5", token) for line in marked]


def _int_ids(lines: list[str]) -> list[str]:
    return [line.replace('"A"', "7") for line in lines]


def bad_traces(good: Path, out: Path) -> list[tuple[Path, str]]:
    """(a file that is not a valid trace, what the error must say)."""
    lines = good.read_text().splitlines(keepends=True)
    contents = {
        "array.jsonl": (lines[:3] + ["[1, 2]\n"] + lines[3:], ":4: the line is an array"),
        "number.jsonl": (lines[:3] + ["3\n"] + lines[3:], ":4: the line is the number 3"),
        "no_scheduled.jsonl": (
            _edit(lines, _STEP_LINE, lambda s: s.pop("scheduled")),
            ":4: step line has no 'scheduled'",
        ),
        "no_timings.jsonl": (
            _edit(lines, _STEP_LINE, lambda s: s.pop("timings")),
            ":4: step line has no 'timings'",
        ),
        "no_request.jsonl": (
            lines[:2] + lines[3:],
            ":3: request ids ['B'] have no request line before this step",
        ),
        "int_ids.jsonl": (_int_ids(lines), ":2: request line: request_id is the number 7"),
        "nan.jsonl": (_with_token(lines, "NaN"), ":4: the line has NaN, which is not JSON"),
        "inf.jsonl": (_with_token(lines, "-Infinity"), ":4: the line has -Infinity"),
        "empty.jsonl": ([], ": not a trace: no header line (the file is empty)"),
        "v2.jsonl": (
            _edit(lines, 1, lambda h: h.update(schema_version=1)),
            ":1: schema_version 1, this tracer reads version 3",
        ),
    }
    cases = []
    for name, (text, message) in contents.items():
        (out / name).write_text("".join(text))
        cases.append((out / name, message))
    (out / "latin1.jsonl").write_bytes(lines[0].encode() + b'{"type": "r\xe9quest"}\n')
    cases.append((out / "latin1.jsonl", ":2: is not UTF-8 text"))
    (out / "a_directory").mkdir()
    cases.append((out / "a_directory", ": is a directory, not a trace file"))
    cases.append((out / "missing.jsonl", ": no such file"))
    return cases


def trace_commands(path: Path, out: Path) -> list[list[str]]:
    """Every command that reads a trace, every way."""
    p = str(path)
    return [
        ["show", p],
        ["show", p, "--step", "0"],
        ["show", p, "--steps", "0:2"],
        ["render", p, "--step", "0", "-o", str(out / "s.svg")],
        ["render", p, "-o", str(out / "steps.html")],
        ["timeline", p, "-o", str(out / "t.png")],
        ["timeline", p, "-o", str(out / "t.json")],
        ["summary", p],
        ["validate", p],
    ]


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"minivllm-trace {command}: error: "), err
    return err


def test_every_command_refuses_a_bad_trace_in_one_line(traces, tmp_path, capsys):
    for path, message in bad_traces(traces["admission_blocked"], tmp_path):
        for args in trace_commands(path, tmp_path):
            assert main(args) == 1, args
            err = one_line_error(capsys, args[0])
            assert f"{path}{message}" in err, (args, err)
            assert not list(tmp_path.glob("s.svg")) and not list(tmp_path.glob("t.*"))


def test_python_m_tools_tracer_refuses_in_one_line(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "minivllm.tracer", "summary", str(tmp_path / "dir.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"minivllm-trace summary: error: {tmp_path / 'dir.jsonl'}: is a directory, not a trace "
        "file\n"
    )


def test_run_refuses_bad_options_and_scenarios_in_one_line(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    broken = tmp_path / "broken.yaml"
    broken.write_text("requests: [\n")
    odd_claim = tmp_path / "odd_claim.yaml"
    odd_claim.write_text("shows: [flying]\nrequests: [{prompt_len: 4}]\n")
    odd_field = tmp_path / "odd_field.yaml"
    odd_field.write_text("requests: [{prompt_len: 4, colour: red}]\n")
    (tmp_path / "out_dir").mkdir()
    out = ["--dry-run", "--model", model, "-o", str(tmp_path / "run.jsonl")]
    cases = [
        (["admission_blocked", *out, "-e", "bogus=1"], "unexpected keyword argument(s) ['bogus']"),
        (["admission_blocked", *out, "-e", "block_size=0"], "block_size must be a power of two"),
        (["admission_blocked", *out, "--max-steps", "2"], "still running after 2 steps"),
        ([str(broken), *out], f"{broken}: not YAML"),
        ([str(odd_claim), *out], "unknown claims ['flying']"),
        ([str(odd_field), *out], "request 0: "),
        (["-p", "hi", "--max-tokens", "0", *out], "request 0: max_tokens must be None or"),
        (["no_such_scenario", *out], "no scenario file 'no_such_scenario'"),
        (["admission_blocked", *out[:-1], str(tmp_path / "out_dir")], "is a directory"),
    ]
    for args, message in cases:
        assert main(["run", *args]) == 1, args
        assert message in one_line_error(capsys, "run"), args


def test_unexpected_errors_keep_their_traceback(traces, monkeypatch):
    """Only the tracer's own errors become one line: a bug still shows where it is."""

    def broken(trace, console=None):
        raise KeyError("a bug")

    monkeypatch.setattr("minivllm.tracer.summary.summary", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["summary", str(traces["admission_blocked"])])


def test_request_ids_print_as_text_not_markup(traces, tmp_path):
    text = traces["admission_blocked"].read_text().replace('"A"', '"[/x]"')
    odd = tmp_path / "odd.jsonl"
    odd.write_text(text)
    trace = load_trace(odd)
    assert "P [/x]:100" in printed(show, trace, None)
    assert "│ [/x] " in printed(summary, trace)


# -- long traces: a range of steps at a time ------------------------------------------


def test_views_of_every_step_refuse_too_many_and_take_a_range(
    traces, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "140")
    monkeypatch.setattr(trace_module, "MAX_STEPS_AT_ONCE", 20)
    path = str(traces["preempt_swap"])  # 70 steps
    page, chrome = tmp_path / "steps.html", tmp_path / "t.json"
    printed_rows = []
    for args in (
        ["show", path],
        ["render", path, "-o", str(page)],
        ["timeline", path, "-o", str(chrome)],
    ):
        assert main(args) == 1
        err = one_line_error(capsys, args[0])
        assert "at most 20 steps at once and this trace has 70: choose them with --steps A:B" in err
        assert main([*args, "--steps", "10:20"]) == 0
        out = capsys.readouterr().out
        printed_rows += [line for line in out.splitlines() if line.startswith("│")]
    assert [int(row.split("│")[1]) for row in printed_rows] == list(range(10, 20))
    assert [s["n"] for s in page_data(page.read_text())["steps"]] == list(range(10, 20))
    events = json.loads(chrome.read_text())["traceEvents"]
    engine_steps = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0]
    assert engine_steps == [f"step {n}" for n in range(10, 20)]
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0
    # Asked for explicitly, every step is drawn.
    assert main(["render", path, "-o", str(page), "--steps", "0:70"]) == 0
    assert len(page_data(page.read_text())["steps"]) == 70


def test_step_ranges_are_checked(traces, capsys):
    path = str(traces["preempt_swap"])
    for spec in ("5", "a:b", "-1:4", "70:", "30:10"):
        assert main(["show", path, f"--steps={spec}"]) == 1, spec
        assert "--steps" in one_line_error(capsys, "show")
    assert main(["show", path, "--steps", "65:"]) == 0  # an open end: to the last step
    assert "steps 65 to 69 of 70" in capsys.readouterr().out


def test_timeline_png_refuses_more_rows_than_an_image_holds(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(timeline_module, "MAX_ROWS", 2)
    out = tmp_path / "t.png"
    assert main(["timeline", str(traces["preempt_swap"]), "-o", str(out)]) == 1
    err = one_line_error(capsys, "timeline")
    assert "has 3 requests, more than the 2 rows" in err and "--steps A:B" in err
    assert not out.exists()


def test_timeline_of_a_range_cuts_each_life_to_it(traces):
    trace = load_trace(traces["preempt_swap"])
    whole = {life.request_id: life for life in timeline_module.lives_in(trace)}
    for life in timeline_module.lives_in(trace, range(10, 20)):
        assert [n for n, _ in life.states] == [
            n for n, _ in whole[life.request_id].states if 10 <= n < 20
        ]
        assert life.finished is None or 10 <= life.finished[0] < 20
