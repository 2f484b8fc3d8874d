"""Reading a trace back: `load_trace(path) -> Trace`, and what each request
went through, step by step (`Trace.lifecycles()`), for the views.

This is the bottom of the tracer, with schema.py and errors.py; facts.py
derives figures from it, and the views (show, summary, notebook, render,
timeline) draw both. It imports no view, not even inside a function (a
test parses the imports). Yet in Jupyter a `Trace` displays as a table of
its steps and `trace.step(n)` as a diagram: those two display methods call
whatever the views registered with `set_display`, which the package does
(minivllm/tracer/__init__.py) when it is first imported, and so before this
module can be. With nothing registered they return None and Jupyter shows
the plain repr.

A trace is JSON Lines (format: SCHEMA.md), read and checked line by line by
`schema.read_trace`: a trace that loads is valid, so the views can trust
every field. A run that was killed may have left its last line
half-written: that line is dropped and `truncated` set, every complete step
before it is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minivllm.tracer.errors import NoSuchStep, TracerError
from minivllm.tracer.schema import read_trace

# The views that draw every step (show's table, render's page, the
# timeline) take at most this many at once unless told which: beyond it
# they get slow to make and to read, and a long run's steps are better seen
# a range at a time.
MAX_STEPS_AT_ONCE = 2000

# The display hooks (see the docstring): "trace_html" (Trace) -> HTML,
# "step_svg" (Trace, step number) -> SVG.
_display: dict[str, Callable[..., str]] = {}


def set_display(
    trace_html: Callable[[Trace], str], step_svg: Callable[[Trace, int], str]
) -> None:
    """How Jupyter draws a Trace and a StepView; set by the views package."""
    _display.update(trace_html=trace_html, step_svg=step_svg)


# What a request is doing in a step (the timeline's colours). V1 has no
# phases; its batch entries are called prefill or decode as `Trace.is_prefill` says.
WAITING = "waiting"  # in the waiting queue: not admitted, or preempted by RECOMPUTE
PREFILL = "prefill"  # in the batch, computing (part of) its prompt
DECODE = "decode"  # in the batch, one token per sequence
IDLE = "running"  # in the running queue but not in this batch
SWAPPED = "swapped"  # KV cache in the CPU pool
PREEMPTED = "preempted"  # preempted in this step
FINISHED = "finished"  # aborted or ignored in this step without running


@dataclass
class Lifecycle:
    """One request from its arrival to its end, derived from the step lines.

    states: (step, state) for each step from arrival on, the state one of
        the constants above.
    preemptions: (step, mode) for each preemption.
    finished: (step, finish_reason, or "ignored" for a prompt that could
        never fit), or None if the trace ends first.
    first_token_step: the step that sampled its first token, if any.
    num_output_tokens: tokens sampled, all its sequences together.
    prefix_cache_hit_tokens: prompt tokens found in the prefix cache,
        summed over its admissions (a recomputed request is admitted again).
    """

    request_id: str
    arrival_step: int
    states: list[tuple[int, str]] = field(default_factory=list)
    preemptions: list[tuple[int, str]] = field(default_factory=list)
    finished: tuple[int, str] | None = None
    first_token_step: int | None = None
    num_output_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def steps_waited(self) -> int:
        """Steps between arrival and end in which it was not in the batch."""
        return sum(state not in (PREFILL, DECODE) for _, state in self.states)


@dataclass(repr=False)
class Trace:
    header: dict[str, Any]
    requests: dict[str, dict[str, Any]]  # request id -> its request line
    steps: list[dict[str, Any]]
    truncated: bool = False  # the last line was incomplete (a killed run)

    @property
    def engine(self) -> str:
        """"classic" or "v1": which engine wrote it, and so its step lines' form."""
        return self.header["engine"]

    @property
    def is_v1(self) -> bool:
        return self.header["engine"] == "v1"

    @property
    def block_size(self) -> int:
        return self.header["cache_config"]["block_size"]

    @property
    def num_gpu_blocks(self) -> int:
        return self.header["cache_config"]["num_gpu_blocks"]

    @property
    def usable_gpu_blocks(self) -> int:
        """The device blocks requests can hold: V1 keeps block 0 as its null block."""
        return self.num_gpu_blocks - (1 if self.is_v1 else 0)

    def is_prefill(self, entry: dict[str, Any]) -> bool:
        """Whether a batch entry computes prompt (or recomputes known) tokens
        rather than decoding one new token. The classic engine says so; for
        V1, which has no phases, it is an entry of several tokens or one
        inside the prompt."""
        if "is_prefill" in entry:
            return entry["is_prefill"]
        prompt_len = len(self.requests[entry["request_id"]]["prompt_token_ids"])
        return entry["num_tokens"] > 1 or entry["positions"][0] < prompt_len

    def step_ms(self, step: dict[str, Any]) -> float:
        """The step's measured time: schedule + execute + process."""
        return sum(step["timings"].values())

    def seq_owners(self) -> dict[int, str]:
        """seq id -> request id, for every sequence the trace mentions (none
        for V1, whose steps name requests only)."""
        owners: dict[int, str] = {}
        if self.is_v1:
            return owners
        for step in self.steps:
            for entry in step["scheduled"]:
                owners[entry["seq_id"]] = entry["request_id"]
            for seq_id, seq in step["seqs"].items():
                owners[int(seq_id)] = seq["request_id"]
        return owners

    def lifecycles(self) -> dict[str, Lifecycle]:
        """What every request did in every step, in arrival order."""
        lives = {rid: Lifecycle(rid, req["arrival_step"]) for rid, req in self.requests.items()}
        owners = self.seq_owners()
        # V1's `sampled` is keyed by request id, the classic one's by seq id.
        owner = (lambda key: key) if self.is_v1 else (lambda key: owners[int(key)])
        pending = sorted(lives.values(), key=lambda life: life.arrival_step, reverse=True)
        active: dict[str, Lifecycle] = {}  # arrived and not finished, in arrival order
        for step in self.steps:
            n = step["step"]
            while pending and pending[-1].arrival_step <= n:
                life = pending.pop()
                active[life.request_id] = life
            in_batch: dict[str, str] = {}
            waiting_before = set(step["queues_before"]["waiting"])
            for entry in step["scheduled"]:
                rid = entry["request_id"]
                prefill = self.is_prefill(entry)
                # An admitted prompt's first chunk starts after its cached prefix.
                if (prefill or self.is_v1) and rid not in in_batch and rid in waiting_before:
                    lives[rid].prefix_cache_hit_tokens += entry["positions"][0]
                in_batch[rid] = PREFILL if prefill else DECODE
            for key in step["sampled"]:
                life = lives[owner(key)]
                life.num_output_tokens += 1
                if life.first_token_step is None:
                    life.first_token_step = n
            preempted = {p["request_id"]: p["mode"] for p in step["preempted"]}
            for rid, mode in preempted.items():
                lives[rid].preemptions.append((n, mode))
            queue_of = {rid: q for q, ids in step["queues_after"].items() for rid in ids}
            for rid, life in active.items():
                if rid in in_batch:
                    state = in_batch[rid]
                elif rid in preempted:
                    state = PREEMPTED
                else:
                    state = {"waiting": WAITING, "running": IDLE, "swapped": SWAPPED}.get(
                        queue_of.get(rid), FINISHED
                    )
                life.states.append((n, state))
            for done in step["finished"]:
                rid = done["request_id"]
                # An ignored prompt finishes with "length", as in vLLM; say why.
                reason = "ignored" if rid in step.get("ignored", ()) else done["finish_reason"]
                lives[rid].finished = (n, reason)
                active.pop(rid, None)
        return lives

    def step(self, n: int) -> StepView:
        """Step `n`; in Jupyter it displays as its block diagram."""
        if not 0 <= n < len(self.steps):
            raise NoSuchStep(f"step {n} is not in this trace ({self.steps_in_words()})")
        return StepView(self, n)

    def steps_in_words(self) -> str:
        n = len(self.steps)
        return f"steps 0 to {n - 1}" if n else "it has no steps"

    def __repr__(self) -> str:
        # Short and free of timings, so notebooks print the same thing every run.
        engine = " (V1)" if self.is_v1 else ""
        return (
            f"<Trace{engine}: {len(self.steps)} steps, {len(self.requests)} requests, "
            f"block_size {self.block_size}, {self.num_gpu_blocks} GPU blocks>"
        )

    def _repr_html_(self) -> str | None:
        draw = _display.get("trace_html")
        return None if draw is None else draw(self)


