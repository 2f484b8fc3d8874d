"""`minivllm-trace timeline`: every request's life, step by step.

As a PNG (matplotlib): one row per request, one cell per step, coloured by
what the request did in it: waiting, prefill, decode, in the running queue
but not the batch, swapped, preempted in this step, or dropped (aborted or
ignored without running); a bar marks where it finished. As JSON (Chrome
trace events, for Perfetto or chrome://tracing): the same spans on a real
time axis, the steps' measured durations, plus an "engine" track with each
step's schedule, execute and process phases.
"""

from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path
from typing import Any

from tools.tracer.style import STATE_COLORS
from tools.tracer.trace import (
    DECODE,
    FINISHED,
    IDLE,
    PREEMPTED,
    PREFILL,
    SWAPPED,
    WAITING,
    Lifecycle,
    Trace,
)

_LEGEND = {
    WAITING: "waiting",
    PREFILL: "prefill",
    DECODE: "decode",
    IDLE: "running, not in the batch",
    SWAPPED: "swapped",
    PREEMPTED: "preempted",
    FINISHED: "aborted / ignored",
}


def _spans(life: Lifecycle) -> list[tuple[int, int, str]]:
    """(first step, last step, state) for each run of equal states."""
    spans = []
    for state, run in groupby(life.states, key=lambda item: item[1]):
        steps = [n for n, _ in run]
        spans.append((steps[0], steps[-1], state))
    return spans


def timeline_png(trace: Trace, out: str | Path) -> Path:
    # The figure is drawn off-screen: no GUI backend, no pyplot state.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lives = list(trace.lifecycles().values())
    fig = Figure(figsize=(min(5 + len(trace.steps) * 0.12, 30), max(3.2, 1.2 + 0.35 * len(lives))))
    ax = fig.add_subplot()
    for row, life in enumerate(lives):
        for first, last, state in _spans(life):
            color = STATE_COLORS[state]
            ax.barh(row, last - first + 1, left=first, height=0.6, color=color, edgecolor="white")
        if life.finished:
            ax.plot(life.finished[0] + 1, row, marker="|", color="black", markersize=14)
    ax.set_yticks(range(len(lives)), [life.request_id for life in lives])
    ax.invert_yaxis()  # first arrival on top
    ax.set_xlim(0, max(len(trace.steps), 1))
    ax.set_xlabel("step")
    ax.set_ylabel("request")
    handles = [Patch(color=STATE_COLORS[s], label=label) for s, label in _LEGEND.items()]
    handles.append(Line2D([], [], color="black", marker="|", linestyle="", label="finished"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    ax.set_title(f"{len(lives)} requests over {len(trace.steps)} steps")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    return out


_ENGINE, _REQUESTS = 0, 1  # the two processes of the Chrome trace


def _span(pid: int, tid: int, name: str, ts: float, dur: float, **fields: Any) -> dict[str, Any]:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, **fields}


def _instant(tid: int, name: str, ts: float) -> dict[str, Any]:
    return {"ph": "i", "s": "t", "pid": _REQUESTS, "tid": tid, "name": name, "ts": ts}


def _label(kind: str, name: str, pid: int, tid: int = 0) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}


def chrome_trace(trace: Trace) -> dict[str, Any]:
    """The trace as Chrome trace events (microseconds since step 0 began)."""
    starts, t = [], 0.0
    for step in trace.steps:
        starts.append(t)
        t += trace.step_ms(step) * 1e3
    ends = starts[1:] + [t]
    events = [
        _label("process_name", "engine", _ENGINE),
        _label("process_name", "requests", _REQUESTS),
    ]
    for step, start in zip(trace.steps, starts, strict=True):
        args = {"batch_tokens": step["num_batched_tokens"], "free_gpu": step["free_blocks"]["gpu"]}
        dur = trace.step_ms(step) * 1e3
        events.append(_span(_ENGINE, 0, f"step {step['step']}", start, dur, args=args))
        for phase in ("schedule", "execute", "process"):
            dur = step["timings"][f"{phase}_ms"] * 1e3
            events.append(_span(_ENGINE, 1, phase, start, dur))
            start += dur
    for tid, life in enumerate(trace.lifecycles().values()):
        events.append(_label("thread_name", f"request {life.request_id}", _REQUESTS, tid))
        for first, last, state in _spans(life):
            dur = ends[last] - starts[first]
            args = {"steps": f"{first}-{last}"}
            events.append(_span(_REQUESTS, tid, state, starts[first], dur, cat=state, args=args))
        for step, mode in life.preemptions:
            events.append(_instant(tid, f"preempted ({mode})", starts[step]))
        if life.finished:
            step, reason = life.finished
            events.append(_instant(tid, f"finished ({reason})", ends[step]))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_timeline(trace: Trace, out: str | Path) -> Path:
    """A .png chart or a .json Chrome trace, by the suffix of `out`."""
    out = Path(out)
    if out.suffix == ".png":
        return timeline_png(trace, out)
    if out.suffix == ".json":
        out.write_text(json.dumps(chrome_trace(trace)), encoding="utf-8")
        return out
    raise ValueError(f"timeline writes .png or .json, got {out}")
