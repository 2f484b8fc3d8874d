"""`minivllm-trace timeline`: every request's life, step by step.

As a PNG (matplotlib): one row per request, one cell per step, coloured by
what the request did in it: waiting, prefill, decode, in the running queue
but not the batch, swapped, preempted in this step, or dropped (aborted or
ignored without running); a bar marks where it finished. As JSON (Chrome
trace events, for Perfetto or chrome://tracing): the same spans on a real
time axis, the steps' measured durations, plus an "engine" track with each
step's schedule, execute and process phases.

Either shows every step, or a range of them (`--steps A:B`): each request's
life is worked out over the whole trace, then cut to the range.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import groupby
from pathlib import Path
from typing import Any

from minivllm.tracer.errors import TracerError
from minivllm.tracer.style import STATE_COLORS
from minivllm.tracer.trace import (
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


# Rows (requests) in one PNG: each takes a third of an inch, so more make an
# image taller than any screen, and megapixels matplotlib must hold at once.
MAX_ROWS = 200


def lives_in(trace: Trace, steps: range | None = None) -> list[Lifecycle]:
    """Each request's life, cut to `steps` (default: all): those that are
    in the trace in one of them, in arrival order."""
    steps = range(len(trace.steps)) if steps is None else steps
    lives = []
    for life in trace.lifecycles().values():
        states = [(n, state) for n, state in life.states if n in steps]
        if not states:
            continue
        finished = life.finished if life.finished and life.finished[0] in steps else None
        preemptions = [(n, mode) for n, mode in life.preemptions if n in steps]
        lives.append(
            dataclasses.replace(life, states=states, preemptions=preemptions, finished=finished)
        )
    return lives


def _spans(life: Lifecycle) -> list[tuple[int, int, str]]:
    """(first step, last step, state) for each run of equal states."""
    spans = []
    for state, run in groupby(life.states, key=lambda item: item[1]):
        steps = [n for n, _ in run]
        spans.append((steps[0], steps[-1], state))
    return spans


def timeline_png(trace: Trace, out: str | Path, steps: range | None = None) -> Path:
    # The figure is drawn off-screen: no GUI backend, no pyplot state.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    steps = range(len(trace.steps)) if steps is None else steps
    lives = lives_in(trace, steps)
    if len(lives) > MAX_ROWS:
        raise TracerError(
            f"the timeline of steps {steps.start} to {steps.stop - 1} has {len(lives)} requests, "
            f"more than the {MAX_ROWS} rows one image can show: choose fewer steps with "
            "--steps A:B, or write -o FILE.json for Perfetto"
        )
    fig = Figure(figsize=(min(5 + len(steps) * 0.12, 30), max(3.2, 1.2 + 0.35 * len(lives))))
    ax = fig.add_subplot()
    for row, life in enumerate(lives):
        for first, last, state in _spans(life):
            color = STATE_COLORS[state]
            ax.barh(row, last - first + 1, left=first, height=0.6, color=color, edgecolor="white")
        if life.finished:
            ax.plot(life.finished[0] + 1, row, marker="|", color="black", markersize=14)
    ax.set_yticks(range(len(lives)), [life.request_id for life in lives])
    ax.invert_yaxis()  # first arrival on top
    ax.set_xlim(steps.start, max(steps.stop, steps.start + 1))
    ax.set_xlabel("step")
    ax.set_ylabel("request")
    handles = [Patch(color=STATE_COLORS[s], label=label) for s, label in _LEGEND.items()]
    handles.append(Line2D([], [], color="black", marker="|", linestyle="", label="finished"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    if len(steps) == len(trace.steps):
        ax.set_title(f"{len(lives)} requests over {len(trace.steps)} steps")
    else:
        ax.set_title(f"{len(lives)} requests, steps {steps.start} to {steps.stop - 1}")
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


def chrome_trace(trace: Trace, steps: range | None = None) -> dict[str, Any]:
    """The trace, or the range `steps` of it, as Chrome trace events
    (microseconds since its first step began)."""
    steps = range(len(trace.steps)) if steps is None else steps
    starts, ends, t = {}, {}, 0.0
    for n in steps:
        starts[n] = t
        t += trace.step_ms(trace.steps[n]) * 1e3
        ends[n] = t
    events = [
        _label("process_name", "engine", _ENGINE),
        _label("process_name", "requests", _REQUESTS),
    ]
    for n, start in starts.items():
        step = trace.steps[n]
        args = {"batch_tokens": step["num_batched_tokens"], "free_gpu": step["free_blocks"]["gpu"]}
        dur = trace.step_ms(step) * 1e3
        events.append(_span(_ENGINE, 0, f"step {step['step']}", start, dur, args=args))
        for phase in ("schedule", "execute", "process"):
            dur = step["timings"][f"{phase}_ms"] * 1e3
            events.append(_span(_ENGINE, 1, phase, start, dur))
            start += dur
    for tid, life in enumerate(lives_in(trace, steps)):
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


def check_timeline_format(out: str | Path) -> None:
    if Path(out).suffix not in (".png", ".json"):
        raise TracerError(f"timeline writes .png or .json, got {out}")


def write_timeline(trace: Trace, out: str | Path, steps: range | None = None) -> Path:
    """A .png chart or a .json Chrome trace, by the suffix of `out`, of every
    step or those in `steps`."""
    check_timeline_format(out)
    out = Path(out)
    if out.suffix == ".png":
        return timeline_png(trace, out, steps)
    out.write_text(json.dumps(chrome_trace(trace, steps)), encoding="utf-8")
    return out
