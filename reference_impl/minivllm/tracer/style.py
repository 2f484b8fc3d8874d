"""Colours and sizes shared by the views: one colour per sequence, one per
lifecycle state; how block pools are laid out."""

from __future__ import annotations

from minivllm.tracer.trace import DECODE, FINISHED, IDLE, PREEMPTED, PREFILL, SWAPPED, WAITING

# Light colours, so that black text on them stays readable.
SEQ_COLORS = [
    "#8ecae6",
    "#ffb703",
    "#90be6d",
    "#f4a6c6",
    "#cdb4db",
    "#f9844a",
    "#43aa8b",
    "#ffd6a5",
    "#a0c4ff",
    "#e9c46a",
    "#b5e48c",
    "#bdb2ff",
]

STATE_COLORS = {
    WAITING: "#d9d9d9",
    PREFILL: "#f9844a",
    DECODE: "#43aa8b",
    IDLE: "#b7e4c7",
    SWAPPED: "#9d4edd",
    PREEMPTED: "#d62828",
    FINISHED: "#222222",
}


# A block pool is drawn POOL_COLUMNS cells wide (render.py, page.js); above
# MAX_POOL_CELLS blocks, only those in use are drawn.
POOL_COLUMNS = 16
MAX_POOL_CELLS = 1024


def seq_color(seq_id: int) -> str:
    return SEQ_COLORS[seq_id % len(SEQ_COLORS)]
