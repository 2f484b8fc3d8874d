"""Traces in Jupyter and in a browser, without widgets.

In a notebook, a `Trace` displays as a table of its steps and
`trace.step(n)` as that step's block diagram. `trace_page` is one HTML page
of steps under a slider (`minivllm-trace render TRACE -o steps.html`): plain
HTML and a script (page.js), nothing to install.

The page does not hold a diagram per step: Graphviz took about 20 ms and
60 KB of SVG a step, so 20,000 steps took minutes, gigabytes of memory and
over a gigabyte of HTML. It holds each distinct block-table layout and
queue state once, and per step only what changes every step (a few hundred
bytes), and the script draws the step under the slider from that: the
queues, each sequence's block table, the pools. For a diagram with arrows,
`render --step N -o stepN.svg`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from minivllm.tracer.errors import TracerError
from minivllm.tracer.facts import batch_summary, events
from minivllm.tracer.style import MAX_POOL_CELLS, POOL_COLUMNS, SEQ_COLORS
from minivllm.tracer.trace import MAX_STEPS_AT_ONCE, Trace

_SCRIPT = Path(__file__).with_name("page.js")


def trace_html(trace: Trace) -> str:
    """A table of the steps (the first MAX_STEPS_AT_ONCE of a longer trace):
    batch, queue lengths, free blocks, events. (A V1 trace has two queues.)"""
    queues = ("waiting", "running") if trace.is_v1 else ("waiting", "running", "swapped")
    rows = []
    for step in trace.steps[:MAX_STEPS_AT_ONCE]:
        q = step["queues_after"]
        cells = [
            step["step"],
            batch_summary(step),
            step["num_batched_tokens"],
            " / ".join(str(len(q[name])) for name in queues),
            f"{step['free_blocks']['gpu']}/{trace.usable_gpu_blocks}",
            "; ".join(events(step)),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("step", "batch", "tokens", " / ".join(queues), "free gpu", "events")
    )
    if trace.is_v1:
        how = "a V1 trace: <code>minivllm-trace show TRACE --step N</code> shows step N."
    else:
        how = "<code>trace.step(n)</code> draws step n."
    note = (
        f"<p>{html.escape(trace.header['model'])}: {len(trace.requests)} requests, "
        f"{len(trace.steps)} steps; {how}</p>"
    )
    if len(trace.steps) > MAX_STEPS_AT_ONCE:
        note += f"<p>The first {MAX_STEPS_AT_ONCE} steps; <code>trace.steps[n]</code> has all.</p>"
    return f"{note}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }}
caption {{ text-align: left; font-weight: bold; }}
td {{ border: 1px solid #888; padding: 2px 5px; font-size: 13px; }}
table.seq {{ display: inline-table; margin-right: 1em; }}
td.lit {{ outline: 3px solid black; }}
</style></head>
<body>
<h2>{title}</h2>
<p><input id="slider" type="range" min="0" max="{last}" value="0" style="width: 60%">
step <span id="label"></span> ({what}; arrow keys move one step, hovering a sequence
outlines its blocks)</p>
<div id="view"></div>
<script id="trace-data" type="application/json">{data}</script>
<script>
{script}
</script>
</body></html>
"""


def _intern(value: Any, values: list[Any], index: dict[str, int]) -> int:
    """The position of `value` in `values`, added the first time it is seen."""
    key = json.dumps(value)
    if key not in index:
        index[key] = len(values)
        values.append(value)
    return index[key]


def page_data(trace: Trace, steps: range) -> dict[str, Any]:
    """What the page draws (fields: page.js), each repeated state once."""
    cache = trace.header["cache_config"]
    layouts: list[Any] = []
    queues: list[Any] = []
    seen_layouts: dict[str, int] = {}
    seen_queues: dict[str, int] = {}
    rows = []
    for n in steps:
        step = trace.steps[n]
        seqs, tables = step["seqs"], step["block_tables"]
        layout = [
            [int(s), seqs[s]["request_id"], seqs[s]["status"], table] for s, table in tables.items()
        ]
        after = [step["queues_after"][q] for q in ("waiting", "running", "swapped")]
        rows.append(
            {
                "n": n,
                "layout": _intern(layout, layouts, seen_layouts),
                "queues": _intern(after, queues, seen_queues),
                "lens": [[seqs[s]["num_tokens"], seqs[s]["num_computed_tokens"]] for s in tables],
                "tokens": step["num_batched_tokens"],
                "free": [step["free_blocks"]["gpu"], step["free_blocks"]["cpu"]],
                "about": "; ".join([batch_summary(step), *events(step)]),
            }
        )
    return {
        "gpu_blocks": cache["num_gpu_blocks"],
        "cpu_blocks": cache["num_cpu_blocks"],
        "block_size": cache["block_size"],
        "columns": POOL_COLUMNS,
        "max_pool_cells": MAX_POOL_CELLS,
        "colors": SEQ_COLORS,
        "layouts": layouts,
        "queues": queues,
        "steps": rows,
    }


def trace_page(trace: Trace, title: str = "minivllm trace", steps: range | None = None) -> str:
    """The steps (all, or those in `steps`) on one page, one at a time under
    a slider. The page draws the classic engine's steps; a V1 trace is refused."""
    if trace.is_v1:
        raise TracerError(
            "render -o FILE.html draws the classic engine's steps (sequences, the CPU swap "
            "pool); this is a V1 trace: see its steps with minivllm-trace show TRACE"
        )
    steps = range(len(trace.steps)) if steps is None else steps
    # "</script>" or "<!--" in a request id would end or upset the script
    # element: JSON may write every "<" as "\u003c", which HTML leaves alone.
    data = json.dumps(page_data(trace, steps), separators=(",", ":")).replace("<", "\\u003c")
    if len(steps) == len(trace.steps):
        what = f"{len(steps)} steps"
    else:
        what = f"steps {steps.start} to {steps.stop - 1} of {len(trace.steps)}"
    return _PAGE.format(
        title=html.escape(title),
        last=max(len(steps) - 1, 0),
        what=what,
        data=data,
        script=_SCRIPT.read_text(encoding="utf-8"),
    )
