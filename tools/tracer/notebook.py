"""Traces in Jupyter and in a browser, without widgets.

In a notebook, a `Trace` displays as a table of its steps and
`trace.step(n)` as that step's block diagram. `trace_page` is one HTML page
holding every step's diagram with a slider (`minivllm-trace render TRACE -o
steps.html`): plain HTML and a few lines of script, nothing to install.
"""

from __future__ import annotations

import html

from tools.tracer.render import step_graph
from tools.tracer.show import batch_summary, events
from tools.tracer.trace import Trace


def trace_html(trace: Trace) -> str:
    """A table of the steps: batch, queue lengths, free blocks, events."""
    cache = trace.header["cache_config"]
    rows = []
    for step in trace.steps:
        q = step["queues_after"]
        cells = [
            step["step"],
            batch_summary(step),
            step["num_batched_tokens"],
            f"{len(q['waiting'])} / {len(q['running'])} / {len(q['swapped'])}",
            f"{step['free_blocks']['gpu']}/{cache['num_gpu_blocks']}",
            "; ".join(events(step)),
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("step", "batch", "tokens", "waiting / running / swapped", "free gpu", "events")
    )
    note = (
        f"<p>{html.escape(trace.header['model'])}: {len(trace.requests)} requests, "
        f"{len(trace.steps)} steps. <code>trace.step(n)</code> draws step n.</p>"
    )
    return f"{note}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body {{ font-family: sans-serif; }} .step {{ display: none; }}</style></head>
<body>
<h2>{title}</h2>
<p><input id="slider" type="range" min="0" max="{last}" value="0" style="width: 60%">
step <span id="label">0</span> of {last}
(arrow keys move one step)</p>
{steps}
<script>
const slider = document.getElementById("slider");
function show(n) {{
  document.querySelectorAll(".step").forEach(
    (div) => div.style.display = div.dataset.step == n ? "block" : "none");
  document.getElementById("label").textContent = n;
}}
slider.addEventListener("input", () => show(slider.value));
show(0);
</script>
</body></html>
"""


def trace_page(trace: Trace, title: str = "minivllm trace") -> str:
    """Every step's diagram on one page, one at a time under a slider."""
    steps = []
    for step in trace.steps:
        n = step["step"]
        svg = step_graph(trace, n).pipe(format="svg").decode()
        # The SVG's own XML prologue is not allowed inside HTML.
        svg = svg[svg.index("<svg") :]
        summary = html.escape(f"{batch_summary(step)}; " + "; ".join(events(step)))
        steps.append(f'<div class="step" data-step="{n}"><p>{summary}</p>{svg}</div>')
    return _PAGE.format(title=html.escape(title), last=len(trace.steps) - 1, steps="\n".join(steps))
