"""Offline throughput: the engine against Hugging Face `generate` with static batches.

One seeded workload (default: 64 requests, prompts of 16-256 tokens,
outputs of 16-256 tokens, `ignore_eos`) on a random ~20M-parameter Llama in
float32, saved once and loaded by both the engine and Hugging Face. Every
run is timed in this process, one after the other, on the same weights:

- engine, batch B: our engine, `max_num_seqs` = B, with exactly the KV
  memory that static batches of B requests reserve (B x max_model_len);
- HF static, batch B: `generate` on batches of B requests in arrival order,
  left-padded, greedy; each batch runs until its longest request is done,
  and finished rows keep computing (their extra tokens are not counted);
- engine, KV K x max_model_len / HF static, batch K: the same KV memory
  for both, a budget of K x max_model_len token slots. Static batching
  must reserve max_model_len for each request, so its batch is K; the
  engine hands out 16-token blocks as they fill, keeping `max_num_seqs` = B;
- HF one at a time: `generate` on each request alone (no padding), on the
  first `--single-requests` requests of the workload only (it is slow),
  against the engine's throughput on the whole workload;
- V1, batch B and V1, KV K x max_model_len: the same two engine runs on the
  V1 engine (`use_v1=True`, minivllm/v1/) with its defaults (prefix caching
  and chunked prefill on, 8192 tokens a step), given one block more than
  the classic engine: V1 keeps block 0 as its null block.

Throughput is generated tokens (each request's own output length) per
second of wall time, prompt processing included. Greedy tokens are
compared with HF's: random weights have near-ties that float rounding can
flip, so we report the share of requests that agree exactly and where the
others first diverge, rather than fail.

    python -m tools.bench.throughput                 # the CPU workload above
    python -m tools.bench.throughput --quick         # 16 requests of 16-64 + 16-64
    python -m tools.bench.throughput --model-size 0.5b --device cuda --num-requests 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM

from minivllm import LLM, SamplingParams
from tools.bench.common import (
    BenchRequest,
    WorkloadSpec,
    add_model_args,
    add_workload_args,
    make_bench_model,
    plot_path,
    print_table,
    sample_requests,
    set_threads,
    timed,
    workload_spec,
    write_result,
)

BLOCK_SIZE = 16
PAD_TOKEN_ID = 0  # left padding; masked out by the attention mask


@dataclass
class RunResult:
    name: str
    batch_size: int
    kv_cache_tokens: int  # KV slots the run may use: blocks x block size, or rows x max_model_len
    num_requests: int
    output_tokens: int
    seconds: float
    # Token positions the model ran (prompts, padding, outputs, recomputes):
    # on a compute-bound CPU, time follows this more than anything else.
    computed_tokens: int
    num_preemptions: int | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class StaticBatch:
    """One left-padded batch: what HF `generate` is given."""

    input_ids: torch.Tensor  # [rows, longest prompt]
    attention_mask: torch.Tensor
    max_new_tokens: int  # the longest output in the batch: every row runs this long

    @property
    def padding_tokens(self) -> int:
        return int((self.attention_mask == 0).sum())


def make_static_batch(requests: list[BenchRequest]) -> StaticBatch:
    longest = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), longest), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(requests), longest), dtype=torch.long)
    for row, r in enumerate(requests):
        n = len(r.prompt_token_ids)
        ids[row, longest - n :] = torch.tensor(r.prompt_token_ids)
        mask[row, longest - n :] = 1
    return StaticBatch(ids, mask, max(r.output_len for r in requests))


def hf_static(hf, requests: list[BenchRequest], batch_size: int, max_model_len: int) -> RunResult:
    """Hugging Face greedy `generate`, `batch_size` requests at a time."""
    outputs, computed, seconds = [], 0, 0.0
    for start in range(0, len(requests), batch_size):
        chunk = requests[start : start + batch_size]
        batch = make_static_batch(chunk)
        with torch.inference_mode():
            out, took = timed(
                lambda b=batch: hf.generate(
                    b.input_ids.to(hf.device),
                    attention_mask=b.attention_mask.to(hf.device),
                    do_sample=False,
                    max_new_tokens=b.max_new_tokens,
                    min_new_tokens=b.max_new_tokens,
                    eos_token_id=None,
                    pad_token_id=PAD_TOKEN_ID,
                )
            )
        seconds += took
        new = out[:, batch.input_ids.shape[1] :].tolist()
        outputs += [row[: r.output_len] for row, r in zip(new, chunk, strict=True)]
        # The padded prefill, then one step per new token but the last.
        computed += batch.input_ids.numel() + len(chunk) * (batch.max_new_tokens - 1)
    name = "HF one at a time" if batch_size == 1 else f"HF static, batch {batch_size}"
    return RunResult(
        name,
        batch_size,
        batch_size * max_model_len,
        len(requests),
        sum(r.output_len for r in requests),
        seconds,
        computed,
        outputs=outputs,
    )


def make_engine(
    model_dir: str,
    max_num_seqs: int,
    kv_cache_tokens: int,
    max_model_len: int,
    use_v1: bool = False,
    **kw,
):
    if use_v1:  # the same usable blocks: V1's block 0 is its null block
        kw.update(use_v1=True, num_gpu_blocks_override=kv_cache_tokens // BLOCK_SIZE + 1)
    else:
        kw.update(swap_space=0, num_gpu_blocks_override=kv_cache_tokens // BLOCK_SIZE)
    return LLM(
        model_dir,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        block_size=BLOCK_SIZE,
        seed=0,
        **kw,
    )


def engine_counters(llm: LLM) -> tuple[int, int]:
    """(preemptions, token positions computed) so far, from either engine."""
    engine = llm.llm_engine
    if hasattr(engine, "stat_logger"):  # classic
        stats = engine.stat_logger
        return stats.total_preemptions, stats.total_prefill_tokens + stats.total_decode_tokens
    return engine.total_preemptions, engine.total_scheduled_tokens


def engine_run(
    llm: LLM, requests: list[BenchRequest], name: str, batch_size: int, kv_cache_tokens: int
) -> RunResult:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    before = engine_counters(llm)
    outs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    after = engine_counters(llm)
    return RunResult(
        name,
        batch_size,
        kv_cache_tokens,
        len(requests),
        sum(len(o.outputs[0].token_ids) for o in outs),
        seconds,
        after[1] - before[1],
        num_preemptions=after[0] - before[0],
        outputs=[list(o.outputs[0].token_ids) for o in outs],
    )


def warm_up(llm: LLM, hf, requests: list[BenchRequest]) -> None:
    """Compile the Numba kernel and fault in the allocators before timing:
    the first two requests, cut to 4 output tokens, in both."""
    warm = [BenchRequest(r.prompt_token_ids, min(4, r.output_len)) for r in requests[:2]]
    engine_run(llm, warm, "warm-up", 2, 0)
    batch = make_static_batch(warm)
    with torch.inference_mode():
        hf.generate(
            batch.input_ids.to(hf.device),
            attention_mask=batch.attention_mask.to(hf.device),
            do_sample=False,
            max_new_tokens=batch.max_new_tokens,
            pad_token_id=PAD_TOKEN_ID,
        )


@dataclass
class Agreement:
    """How far our greedy tokens agree with a reference run's."""

    compared: int
    identical: int
    first_divergence: list[int]  # output position, for each request that diverges

    @property
    def fraction(self) -> float:
        return self.identical / self.compared if self.compared else float("nan")

    def summary(self) -> dict:
        d = self.first_divergence
        return {
            "compared": self.compared,
            "identical": self.identical,
            "fraction_identical": self.fraction,
            "first_divergence_min": min(d) if d else None,
            "first_divergence_median": statistics.median(d) if d else None,
        }


