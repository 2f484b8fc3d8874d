"""Step-cost scaling: what the engine's own bookkeeping costs per running sequence.

With the model-free dry run (`LLM(model, dry_run=True)`: the real
scheduler, block manager and output processing, a hash for a model), N
requests are prefilled together and then decode together. For each decode
step in which all N run we time its three phases: schedule (the scheduler
and block manager: queues, budgets, slots, block tables, the batch's
metadata), execute (the dry run's stand-in for the model: not the engine's
cost, left out) and process (append, detokenize, stop checks, frees,
outputs, stats); we report the median over the steps, in µs per sequence
per step, from the least disturbed of `--repeats` runs.

Times are CPU time of the engine's thread (`time.thread_time`), so that
other processes on a shared machine, which take the CPU away in the middle
of a step, do not count; the wall time of schedule + process is reported
beside it. The phases are timed by wrapping `scheduler.schedule` and
`worker.execute_model` of this engine; process is the rest of `step()`.

Then the same on the V1 engine (`use_v1=True`), which has no dry run: it
runs the model (the tiny one), whose time is left out. Its phases are
schedule (`Scheduler.schedule`), prepare (the worker's `_update_states`
and `_prepare_inputs`: applying the step's diff to the persistent batch
and gathering the inputs; the classic dry run builds no inputs, so it has
no twin there), update (`Scheduler.update_from_output`) and process (the
front end: detokenize, stop strings, outputs). schedule + update + process
is what compares with the classic engine's schedule + process.

If the bookkeeping is linear in N, µs/seq/step stays flat from 16 to 1024
sequences; a quadratic term would make it grow with N. With prefix caching
each step also hashes the blocks that fill up; the prompts share their
first block so that the cache is used, not just consulted.

    python -m tools.bench.step_cost            # 16, 64, 256, 1024 sequences
    python -m tools.bench.step_cost --quick    # 16, 64, 256; fewer steps
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from minivllm import LLM, SamplingParams
from tools.bench.common import (
    BLOCK_SIZE,
    make_bench_model,
    plot_path,
    print_table,
    write_result,
)

PROMPT_LEN = 32  # two blocks: one shared prefix block, one of the request's own


@dataclass
class StepCost:
    num_seqs: int
    prefix_caching: bool
    steps: int
    schedule_us_per_seq: float  # CPU time
    process_us_per_seq: float  # CPU time
    total_us_per_seq: float  # CPU time, schedule + process
    total_wall_us_per_seq: float  # wall time, schedule + process
    dry_model_us_per_seq: float  # execute, CPU time: the dry run's hash, not the engine's cost


class _Timed:
    """Wraps a callable; keeps the (CPU, wall) seconds and result of its last call."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.cpu = self.wall = 0.0
        self.result = None

    def __call__(self, *args, **kwargs):
        cpu, wall = time.thread_time(), time.perf_counter()
        self.result = self.fn(*args, **kwargs)
        self.cpu, self.wall = time.thread_time() - cpu, time.perf_counter() - wall
        return self.result


def measure_step_cost(
    model_dir: str, num_seqs: int, prefix_caching: bool, num_steps: int, vocab_size: int
) -> StepCost:
    """Median phase times over `num_steps` decode steps of `num_seqs` sequences."""
    # The prefill samples the first token; then num_steps + 2 decode steps,
    # of which the first (warm-up) and the last (it finishes every request:
    # frees, final outputs) are left out.
    max_tokens = num_steps + 3
    blocks_per_seq = -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE)
    llm = LLM(
        model_dir,
        dry_run=True,
        block_size=BLOCK_SIZE,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(num_seqs * PROMPT_LEN, 2048),
        num_gpu_blocks_override=num_seqs * blocks_per_seq + 64,
        enable_prefix_caching=prefix_caching,
    )
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule = _Timed(engine.scheduler.schedule)
    execute = engine.worker.execute_model = _Timed(engine.worker.execute_model)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    shared = [2 + i % (vocab_size - 2) for i in range(BLOCK_SIZE)]
    for i in range(num_seqs):
        own = [2 + (i * 31 + j * 7) % (vocab_size - 2) for j in range(PROMPT_LEN - BLOCK_SIZE)]
        engine.add_request(str(i), {"prompt_token_ids": shared + own}, params)
    steps = []  # (schedule, process, execute) CPU seconds, schedule + process wall seconds
    while engine.has_unfinished_requests():
        cpu, wall = time.thread_time(), time.perf_counter()
        engine.step()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        outputs = schedule.result[1]
        if outputs.num_prefill_groups == 0 and len(outputs.scheduled_seq_groups) == num_seqs:
            process = cpu - schedule.cpu - execute.cpu
            steps.append((schedule.cpu, process, execute.cpu, wall - execute.wall))
    steps = steps[1:-1]

    def us_per_seq(values) -> float:
        return statistics.median(values) * 1e6 / num_seqs

    return StepCost(
        num_seqs,
        prefix_caching,
        len(steps),
        schedule_us_per_seq=us_per_seq(s[0] for s in steps),
        process_us_per_seq=us_per_seq(s[1] for s in steps),
        total_us_per_seq=us_per_seq(s[0] + s[1] for s in steps),
        total_wall_us_per_seq=us_per_seq(s[3] for s in steps),
        dry_model_us_per_seq=us_per_seq(s[2] for s in steps),
    )


