"""KV-cache efficiency: how much of the reserved KV memory holds live tokens.

The throughput workload (64 requests, prompts and outputs of 16-256
tokens) under one fixed KV budget (default: 16 x max_model_len = 8192
token slots), three ways:

- paged (our engine): the dry run (`dry_run=True`: the real scheduler and
  block manager, no model) hands out 16-token blocks as sequences grow.
  After every step, reserved = blocks in use (the engine's
  `Stats.gpu_cache_usage` x pool size) x block size; live = the tokens whose
  K/V are in the cache (each running sequence's computed tokens). Only the
  last block of each sequence can be partly empty.
- contiguous, max_model_len: each admitted request reserves max_model_len
  slots up front, as a static-batching server must when it cannot know how
  long the output will be; simulated step by step with the engine's rules
  (first come first served, one token per step, the same token budget).
- contiguous, exact length: the same, but each request reserves exactly its
  prompt + output length, as if the output length were known in advance;
  the best a contiguous reservation can do.

Also: the largest batch each fits in the budget (the most requests running
at once). The dry run is exact here: token counts, not timings, so one run
gives the figures for any machine.

    python -m tools.bench.kv_efficiency
    python -m tools.bench.kv_efficiency --quick
"""

from __future__ import annotations

import argparse
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from minivllm import LLM, SamplingParams
from tools.bench.common import (
    BLOCK_SIZE,
    BenchRequest,
    WorkloadSpec,
    add_workload_args,
    make_bench_model,
    plot_path,
    print_table,
    sample_requests,
    workload_spec,
    write_result,
)


@dataclass
class StepUsage:
    """KV slots after one step: reserved by running requests, and live."""

    reserved: int
    live: int
    num_running: int

    @property
    def utilization(self) -> float:
        return self.live / self.reserved


@dataclass
class SchemeResult:
    scheme: str
    steps: list[StepUsage]
    num_preemptions: int = 0

    def summary(self) -> dict:
        """Time-weighted utilisation (all live over all reserved slot-steps),
        the worst step, and batch sizes."""
        reserved = sum(s.reserved for s in self.steps)
        return {
            "scheme": self.scheme,
            "utilization": sum(s.live for s in self.steps) / reserved,
            "min_utilization": min(s.utilization for s in self.steps),
            "max_batch": max(s.num_running for s in self.steps),
            "mean_batch": sum(s.num_running for s in self.steps) / len(self.steps),
            "steps": len(self.steps),
            "preemptions": self.num_preemptions,
        }


def paged_usage(
    model_dir: str,
    requests: list[BenchRequest],
    budget_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> SchemeResult:
    """Run the workload in the dry-run engine; read its KV use after each step."""
    llm = LLM(
        model_dir,
        dry_run=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=budget_tokens // BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        swap_space=0,
    )
    engine = llm.llm_engine
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids}, params)
    num_blocks = engine.scheduler.block_manager.num_total_gpu_blocks
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_stats()
        used_blocks = round(stats.gpu_cache_usage * num_blocks)
        running = [
            seq
            for group in engine.scheduler.running
            for seq in group.get_seqs()
            if not seq.is_finished()
        ]
        if used_blocks:
            live = sum(seq.data.num_computed_tokens for seq in running)
            steps.append(StepUsage(used_blocks * BLOCK_SIZE, live, len(running)))
    return SchemeResult("paged (engine)", steps, engine.stat_logger.total_preemptions)


