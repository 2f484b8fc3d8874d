"""`minivllm-trace render`: one step as a block diagram, with Graphviz.

The picture of paged attention: on the right the physical block pool, one
cell per block, coloured by the sequence that maps it (a shared block shows
its ref count); on the left each sequence's block table, logical block i →
physical block, with an arrow to the cell; above them the three queues.
Swapped sequences point into a second pool, the CPU's, drawn only with the
blocks in use. Hovering a cell in a browser names its owners.

Needs the `dot` program of Graphviz (the Python package only drives it).
"""

from __future__ import annotations

import html
import shutil
from pathlib import Path
from typing import Any

import graphviz

from minivllm.tracer.errors import TracerError
from minivllm.tracer.facts import block_owners, ref_counts
from minivllm.tracer.style import MAX_POOL_CELLS, POOL_COLUMNS, seq_color
from minivllm.tracer.trace import Trace

_MAX_EDGES = 256  # above this, the tables show the mapping as text only


class GraphvizNotFound(TracerError, RuntimeError):
    pass


def require_dot() -> None:
    if shutil.which("dot") is None:
        raise GraphvizNotFound(
            "Rendering needs the `dot` program of Graphviz, which is not on PATH. Install it: "
            "`apt-get install graphviz` (Debian/Ubuntu; `make setup` does this as root), "
            "`brew install graphviz` (macOS), `conda install graphviz`, or see "
            "https://graphviz.org/download/"
        )


def _cell(text: str, **attrs: Any) -> str:
    attr = "".join(f' {k.upper()}="{html.escape(str(v))}"' for k, v in attrs.items())
    return f"<TD{attr}>{html.escape(text)}</TD>"


def _pool_label(
    title: str, blocks: list[int], owners: dict[int, list[int]], refs: dict[int, int], device: str
) -> str:
    rows, row = [], []
    for block in blocks:
        seqs = owners.get(block, [])
        # A cell's tooltip needs an href to reach the SVG: it links to itself.
        cell_id = f"{device}-block-{block}"
        attrs: dict[str, Any] = {"port": f"b{block}", "id": cell_id, "href": f"#{cell_id}"}
        if seqs:
            attrs["bgcolor"] = seq_color(seqs[0])
            who = ", ".join(f"seq {s}" for s in seqs)
            attrs["tooltip"] = f"{device} block {block}: {who}"
            text = f"{block} ×{refs[block]}" if refs.get(block, 1) > 1 else str(block)
        else:
            attrs["tooltip"] = f"{device} block {block}: free"
            text = str(block)
        row.append(_cell(text, **attrs))
        if len(row) == POOL_COLUMNS:
            rows.append(row)
            row = []
    if row:
        rows.append(row)
    width = max((len(r) for r in rows), default=1)
    header = f'<TR><TD COLSPAN="{width}" BORDER="0"><B>{html.escape(title)}</B></TD></TR>'
    body = "".join("<TR>" + "".join(r) + "</TR>" for r in rows)
    return f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">{header}{body}</TABLE>>'


def _seq_label(seq_id: str, seq: dict[str, Any], table: list[int]) -> str:
    color = seq_color(int(seq_id))
    title = (
        f"seq {seq_id} · {seq['request_id']} · {seq['status']} · "
        f"{seq['num_tokens']} tokens ({seq['num_computed_tokens']} in cache)"
    )
    cells = "".join(
        _cell(f"L{i} → {block}", port=f"l{i}", bgcolor=color) for i, block in enumerate(table)
    )
    return (
        '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">'
        f'<TR><TD COLSPAN="{len(table)}" BORDER="0">{html.escape(title)}</TD></TR>'
        f"<TR>{cells}</TR></TABLE>>"
    )


def _queues_label(step: dict[str, Any]) -> str:
    rows = "".join(
        f"<TR>{_cell(name, align='left')}{_cell(' '.join(ids) or '-', align='left')}</TR>"
        for name, ids in step["queues_after"].items()
    )
    return (
        '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">'
        '<TR><TD COLSPAN="2" BORDER="0"><B>queues after the step</B></TD></TR>'
        f"{rows}</TABLE>>"
    )


def refuse_v1(trace: Trace, what: str) -> None:
    """The diagrams draw the classic engine's step (sequences, swap pool):
    a V1 trace is shown by `show` instead."""
    if trace.is_v1:
        raise TracerError(
            f"{what} draws the classic engine's steps (sequences, the CPU swap pool); this is "
            "a V1 trace: see its steps with minivllm-trace show TRACE --step N, its requests "
            "with minivllm-trace summary TRACE or timeline"
        )


def step_graph(trace: Trace, n: int) -> graphviz.Digraph:
    """The diagram of step `n`, the state once the step is done."""
    refuse_v1(trace, "render")
    require_dot()
    step = trace.steps[n]
    cache = trace.header["cache_config"]
    free = step["free_blocks"]
    graph = graphviz.Digraph(f"step{n}")
    graph.attr(
        rankdir="LR",
        labelloc="t",
        fontname="Helvetica",
        label=(
            f"step {n}: {step['num_batched_tokens']} tokens in the batch; free blocks: "
            f"gpu {free['gpu']}/{cache['num_gpu_blocks']}, "
            f"cpu {free['cpu']}/{cache['num_cpu_blocks']}"
        ),
    )
    graph.attr("node", shape="plain", fontname="Helvetica", fontsize="10")
    graph.node("queues", _queues_label(step))

    owners = block_owners(step)
    tables = step["block_tables"]
    for seq_id, table in tables.items():  # waiting sequences have none: see the queues
        graph.node(f"seq{seq_id}", _seq_label(seq_id, step["seqs"][seq_id], table))

    num_gpu = cache["num_gpu_blocks"]
    gpu_blocks = range(num_gpu) if num_gpu <= MAX_POOL_CELLS else sorted(owners["gpu"])
    graph.node(
        "gpu",
        _pool_label(
            f"device (gpu) pool: {num_gpu} blocks of {cache['block_size']} tokens",
            list(gpu_blocks),
            owners["gpu"],
            ref_counts(step),
            "gpu",
        ),
    )
    if owners["cpu"]:
        cpu_refs = {b: len(s) for b, s in owners["cpu"].items()}
        title = "CPU swap pool: blocks in use"
        graph.node("cpu", _pool_label(title, sorted(owners["cpu"]), owners["cpu"], cpu_refs, "cpu"))
    if sum(len(t) for t in tables.values()) <= _MAX_EDGES:
        for seq_id, table in tables.items():
            device = "cpu" if step["seqs"][seq_id]["status"] == "swapped" else "gpu"
            for i, block in enumerate(table):
                graph.edge(f"seq{seq_id}:l{i}", f"{device}:b{block}", color=seq_color(int(seq_id)))
    return graph


def step_svg(trace: Trace, n: int) -> str:
    """Step `n`'s diagram as SVG text: how a `StepView` draws in Jupyter."""
    return step_graph(trace, n).pipe(format="svg").decode()


def check_image_format(out: str | Path) -> str:
    """The image format `out` names by its suffix: svg, png or pdf."""
    fmt = Path(out).suffix.lstrip(".").lower()
    if fmt not in ("svg", "png", "pdf"):
        raise TracerError(f"render writes .svg, .png or .pdf (or .html for steps), got {out}")
    return fmt


def render_step(trace: Trace, n: int, out: str | Path) -> Path:
    """Write step `n` to `out`; the format (svg, png, pdf) is its suffix."""
    out = Path(out)
    out.write_bytes(step_graph(trace, n).pipe(format=check_image_format(out)))
    return out
