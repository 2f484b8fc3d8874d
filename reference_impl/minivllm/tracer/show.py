"""`minivllm-trace show`: a trace in the terminal, with rich.

Without `--step`: one row per step (the batch, queue lengths, free blocks,
events), for every step or those `--steps A:B` names. With `--step N`: that
step in full: the queues before and after,
the batch token by token (ids, positions, slots), every block table over a
strip of the device pool, the block moves and samples, and what changed
since the step before.

A V1 trace (header engine "v1") shows V1's step: the batch as each
request's computed tokens catching up ("A 0→16": 16 computed this step),
two queues (no swapped one), the requests with their computed tokens and
preemptions, block tables by request, the free queue in eviction order
with its cached blocks marked, and the step's prefix-cache lookups.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from minivllm.tracer.facts import batch_summary, block_owners, events, ref_counts
from minivllm.tracer.style import seq_color
from minivllm.tracer.trace import Trace

_POOL_STRIP_MAX = 512  # larger pools are summarised, not drawn


def add_plain_row(table: Table, *cells: str | Text) -> None:
    """A row whose strings print as they are: a trace's request ids are
    data, and "[/x]" read as rich markup would be an error."""
    table.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in cells))


def ranges(values: list[int]) -> str:
    """[3, 4, 5, 9, 10] -> "3-5, 9-10": positions and slots run in streaks."""
    if not values:
        return "-"
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)


def abbreviate(values: list[int], head: int = 6, tail: int = 2) -> str:
    if len(values) <= head + tail + 1:
        return " ".join(map(str, values))
    return " ".join(map(str, values[:head])) + " … " + " ".join(map(str, values[-tail:]))


def _queue_text(ids: list[str]) -> str:
    return " ".join(ids) if ids else "-"


def overview(trace: Trace, steps: range | None = None) -> Table:
    """One row per step: all of them, or those in `steps`. (V1 has no
    swapped queue: no "swap" column; its batch is "request computed→after".)"""
    steps = range(len(trace.steps)) if steps is None else steps
    title = f"{len(trace.steps)} steps"
    if trace.is_v1:
        title += " (V1)"
    if len(steps) < len(trace.steps):
        title = f"steps {steps.start} to {steps.stop - 1} of {len(trace.steps)}"
    table = Table(title=title, title_justify="left")
    names = ["step", "batch", "tokens", "wait", "run", "swap", "free gpu", "events"]
    if trace.is_v1:
        names.remove("swap")
    for name in names:
        table.add_column(name, justify="right" if name in ("step", "tokens") else "left")
    for step in trace.steps[steps.start : steps.stop]:
        q = step["queues_after"]
        swapped = [] if trace.is_v1 else [str(len(q["swapped"]))]
        add_plain_row(
            table,
            str(step["step"]),
            batch_summary(step),
            str(step["num_batched_tokens"]),
            str(len(q["waiting"])),
            str(len(q["running"])),
            *swapped,
            f"{step['free_blocks']['gpu']}/{trace.usable_gpu_blocks}",
            "; ".join(events(step)),
        )
    return table


def _queues_table(step: dict[str, Any]) -> Table:
    table = Table(title="queues", title_justify="left")
    for name in ("queue", "before", "after"):
        table.add_column(name)
    for queue in ("waiting", "running", "swapped"):
        before, after = step["queues_before"][queue], step["queues_after"][queue]
        add_plain_row(table, queue, _queue_text(before), _queue_text(after))
    return table


def _batch_table(step: dict[str, Any]) -> Table:
    table = Table(
        title=f"batch: {step['num_batched_tokens']} tokens", title_justify="left"
    )
    for name in ("request", "seq", "kind", "tokens", "positions", "token ids", "slots", "sampled"):
        table.add_column(name, justify="right" if name in ("seq", "tokens") else "left")
    for e in step["scheduled"]:
        sampled = step["sampled"].get(str(e["seq_id"]))
        add_plain_row(
            table,
            e["request_id"],
            Text(str(e["seq_id"]), style=seq_color(e["seq_id"])),
            "prefill" if e["is_prefill"] else "decode",
            str(e["num_tokens"]),
            ranges(e["positions"]),
            abbreviate(e["token_ids"]),
            ranges(e["slot_mapping"]),
            "-" if sampled is None else str(sampled),
        )
    return table


def _pool_strip(trace: Trace, step: dict[str, Any]) -> Text:
    """The device pool, one cell per block, coloured by the first sequence
    that maps it; a shared block shows its ref count instead of a square."""
    if trace.num_gpu_blocks > _POOL_STRIP_MAX:
        used = trace.num_gpu_blocks - step["free_blocks"]["gpu"]
        return Text(f"device pool: {used} of {trace.num_gpu_blocks} blocks in use")
    owner = {block: seqs[0] for block, seqs in block_owners(step)["gpu"].items()}
    refs = ref_counts(step)
    strip = Text("device pool: ")
    for block in range(trace.num_gpu_blocks):
        if block in owner:
            cell = str(refs[block]) if refs[block] > 1 else "■"
            strip.append(cell, style=seq_color(owner[block]))
        else:
            strip.append("·", style="grey50")
    return strip


def _block_tables(trace: Trace, step: dict[str, Any]) -> Group:
    free = step["free_blocks"]
    cache = trace.header["cache_config"]
    lines = [
        Text(
            f"free blocks: gpu {free['gpu']}/{cache['num_gpu_blocks']}, "
            f"cpu {free['cpu']}/{cache['num_cpu_blocks']}",
            style="bold",
        ),
        _pool_strip(trace, step),
    ]
    for seq_id, table in step["block_tables"].items():
        seq = step["seqs"][seq_id]
        where = "cpu" if seq["status"] == "swapped" else "gpu"
        line = Text(f"seq {seq_id}", style=seq_color(int(seq_id)))
        line.append(
            f" ({seq['request_id']}, {seq['status']}, {seq['num_tokens']} tokens) "
            f"{where} blocks: {' '.join(map(str, table))}"
        )
        lines.append(line)
    return Group(*lines)


def queue_moves(step: dict[str, Any]) -> list[str]:
    """Requests that changed queue in this step (either engine's steps)."""
    out = []
    before, after = step["queues_before"], step["queues_after"]
    where_before = {rid: q for q, ids in before.items() for rid in ids}
    where_after = {rid: q for q, ids in after.items() for rid in ids}
    for rid, q in where_after.items():
        if where_before.get(rid, "new") != q:
            out.append(f"{rid}: {where_before.get(rid, 'new')} → {q}")
    for rid in where_before:
        if rid not in where_after:
            out.append(f"{rid}: {where_before[rid]} → done")
    return out


def changes(prev: dict[str, Any] | None, step: dict[str, Any]) -> list[str]:
    """What this step changed: admissions, queue moves, blocks gained and lost."""
    out = queue_moves(step)
    old_tables = prev["block_tables"] if prev else {}
    for seq_id, table in step["block_tables"].items():
        old = old_tables.get(seq_id, [])
        gained = [b for b in table if b not in old]
        lost = [b for b in old if b not in table]
        if gained:
            out.append(f"seq {seq_id} gets blocks {' '.join(map(str, gained))}")
        if lost:
            out.append(f"seq {seq_id} gives up blocks {' '.join(map(str, lost))}")
    for seq_id in old_tables:
        if seq_id not in step["block_tables"]:
            out.append(f"seq {seq_id} frees its blocks {' '.join(map(str, old_tables[seq_id]))}")
    for name, label in (("swap_out", "swap out"), ("swap_in", "swap in"), ("copy", "copy")):
        if step[name]:
            pairs = ", ".join(f"{src}→{dst}" for src, dst in step[name])
            out.append(f"{label}: {pairs}")
    return out


# -- V1 steps ---------------------------------------------------------------------------


def request_color(trace: Trace, request_id: str) -> str:
    """A V1 request's colour: by its place among the trace's requests."""
    order = {rid: i for i, rid in enumerate(trace.requests)}
    return seq_color(order.get(request_id, 0))


def _v1_queues_table(step: dict[str, Any]) -> Table:
    table = Table(title="queues", title_justify="left")
    for name in ("queue", "before", "after"):
        table.add_column(name)
    for queue in ("waiting", "running"):
        before, after = step["queues_before"][queue], step["queues_after"][queue]
        add_plain_row(table, queue, _queue_text(before), _queue_text(after))
    return table


def _v1_batch_table(trace: Trace, step: dict[str, Any]) -> Table:
    table = Table(
        title=f"batch: {step['num_batched_tokens']} tokens (num_computed_tokens catching up)",
        title_justify="left",
    )
    columns = ("request", "computed", "tokens", "after", "positions", "token ids", "slots")
    for name in (*columns, "sampled"):
        right = name in ("computed", "tokens", "after")
        table.add_column(name, justify="right" if right else "left")
    for e in step["scheduled"]:
        sampled = step["sampled"].get(e["request_id"])
        add_plain_row(
            table,
            Text(e["request_id"], style=request_color(trace, e["request_id"])),
            str(e["num_computed_tokens"]),
            f"+{e['num_tokens']}",
            str(e["num_computed_tokens"] + e["num_tokens"]),
            ranges(e["positions"]),
            abbreviate(e["token_ids"]),
            ranges(e["slot_mapping"]),
            "-" if sampled is None else str(sampled),
        )
    return table


def _v1_requests_table(trace: Trace, step: dict[str, Any]) -> Table:
    table = Table(title="requests after the step", title_justify="left")
    for name in ("request", "status", "tokens", "computed", "preemptions", "blocks"):
        left = name in ("request", "status", "blocks")
        table.add_column(name, justify="left" if left else "right")
    for r in step["requests"]:
        blocks = step["block_tables"].get(r["request_id"])
        add_plain_row(
            table,
            Text(r["request_id"], style=request_color(trace, r["request_id"])),
            r["status"],
            str(r["num_tokens"]),
            str(r["num_computed_tokens"]),
            str(r["num_preemptions"]),
            "-" if not blocks else " ".join(map(str, blocks)),
        )
    return table


def _v1_pool(trace: Trace, step: dict[str, Any]) -> Group:
    """The pool strip (block 0 is the null block), and the free queue in
    eviction order, cached blocks marked with *."""
    free, usable = step["free_blocks"]["gpu"], trace.usable_gpu_blocks
    queue, cached = step["free_queue"]["block_ids"], set(step["free_queue"]["cached"])
    lines = [Text(f"free blocks: {free}/{usable} (block 0 is the null block)", style="bold")]
    if trace.num_gpu_blocks > _POOL_STRIP_MAX:
        lines.append(Text(f"device pool: {usable - free} of {usable} blocks in use"))
    else:
        owner: dict[int, str] = {}
        for rid, table in step["block_tables"].items():
            for block in table:
                owner.setdefault(block, rid)
        refs = ref_counts(step)
        strip = Text("device pool: ")
        for block in range(trace.num_gpu_blocks):
            if block == 0:
                strip.append("∅", style="grey50")
            elif block in owner:
                cell = str(refs[block]) if refs[block] > 1 else "■"
                strip.append(cell, style=request_color(trace, owner[block]))
            elif block in cached:
                strip.append("*", style="grey70")
            else:
                strip.append("·", style="grey50")
        lines.append(strip)
    shown = queue if len(queue) <= 64 else queue[:64]
    text = " ".join(f"{b}*" if b in cached else str(b) for b in shown)
    more = f" … {len(queue) - len(shown)} more" if len(shown) < len(queue) else ""
    lines.append(
        Text(
            f"free queue, next evicted first ({len(cached)} of {len(queue)} still cached, *): "
            f"{text or '-'}{more}"
        )
    )
    return Group(*lines)


def _v1_changes(prev: dict[str, Any] | None, step: dict[str, Any]) -> list[str]:
    out = queue_moves(step)
    old_tables = prev["block_tables"] if prev else {}
    for rid, table in step["block_tables"].items():
        old = old_tables.get(rid, [])
        gained = [b for b in table if b not in old]
        if gained:
            out.append(f"{rid} gets blocks {' '.join(map(str, gained))}")
    for rid, old in old_tables.items():
        if rid not in step["block_tables"] and old:
            out.append(f"{rid} frees its blocks {' '.join(map(str, old))} (to the queue's tail)")
    if prev is not None:
        was_cached = set(prev["free_queue"]["cached"])
        now_cached = set(step["free_queue"]["cached"])
        in_tables = {b for table in step["block_tables"].values() for b in table}
        evicted = sorted(b for b in was_cached - now_cached if b not in in_tables)
        reused = sorted(b for b in was_cached - now_cached if b in in_tables)
        if reused:
            out.append(
                f"cached blocks {' '.join(map(str, reused))} leave the free queue "
                "(a prefix hit, or handed out and overwritten)"
            )
        if evicted:
            out.append(f"blocks {' '.join(map(str, evicted))} lose their cached hash")
    return out


def _v1_step_detail(trace: Trace, n: int) -> Group:
    step = trace.steps[n]
    t = step["timings"]
    title = Text(
        f"step {n} (V1) · {step['num_batched_tokens']} tokens · schedule "
        f"{t['schedule_ms']:.2f} ms · execute {t['execute_ms']:.2f} ms · update "
        f"{t['update_ms']:.2f} ms · process {t['process_ms']:.2f} ms",
        style="bold",
    )
    parts: list[Any] = [
        title,
        _v1_queues_table(step),
        _v1_batch_table(trace, step),
        _v1_requests_table(trace, step),
        _v1_pool(trace, step),
    ]
    cache = step["prefix_cache"]
    if cache is not None:
        parts.append(
            Text(
                f"prefix cache this step: {cache['hits']} of {cache['queries']} tokens hit "
                f"(new requests); {cache['preempted_hits']} of {cache['preempted_queries']} "
                "(resumed after preemption)"
            )
        )
    happened = events(step)
    if happened:
        parts.append(Text("events: " + "; ".join(happened)))
    prev = trace.steps[n - 1] if n > 0 else None
    parts.append(Text(f"changes since {'step ' + str(n - 1) if prev else 'the start'}:"))
    parts += [Text("  " + c) for c in _v1_changes(prev, step)] or [Text("  none")]
    return Group(*parts)


def step_detail(trace: Trace, n: int) -> Group:
    if trace.is_v1:
        return _v1_step_detail(trace, n)
    step = trace.steps[n]
    t = step["timings"]
    title = Text(
        f"step {n} · {step['num_batched_tokens']} tokens · schedule {t['schedule_ms']:.2f} ms · "
        f"execute {t['execute_ms']:.2f} ms · process {t['process_ms']:.2f} ms",
        style="bold",
    )
    parts: list[Any] = [title, _queues_table(step), _batch_table(step), _block_tables(trace, step)]
    collectives = step["collectives"]
    if collectives is not None:
        parts.append(Text(
            f"collectives (the driver, {trace.header['parallel_config']['tensor_parallel_size']} "
            f"workers): {collectives['calls']} calls, {collectives['bytes'] / 1e3:.1f} KB, "
            f"{collectives['ms']:.2f} ms"
        ))
    happened = events(step)
    if happened:
        parts.append(Text("events: " + "; ".join(happened)))
    prev = trace.steps[n - 1] if n > 0 else None
    parts.append(Text(f"changes since {'step ' + str(n - 1) if prev else 'the start'}:"))
    parts += [Text("  " + c) for c in changes(prev, step)] or [Text("  none")]
    return Group(*parts)


def show(
    trace: Trace,
    step: int | None = None,
    console: Console | None = None,
    steps: range | None = None,
) -> None:
    """Step `step` in full, or one row per step (those in `steps`, or all)."""
    console = console or Console()
    if trace.truncated:
        console.print(Text("the trace's last line was cut short (a killed run?)", style="yellow"))
    if step is None:
        console.print(overview(trace, steps))
    else:
        trace.step(step)  # a clear error for a step the trace lacks
        console.print(step_detail(trace, step))