def contiguous_usage(
    requests: list[BenchRequest],
    budget_tokens: int,
    reserve: Callable[[BenchRequest], int],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    scheme: str,
) -> SchemeResult:
    """Continuous batching over per-request contiguous reservations of
    `reserve(request)` slots, with the engine's rules: running requests
    decode one token each step; then waiting ones are admitted in arrival
    order while their reservation, the sequence limit and the step's token
    budget allow. A prefill samples the first output token; a request is
    freed at the end of the step that samples its last."""
    waiting = deque(requests)
    running: dict[int, list] = {}  # id(request) -> [request, computed tokens, outputs]
    free, steps = budget_tokens, []
    while waiting or running:
        tokens = 0
        for state in running.values():
            state[1] += 1
            state[2] += 1
            tokens += 1
        while waiting and len(running) < max_num_seqs:
            r = waiting[0]
            prompt_len = len(r.prompt_token_ids)
            if reserve(r) > free or tokens + prompt_len > max_num_batched_tokens:
                break
            waiting.popleft()
            free -= reserve(r)
            tokens += prompt_len
            running[id(r)] = [r, prompt_len, 1]
        if not running:
            raise ValueError(f"a request needs more than the {budget_tokens}-slot budget")
        for key, (r, _, outputs) in list(running.items()):
            if outputs == r.output_len:
                free += reserve(r)
                del running[key]
        if running:
            live = sum(state[1] for state in running.values())
            steps.append(StepUsage(budget_tokens - free, live, len(running)))
    return SchemeResult(scheme, steps)


def run_kv_efficiency(
    model_dir: str,
    spec: WorkloadSpec,
    budget_seqs: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    vocab_size: int,
) -> list[SchemeResult]:
    requests = sample_requests(spec, vocab_size)
    max_len = spec.max_model_len
    budget = budget_seqs * max_len
    return [
        paged_usage(model_dir, requests, budget, max_num_seqs, max_len, max_num_batched_tokens),
        contiguous_usage(
            requests,
            budget,
            lambda r: max_len,
            max_num_seqs,
            max_num_batched_tokens,
            "contiguous, max_model_len",
        ),
        contiguous_usage(
            requests,
            budget,
            lambda r: r.total_len,
            max_num_seqs,
            max_num_batched_tokens,
            "contiguous, exact length",
        ),
    ]


def plot(results: list[SchemeResult], budget_tokens: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_util, ax_batch) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        xs = range(1, len(r.steps) + 1)
        ax_util.plot(xs, [s.utilization * 100 for s in r.steps], label=r.scheme)
        ax_batch.plot(xs, [s.num_running for s in r.steps], label=r.scheme)
    ax_util.set(
        xlabel="engine step",
        ylabel="live tokens / reserved slots (%)",
        ylim=(0, 105),
        title=f"KV utilisation, budget {budget_tokens} token slots",
    )
    ax_batch.set(xlabel="engine step", ylabel="requests running", title="batch size")
    for ax in (ax_util, ax_batch):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_requests=64)
    parser.add_argument(
        "--budget-seqs",
        type=int,
        default=16,
        help="the KV budget, in requests of max_model_len tokens",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: the number of requests (only memory limits the batch)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="16 requests of 16-64 + 16-64")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len, args.budget_seqs = (
            16,
            [16, 64],
            [16, 64],
            4,
        )
    spec = workload_spec(args)
    max_num_seqs = args.max_num_seqs or args.num_requests
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bench_model("tiny", tmp)  # the dry run reads only config + tokenizer
        vocab = LLM(model_dir, dry_run=True).llm_engine.model_config.hf_config.vocab_size
        results = run_kv_efficiency(
            model_dir, spec, args.budget_seqs, max_num_seqs, args.max_num_batched_tokens, vocab
        )
    budget = args.budget_seqs * spec.max_model_len
    summaries = [r.summary() for r in results]
    print_table(
        [
            {
                "scheme": s["scheme"],
                "utilisation %": s["utilization"] * 100,
                "worst step %": s["min_utilization"] * 100,
                "max batch": s["max_batch"],
                "mean batch": s["mean_batch"],
                "steps": s["steps"],
                "preemptions": s["preemptions"],
            }
            for s in summaries
        ],
        title=f"KV cache: {budget} token slots ({args.budget_seqs} x max_model_len "
        f"{spec.max_model_len}), {spec.num_requests} requests",
    )
    payload = {
        "workload": {**asdict(spec), "max_model_len": spec.max_model_len},
        "budget_tokens": budget,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "summary": summaries,
        "per_step": {
            r.scheme: {
                f: [getattr(s, f) for s in r.steps] for f in ("reserved", "live", "num_running")
            }
            for r in results
        },
    }
    out = write_result("kv_efficiency", payload, args.json)
    if not args.no_plot:
        plot(results, budget, plot_path("kv_efficiency", args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
