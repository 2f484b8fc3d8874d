"""What a trace says, worked out once for every view: the facts layer.

The tracer has two layers, and imports go one way, from the views down:

- facts: `errors.py`, `schema.py` (what a valid line is), `trace.py` (the
  trace read back: `Trace`, `StepView`, each request's `Lifecycle`) and this
  module (figures derived from steps and lifecycles). None of them imports
  a view; tests/test_tracer.py checks that.
- views, on top: `show.py` (terminal), `summary.py`, `notebook.py` (HTML),
  `render.py` (Graphviz), `timeline.py`, and `cli.py` and `scenario.py`
  above them. They turn these facts into tables, pages and pictures.

So a lab, a checker or a test that needs a step's events or a block's ref
count imports them from here, without rich, Graphviz or matplotlib.

Per step: `ref_counts`, `block_owners`, `events`, `batch_summary` (each
for both engines' steps but `block_owners`, the classic engine's pools). Per
request (from `Trace.lifecycles()`): `ttft_steps`, `ttft_ms`. Per run:
`utilisation`, `run_totals`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minivllm.tracer.trace import Lifecycle, Trace

# -- one step -------------------------------------------------------------------------


def ref_counts(step: dict[str, Any]) -> dict[int, int]:
    """Device block -> how many sequences (V1: requests) map it (swapped
    sequences' tables are CPU blocks and do not count)."""
    counts: dict[int, int] = {}
    for seq_id, table in step["block_tables"].items():
        if "seqs" not in step or step["seqs"][seq_id]["status"] != "swapped":
            for block in table:
                counts[block] = counts.get(block, 0) + 1
    return counts


def block_owners(step: dict[str, Any]) -> dict[str, dict[int, list[int]]]:
    """Per pool ("gpu", "cpu"): block -> the sequences that map it, in the
    order of the step's block tables. A swapped sequence's table is in the
    CPU pool, every other one in the device pool."""
    owners: dict[str, dict[int, list[int]]] = {"gpu": {}, "cpu": {}}
    for seq_id, table in step["block_tables"].items():
        device = "cpu" if step["seqs"][seq_id]["status"] == "swapped" else "gpu"
        for block in table:
            owners[device].setdefault(block, []).append(int(seq_id))
    return owners


def events(step: dict[str, Any]) -> list[str]:
    """The step's notable events, in words."""
    out = [f"preempt {p['request_id']} ({p['mode']})" for p in step["preempted"]]
    if "seqs" not in step:
        return out + _v1_events(step)
    out += [f"ignore {rid}" for rid in step["ignored"]]
    if step["swap_out"]:
        out.append(f"swap out {len(step['swap_out'])} blocks")
    if step["swap_in"]:
        out.append(f"swap in {len(step['swap_in'])} blocks")
    if step["copy"]:
        out.append(f"copy-on-write {len(step['copy'])} blocks")
    if step["prefix_cache"] and step["prefix_cache"]["hits"]:
        out.append(f"prefix cache {step['prefix_cache']['hits']} blocks hit")
    out += [f"finish {f['request_id']} ({f['finish_reason']})" for f in step["finished"]]
    return out


def _v1_events(step: dict[str, Any]) -> list[str]:
    out = []
    cache = step["prefix_cache"]
    if cache and cache["hits"]:
        out.append(f"prefix cache {cache['hits']} of {cache['queries']} tokens hit")
    if cache and cache["preempted_queries"]:
        out.append(
            f"resumed: {cache['preempted_hits']} of {cache['preempted_queries']} tokens "
            "still cached"
        )
    return out + [f"finish {f['request_id']} ({f['finish_reason']})" for f in step["finished"]]


def batch_summary(step: dict[str, Any]) -> str:
    """"P A:100, D B": the batch by request, prefill (P, with tokens) or
    decode (D). A V1 step has no phases: "A 0→16, B 40→41", each request's
    computed tokens before and after the step (catching up with its tokens)."""
    if "seqs" not in step:
        return ", ".join(
            f"{e['request_id']} {e['num_computed_tokens']}→"
            f"{e['num_computed_tokens'] + e['num_tokens']}"
            for e in step["scheduled"]
        ) or "(empty)"
    parts, seen = [], set()
    for e in step["scheduled"]:
        if e["request_id"] in seen:
            continue
        seen.add(e["request_id"])
        if e["is_prefill"]:
            parts.append(f"P {e['request_id']}:{e['num_tokens']}")
        else:
            parts.append(f"D {e['request_id']}")
    return ", ".join(parts) or "(empty)"


# -- one request ----------------------------------------------------------------------


def ttft_steps(life: Lifecycle) -> int | None:
    """Time to first token in steps, the arrival step included."""
    if life.first_token_step is None:
        return None
    return life.first_token_step - life.arrival_step + 1


def ttft_ms(trace: Trace, life: Lifecycle) -> float | None:
    """Measured step time from the arrival step to the first token's, inclusive."""
    if life.first_token_step is None:
        return None
    steps = trace.steps[life.arrival_step : life.first_token_step + 1]
    return sum(trace.step_ms(s) for s in steps)


# -- the whole run --------------------------------------------------------------------


def utilisation(trace: Trace) -> list[float]:
    """Per step: the share of device blocks in use after it (of those
    requests can hold: V1's null block is not one)."""
    total = trace.usable_gpu_blocks
    return [(total - s["free_blocks"]["gpu"]) / total for s in trace.steps]


@dataclass
class RunTotals:
    """A run's totals over all its steps."""

    num_steps: int
    measured_ms: float  # the steps' measured time, summed
    num_requests: int
    num_finished: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: dict[str, int]  # mode ("recompute", "swap") -> how many
    blocks_moved: dict[str, int]  # "swap_out", "swap_in", "copy" -> blocks (classic only)
    prefix_cache_queries: int  # looked up in the prefix cache: blocks (classic), tokens (V1)
    prefix_cache_hits: int
    # V1 only: lookups of requests resumed after preemption, in tokens
    resumed_queries: int = 0
    resumed_hits: int = 0
    # V1 only: tokens computed again after a preemption (positions computed before)
    recomputed_tokens: int = 0


def run_totals(trace: Trace) -> RunTotals:
    steps = trace.steps
    modes = [p["mode"] for s in steps for p in s["preempted"]]
    entries = [e for s in steps for e in s["scheduled"]]
    prefill = sum(e["num_tokens"] for e in entries if trace.is_prefill(e))
    caches = [s["prefix_cache"] for s in steps if s["prefix_cache"]]
    moved = ("swap_out", "swap_in", "copy")
    return RunTotals(
        num_steps=len(steps),
        measured_ms=sum(trace.step_ms(s) for s in steps),
        num_requests=len(trace.requests),
        num_finished=sum(len(s["finished"]) for s in steps),
        prefill_tokens=prefill,
        decode_tokens=sum(e["num_tokens"] for e in entries) - prefill,
        preemptions={mode: modes.count(mode) for mode in ("recompute", "swap")},
        blocks_moved={k: 0 if trace.is_v1 else sum(len(s[k]) for s in steps) for k in moved},
        prefix_cache_queries=sum(c["queries"] for c in caches),
        prefix_cache_hits=sum(c["hits"] for c in caches),
        resumed_queries=sum(c.get("preempted_queries", 0) for c in caches),
        resumed_hits=sum(c.get("preempted_hits", 0) for c in caches),
        recomputed_tokens=_recomputed_tokens(trace) if trace.is_v1 else 0,
    )


def _recomputed_tokens(trace: Trace) -> int:
    """V1: tokens the batch computed at positions it had computed before for
    the same request (after a preemption freed their K/V)."""
    done: dict[str, int] = {}  # request id -> positions computed so far
    total = 0
    for step in trace.steps:
        for e in step["scheduled"]:
            end = e["num_computed_tokens"] + e["num_tokens"]
            total += max(0, min(end, done.get(e["request_id"], 0)) - e["num_computed_tokens"])
            done[e["request_id"]] = max(end, done.get(e["request_id"], 0))
    return total