@dataclass
class StepView:
    """One step of a trace, drawn inline by Jupyter (needs Graphviz's dot)."""

    trace: Trace = field(repr=False)
    n: int

    def _repr_svg_(self) -> str | None:
        draw = _display.get("step_svg")
        if draw is None or self.trace.is_v1:  # the diagram is of a classic step
            return None
        return draw(self.trace, self.n)


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace file; raises TraceError naming the file and
    the line that is not a valid trace line."""
    lines, truncated = read_trace(path)
    header, requests, steps = lines[0], {}, []
    for line in lines[1:]:
        if line["type"] == "request":
            requests[line["request_id"]] = line
        else:
            steps.append(line)
    return Trace(header, requests, steps, truncated)


def step_range(trace: Trace, spec: str | None, view: str) -> range:
    """The steps a view that draws every step draws: those `spec` names
    ("A:B" is steps A to B-1, as a Python slice; "A:" and ":B" leave an end
    open), else all of them, unless there are more than MAX_STEPS_AT_ONCE:
    then the view refuses, saying how to choose."""
    total = len(trace.steps)
    if spec is None:
        if total > MAX_STEPS_AT_ONCE:
            raise TracerError(
                f"{view} draws at most {MAX_STEPS_AT_ONCE} steps at once and this trace has "
                f"{total}: choose them with --steps A:B (steps A to B-1), e.g. --steps "
                f"0:{MAX_STEPS_AT_ONCE}, or --steps 0:{total} for every one"
            )
        return range(total)
    start, stop = _parse_range(spec)
    start, stop = start or 0, total if stop is None else min(stop, total)
    if start >= stop:
        raise TracerError(f"--steps {spec} names no step of this trace ({trace.steps_in_words()})")
    return range(start, stop)


def _parse_range(spec: str) -> tuple[int | None, int | None]:
    first, colon, last = spec.partition(":")
    try:
        ends = [int(text) if text.strip() else None for text in (first, last)]
    except ValueError:
        ends = [-1]
    if not colon or any(end is not None and end < 0 for end in ends):
        raise TracerError(f"--steps takes A:B, A: or :B with step numbers A < B, got {spec!r}")
    return ends[0], ends[1]
