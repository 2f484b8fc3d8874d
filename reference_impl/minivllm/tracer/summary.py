"""`minivllm-trace summary`: per request and in total, what a run cost.

Per request: prompt and output tokens, its arrival step, steps spent
waiting (not in the batch) between arrival and end, time to first token
(ttft: in steps, arrival step included, and in milliseconds of measured
step time), preemptions, prompt tokens found in the prefix cache
("cached"), and how and when it finished. In total: tokens, preemptions, block
moves, prefix-cache hit rate, and KV-cache utilisation over time (the share
of device blocks in use after each step, as a sparkline).

A V1 trace has no swap pool and no copy-on-write ("blocks moved" says
so), counts prefix-cache lookups in tokens (those of requests resumed
after preemption apart), and adds the tokens computed again after
preemptions. Its "prefill" tokens are those `Trace.is_prefill` calls so.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from minivllm.tracer.facts import run_totals, ttft_ms, ttft_steps, utilisation
from minivllm.tracer.show import add_plain_row
from minivllm.tracer.trace import Trace

_SPARKS = " ▁▂▃▄▅▆▇█"
_COLUMNS = (
    "request",
    "prompt",
    "output",
    "arrived",
    "waited",
    "ttft",
    "ttft ms",
    "preempted",
    "cached",
    "finished",
)
_SPARK_WIDTH = 60


def sparkline(values: list[float], width: int = _SPARK_WIDTH) -> str:
    """Values in [0, 1] as block characters, averaged into at most `width`."""
    if not values:
        return ""
    buckets = min(width, len(values))
    chars = []
    for i in range(buckets):
        chunk = values[i * len(values) // buckets : (i + 1) * len(values) // buckets]
        level = sum(chunk) / len(chunk)
        chars.append(_SPARKS[round(level * (len(_SPARKS) - 1))])
    return "".join(chars)


def request_table(trace: Trace) -> Table:
    table = Table(title="requests", title_justify="left")
    for name in _COLUMNS:
        table.add_column(name, justify="left" if name in ("request", "finished") else "right")
    for life in trace.lifecycles().values():
        ttft, ttft_in_steps = ttft_ms(trace, life), ttft_steps(life)
        add_plain_row(
            table,
            life.request_id,
            str(len(trace.requests[life.request_id]["prompt_token_ids"])),
            str(life.num_output_tokens),
            str(life.arrival_step),
            str(life.steps_waited),
            "-" if ttft_in_steps is None else str(ttft_in_steps),
            "-" if ttft is None else f"{ttft:.2f}",
            ", ".join(mode for _, mode in life.preemptions) or "-",
            str(life.prefix_cache_hit_tokens),
            f"{life.finished[1]} @{life.finished[0]}" if life.finished else "not yet",
        )
    return table


def totals(trace: Trace) -> Table:
    t = run_totals(trace)
    used = utilisation(trace)
    moved = t.blocks_moved
    rows = [
        ("engine", "V1 (minivllm/v1/)" if trace.is_v1 else "classic"),
        ("steps", f"{t.num_steps} ({t.measured_ms:.1f} ms measured)"),
        ("requests", f"{t.num_requests}, {t.num_finished} finished"),
        ("tokens computed", f"{t.prefill_tokens} prefill + {t.decode_tokens} decode"),
    ]
    if trace.is_v1:
        rows += [
            (
                "preemptions",
                f"{t.preemptions['recompute']} recompute ({t.recomputed_tokens} tokens "
                "computed again)",
            ),
            ("blocks moved", "none: V1 has no swap pool and no copy-on-write"),
        ]
    else:
        rows += [
            (
                "preemptions",
                f"{t.preemptions['recompute']} recompute, {t.preemptions['swap']} swap",
            ),
            (
                "blocks moved",
                f"{moved['swap_out']} swapped out, {moved['swap_in']} swapped in, "
                f"{moved['copy']} copied (copy-on-write)",
            ),
        ]
    if trace.header["cache_config"]["enable_prefix_caching"]:
        hits, queries = t.prefix_cache_hits, t.prefix_cache_queries
        rate = f"{hits / queries:.0%}" if queries else "-"
        unit = "tokens" if trace.is_v1 else "blocks"
        rows.append(("prefix cache", f"{hits} of {queries} {unit} looked up were hits ({rate})"))
        if trace.is_v1 and t.resumed_queries:
            rows.append(
                (
                    "resumed lookups",
                    f"{t.resumed_hits} of {t.resumed_queries} tokens of preempted requests "
                    "were still cached",
                )
            )
    if used:
        mean, peak = sum(used) / len(used), max(used)
        rows.append(
            (
                "KV-cache use",
                f"mean {mean:.0%}, peak {peak:.0%} of {trace.usable_gpu_blocks} blocks",
            )
        )
        rows.append(("use per step", sparkline(used)))
    table = Table(title="totals", title_justify="left", show_header=False)
    table.add_column()
    table.add_column()
    for name, value in rows:
        add_plain_row(table, name, value)
    return table


def summary(trace: Trace, console: Console | None = None) -> None:
    console = console or Console()
    header = trace.header
    cache = header["cache_config"]
    title = Text(
        f"{header['model']}{' (dry run)' if header['dry_run'] else ''}"
        f"{' (V1)' if trace.is_v1 else ''}: "
        f"{cache['num_gpu_blocks']} blocks of {cache['block_size']} tokens",
        style="bold",
    )
    console.print(Group(title, request_table(trace), totals(trace)))