def agreement(ours: list[list[int]], reference: list[list[int]]) -> Agreement:
    diverge = []
    for a, b in zip(ours, reference, strict=False):
        pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        if pos is not None:
            diverge.append(pos)
    compared = min(len(ours), len(reference))
    return Agreement(compared, compared - len(diverge), diverge)


@dataclass
class ThroughputResult:
    model: dict
    workload: dict
    runs: list[RunResult]
    ratios: dict
    compute_ratios: dict
    agreement: dict


def run_throughput(
    model_dir: str,
    spec: WorkloadSpec,
    max_num_seqs: int,
    budget_seqs: int,
    single_requests: int,
    device: str = "cpu",
    dtype: str = "float32",
) -> ThroughputResult:
    """Every run of the module docstring, side by side."""
    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    vocab = hf.config.vocab_size
    requests = sample_requests(spec, vocab)
    max_len = spec.max_model_len
    batch_kv, budget_kv = max_num_seqs * max_len, budget_seqs * max_len


    def run_engine(use_v1: bool, kv_tokens: int, name: str) -> RunResult:
        llm = make_engine(
            model_dir, max_num_seqs, kv_tokens, max_len, use_v1, device=device, dtype=dtype
        )
        warm_up(llm, hf, requests)
        if use_v1:  # the warm-up's prompts must not give V1 free prefix hits
            assert llm.llm_engine.reset_prefix_cache()
        return engine_run(llm, requests, name, max_num_seqs, kv_tokens)

    budget_name = f"KV {budget_seqs}x{max_len}"
    ours_batch = run_engine(False, batch_kv, f"engine, batch {max_num_seqs}")
    ours_budget = run_engine(False, budget_kv, f"engine, {budget_name}")
    v1_batch = run_engine(True, batch_kv, f"V1, batch {max_num_seqs}")
    v1_budget = run_engine(True, budget_kv, f"V1, {budget_name}")
    hf_batch = hf_static(hf, requests, max_num_seqs, max_len)
    hf_budget = hf_static(hf, requests, budget_seqs, max_len)
    hf_single = hf_static(hf, requests[:single_requests], 1, max_len)

    ratios = {
        "equal_batch": ours_batch.tokens_per_s / hf_batch.tokens_per_s,
        "equal_kv_memory": ours_budget.tokens_per_s / hf_budget.tokens_per_s,
        "vs_one_at_a_time": ours_batch.tokens_per_s / hf_single.tokens_per_s,
        "v1_over_classic_equal_batch": v1_batch.tokens_per_s / ours_batch.tokens_per_s,
        "v1_over_classic_equal_kv_memory": v1_budget.tokens_per_s / ours_budget.tokens_per_s,
    }
    # How many more token positions static batching runs for the same output.
    compute = {
        "equal_batch": hf_batch.computed_tokens / ours_batch.computed_tokens,
        "equal_kv_memory": hf_budget.computed_tokens / ours_budget.computed_tokens,
    }
    agree = {
        "engine_vs_hf_one_at_a_time": agreement(ours_batch.outputs, hf_single.outputs).summary(),
        "engine_vs_hf_static_batch": agreement(ours_batch.outputs, hf_batch.outputs).summary(),
        "engine_batch_vs_engine_budget": agreement(
            ours_batch.outputs, ours_budget.outputs
        ).summary(),
        "v1_vs_engine_batch": agreement(v1_batch.outputs, ours_batch.outputs).summary(),
        "v1_budget_vs_engine_budget": agreement(v1_budget.outputs, ours_budget.outputs).summary(),
    }
    model = {
        "architecture": hf.config.architectures[0],
        "parameters": sum(p.numel() for p in hf.parameters()),
        "hidden_size": hf.config.hidden_size,
        "num_hidden_layers": hf.config.num_hidden_layers,
        "vocab_size": vocab,
        "dtype": dtype,
        "device": device,
    }
    workload = {
        **asdict(spec),
        "max_model_len": max_len,
        "max_num_seqs": max_num_seqs,
        "budget_seqs": budget_seqs,
        "single_requests": single_requests,
    }
    runs = [ours_batch, hf_batch, ours_budget, hf_budget, hf_single, v1_batch, v1_budget]
    return ThroughputResult(model, workload, runs, ratios, compute, agree)


