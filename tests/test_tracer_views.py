"""The tracer's views and scenarios: every shipped scenario shows what it
claims and validates; show, summary, render, timeline and the notebook
views print and draw what they should (dry runs, no model weights)."""

from __future__ import annotations

import io
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from tools.tracer.cli import main
from tools.tracer.notebook import trace_page
from tools.tracer.scenario import (
    CLAIMS,
    check_claims,
    load_scenario,
    run_scenario,
    shipped_scenarios,
)
from tools.tracer.schema import validate_trace
from tools.tracer.show import show
from tools.tracer.summary import summary
from tools.tracer.timeline import write_timeline
from tools.tracer.trace import load_trace

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz's dot is not installed (make setup installs it)"
)
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
    # C's prompt (40) plus the tokens it had generated are prefilled again.
    assert len(refill) == 2 and refill[1]["scheduled"][0]["num_tokens"] > 40
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
        for seq_id, table in step["block_tables"].items():
            seq = step["seqs"][seq_id]
            assert any(t.startswith(f"seq {seq_id} · {seq['request_id']}") for t in texts)
            device = "cpu" if seq["status"] == "swapped" else "gpu"
            for block in table:
                owned = f"{device} block {block}: "
                assert any(t.startswith(owned) and f"seq {seq_id}" in t for t in titles)
        # Every device block is drawn, free ones as free.
        gpu_cells = {t.split(":")[0] for t in titles if t.startswith("gpu block ")}
        assert len(gpu_cells) == trace.num_gpu_blocks
    # Shared blocks show their ref counts: block 3 and 4 are B's prompt, shared 3 ways.
    text = (tmp_path / "copy_on_write.svg").read_text()
    assert "3 ×3" in text and "4 ×3" in text


@needs_dot
def test_render_png_and_html_page(traces, tmp_path):
    path = str(traces["admission_blocked"])
    assert main(["render", path, "--step", "0", "-o", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    page = trace_page(load_trace(path))
    assert page.count('<div class="step"') == 5 and page.count("<svg") == 5
    assert 'type="range"' in page and 'max="4"' in page


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
    assert len([e for e in spans if e["pid"] == 0 and e["tid"] == 0]) == 55  # one per step


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
    assert main(args) == 0
    text = capsys.readouterr().out
    # With 20 blocks B is not blocked: both prefill in step 0, A ends in step 2.
    assert f"wrote {out}: 3 steps, 2 requests (dry run)" in text
    assert "admission_blocked: NOT SHOWN by this run" in text
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