@dataclass
class StepCostV1:
    num_seqs: int
    prefix_caching: bool
    steps: int
    schedule_us_per_seq: float  # CPU time, as the classic rows
    prepare_us_per_seq: float  # the worker's _update_states + _prepare_inputs
    update_us_per_seq: float  # Scheduler.update_from_output
    process_us_per_seq: float  # the front end's output processing
    total_us_per_seq: float  # schedule + update + process: the classic rows' total
    model_us_per_seq: float  # forward, logits, sampling: not the engine's cost


def measure_step_cost_v1(
    model_dir: str, num_seqs: int, prefix_caching: bool, num_steps: int, vocab_size: int
) -> StepCostV1:
    """As `measure_step_cost`, on V1 with its real (tiny) model."""
    max_tokens = num_steps + 3
    blocks_per_seq = -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE)
    llm = LLM(
        model_dir,
        use_v1=True,
        block_size=BLOCK_SIZE,
        max_model_len=PROMPT_LEN + max_tokens,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(num_seqs * PROMPT_LEN, 2048),
        num_gpu_blocks_override=num_seqs * blocks_per_seq + 65,  # + V1's null block
        enable_prefix_caching=prefix_caching,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.model_runner
    step = core.step = _Timed(core.step)
    schedule = core.scheduler.schedule = _Timed(core.scheduler.schedule)
    update = core.scheduler.update_from_output = _Timed(core.scheduler.update_from_output)
    execute = core.model_executor.execute_model = _Timed(core.model_executor.execute_model)
    update_states = runner._update_states = _Timed(runner._update_states)
    prepare_inputs = runner._prepare_inputs = _Timed(runner._prepare_inputs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    shared = [2 + i % (vocab_size - 2) for i in range(BLOCK_SIZE)]
    for i in range(num_seqs):
        own = [2 + (i * 31 + j * 7) % (vocab_size - 2) for j in range(PROMPT_LEN - BLOCK_SIZE)]
        engine.add_request(str(i), {"prompt_token_ids": shared + own}, params)
    steps = []  # (schedule, prepare, update, process, model) CPU seconds
    while engine.has_unfinished_requests():
        cpu = time.thread_time()
        engine.step()
        cpu = time.thread_time() - cpu
        scheduled = schedule.result.num_scheduled_tokens
        if len(scheduled) == num_seqs and schedule.result.total_num_scheduled_tokens == num_seqs:
            prepare = update_states.cpu + prepare_inputs.cpu
            steps.append(
                (schedule.cpu, prepare, update.cpu, cpu - step.cpu, execute.cpu - prepare)
            )
    steps = steps[1:-1]

    def us_per_seq(values) -> float:
        return statistics.median(values) * 1e6 / num_seqs

    return StepCostV1(
        num_seqs,
        prefix_caching,
        len(steps),
        schedule_us_per_seq=us_per_seq(s[0] for s in steps),
        prepare_us_per_seq=us_per_seq(s[1] for s in steps),
        update_us_per_seq=us_per_seq(s[2] for s in steps),
        process_us_per_seq=us_per_seq(s[3] for s in steps),
        total_us_per_seq=us_per_seq(s[0] + s[2] + s[3] for s in steps),
        model_us_per_seq=us_per_seq(s[4] for s in steps),
    )


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of y = slope * x + intercept."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def plot(results: list[StepCost], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_seq) = plt.subplots(1, 2, figsize=(11, 4))
    for caching, color in ((False, "tab:blue"), (True, "tab:orange")):
        rows = [r for r in results if r.prefix_caching == caching]
        ns = [r.num_seqs for r in rows]
        label = "prefix caching" if caching else "no prefix caching"
        ax_step.plot(
            ns,
            [r.total_us_per_seq * r.num_seqs / 1e3 for r in rows],
            "o-",
            color=color,
            label=label,
        )
        ax_seq.plot(
            ns, [r.schedule_us_per_seq for r in rows], "o-", color=color, label=f"schedule, {label}"
        )
        ax_seq.plot(
            ns,
            [r.total_us_per_seq for r in rows],
            "s--",
            color=color,
            label=f"schedule + process, {label}",
        )
    ax_step.set(
        xlabel="running sequences",
        ylabel="CPU ms per step",
        title="schedule + process per decode step",
    )
    ax_seq.axhline(10, color="grey", ls=":", lw=1, label="target: scheduler + block manager")
    ax_seq.set_xscale("log", base=2)
    ns = sorted({r.num_seqs for r in results})
    ax_seq.set_xticks(ns, [str(n) for n in ns])
    ax_seq.set(
        xlabel="running sequences",
        ylabel="CPU µs per sequence per step",
        title="per sequence: flat = linear",
    )
    ax_seq.set_ylim(bottom=0)
    for ax in (ax_step, ax_seq):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=40, help="decode steps measured per run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per point; the least disturbed is kept"
    )
    parser.add_argument("--quick", action="store_true", help="16, 64, 256 sequences, 15 steps")
    parser.add_argument("--json", help="result path (default: tools/bench/results/)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    num_seqs, steps = (args.num_seqs, args.steps) if not args.quick else ([16, 64, 256], 15)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bench_model("tiny", tmp)  # the dry run reads only config + tokenizer
        vocab_size = LLM(model_dir, dry_run=True).llm_engine.model_config.hf_config.vocab_size
        measure_step_cost(model_dir, 16, False, 3, vocab_size)  # warm-up: imports, caches
        results = [
            min(
                (
                    measure_step_cost(model_dir, n, caching, steps, vocab_size)
                    for _ in range(args.repeats)
                ),
                key=lambda r: r.total_us_per_seq,
            )
            for caching in (False, True)
            for n in num_seqs
        ]
        measure_step_cost_v1(model_dir, 16, True, 3, vocab_size)  # warm-up
        results_v1 = [
            min(
                (
                    measure_step_cost_v1(model_dir, n, caching, steps, vocab_size)
                    for _ in range(args.repeats)
                ),
                key=lambda r: r.total_us_per_seq,
            )
            for caching in (False, True)
            for n in num_seqs
        ]
    fits = {}
    # A line needs two sizes at least; with one (`--num-seqs 256`) there is no fit.
    for caching in (False, True) if len(set(num_seqs)) > 1 else ():
        rows = [r for r in results if r.prefix_caching == caching]
        slope, intercept = linear_fit(
            [r.num_seqs for r in rows], [r.total_us_per_seq * r.num_seqs for r in rows]
        )
        fits["prefix_caching" if caching else "no_prefix_caching"] = {
            "us_per_seq": slope,
            "us_fixed": intercept,
        }
    print_table(
        [
            {
                "seqs": r.num_seqs,
                "prefix caching": "on" if r.prefix_caching else "off",
                "steps": r.steps,
                "schedule µs/seq": r.schedule_us_per_seq,
                "process µs/seq": r.process_us_per_seq,
                "total µs/seq": r.total_us_per_seq,
                "total wall µs/seq": r.total_wall_us_per_seq,
                "(dry model µs/seq)": r.dry_model_us_per_seq,
            }
            for r in results
        ],
        title="Engine bookkeeping per decode step (dry run): CPU µs per sequence, median of steps",
    )
    for name, fit in fits.items():
        print(
            f"linear fit, {name}: {fit['us_per_seq']:.2f} µs per sequence "
            f"+ {fit['us_fixed']:.0f} µs per step"
        )
    print_table(
        [
            {
                "seqs": r.num_seqs,
                "prefix caching": "on" if r.prefix_caching else "off",
                "steps": r.steps,
                "schedule µs/seq": r.schedule_us_per_seq,
                "update µs/seq": r.update_us_per_seq,
                "process µs/seq": r.process_us_per_seq,
                "total µs/seq": r.total_us_per_seq,
                "prepare µs/seq": r.prepare_us_per_seq,
                "(model µs/seq)": r.model_us_per_seq,
            }
            for r in results_v1
        ],
        title="V1 bookkeeping per decode step: CPU µs per sequence, median of steps "
        "(total = schedule + update + process; prepare: the persistent batch and inputs)",
    )
    classic = {(r.num_seqs, r.prefix_caching): r.total_us_per_seq for r in results}
    for r in results_v1:
        ratio = r.total_us_per_seq / classic[(r.num_seqs, r.prefix_caching)]
        caching = "on" if r.prefix_caching else "off"
        print(f"V1 / classic total, {r.num_seqs} seqs, prefix caching {caching}: {ratio:.2f}x")
    payload = {
        "results": [asdict(r) for r in results],
        "linear_fit": fits,
        "results_v1": [asdict(r) for r in results_v1],
    }
    out = write_result("step_cost", payload, args.json)
    if not args.no_plot:
        plot(results, plot_path("step_cost", args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