def plot(result: ThroughputResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r.name for r in result.runs]
    values = [r.tokens_per_s for r in result.runs]
    colors = ["tab:orange" if r.name.startswith("HF") else "tab:blue" for r in result.runs]
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("generated tokens / s")
    m = result.model
    ax.set_title(
        f"{m['architecture']} {m['parameters'] / 1e6:.1f}M, {m['dtype']} on {m['device']}: "
        f"{result.workload['num_requests']} requests"
    )
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_requests=64)
    add_model_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--budget-seqs",
        type=int,
        default=16,
        help="the equal-memory KV budget, in requests of max_model_len tokens",
    )
    parser.add_argument("--single-requests", type=int, default=8)
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 ...")
    parser.add_argument("--quick", action="store_true", help="16 requests of 16-64 + 16-64 tokens")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 16, [16, 64], [16, 64]
        args.max_num_seqs, args.budget_seqs, args.single_requests = 8, 2, 4
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    spec = workload_spec(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_bench_model(args.model_size, tmp)
        result = run_throughput(
            model_dir,
            spec,
            args.max_num_seqs,
            args.budget_seqs,
            args.single_requests,
            args.device,
            dtype,
        )
    rows = []
    for r in result.runs:
        rows.append(
            {
                "run": r.name,
                "requests": r.num_requests,
                "KV slots": r.kv_cache_tokens,
                "output tokens": r.output_tokens,
                "tokens computed": r.computed_tokens,
                "seconds": r.seconds,
                "tokens/s": r.tokens_per_s,
                "preemptions": "" if r.num_preemptions is None else r.num_preemptions,
            }
        )
    m = result.model
    print_table(
        rows,
        title=f"Throughput, {m['architecture']} {m['parameters'] / 1e6:.1f}M "
        f"parameters, {m['dtype']} on {m['device']}",
    )
    for name, ratio in result.ratios.items():
        extra = result.compute_ratios.get(name)
        note = f" (HF computes {extra:.2f}x the token positions)" if extra else ""
        label = name.replace("_", " ")
        label = label if name.startswith("v1") else f"engine / HF, {label}"
        print(f"{label}: {ratio:.2f}x{note}")
    for name, a in result.agreement.items():
        print(
            f"greedy agreement, {name.replace('_', ' ')}: {a['identical']}/{a['compared']} "
            f"identical; first divergence min {a['first_divergence_min']}, "
            f"median {a['first_divergence_median']}"
        )
    payload = {
        "model": result.model,
        "workload": result.workload,
        "runs": [
            {
                **{k: v for k, v in asdict(r).items() if k != "outputs"},
                "tokens_per_s": r.tokens_per_s,
            }
            for r in result.runs
        ],
        "ratios": result.ratios,
        "computed_tokens_hf_over_engine": result.compute_ratios,
        "greedy_agreement": result.agreement,
    }
    out = write_result("throughput", payload, args.json)
    if not args.no_plot:
        plot(result, plot_path("throughput", args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
