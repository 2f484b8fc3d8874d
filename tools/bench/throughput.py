"""Offline throughput: the engine against HF continuous batching, static batches, one at a time.

One seeded workload (default: 64 requests, prompts of 16-256 tokens,
outputs of 16-256 tokens, `ignore_eos`) on a random ~20M-parameter Llama in
float32, saved once and loaded by both the engine and Hugging Face. Every
run is timed in this process, on the same weights.

The peers, each run `--repeats` times, interleaved (engine, HF, HF, HF,
then again), so that a slow spell of a shared machine falls on all of them;
each reports its median tokens/s and its spread, (max - min) / median. The
ratios engine / peer are of the medians, and also given repetition by
repetition (a pair ran back to back, so a slow spell moves both):

- engine, batch B: our engine, `max_num_seqs` = B, with exactly the KV
  memory that static batches of B requests reserve (B x max_model_len);
  with `--v1`, V1 in its place (`use_v1=True`, with its defaults: prefix
  caching, emptied before each run, and chunked prefill, 4096 tokens a step
  on a CPU);
- HF generate_batch, batch B: transformers' continuous batching, the
  manager behind `model.generate_batch`, on the same terms as the engine: a
  paged cache of 16-token blocks, as many blocks as the engine's KV budget,
  the engine's tokens per step (`max_batch_tokens` =
  `max_num_batched_tokens`), at most B requests a step
  (`max_requests_per_batch`), prefix sharing off (the engine's default),
  greedy, EOS ignored, and each request its own `max_new_tokens`, given
  through the manager's `add_request` (`generate_batch` takes one length for
  all). Run at B = `max_num_seqs` (matched settings) and, in the first
  repetition, at every size of `--hf-cb-batch-sizes`: the fastest is HF's
  best batch size, repeated with the others;
- HF static, batch B: `generate` on batches of B requests in arrival order,
  left-padded, greedy; each batch runs until its longest request is done,
  and finished rows keep computing (their extra tokens are not counted).

Once each:

- HF one at a time: `generate` on each request alone (no padding), on the
  first `--single-requests` requests of the workload only (it is slow),
  against the engine's throughput on the whole workload;
- with `--extra-runs` (on with `--quick`): engine, KV K x max_model_len /
  HF static, batch K: the same KV memory for both, a budget of K x
  max_model_len token slots. Static batching must reserve max_model_len for
  each request, so its batch is K; the engine hands out 16-token blocks as
  they fill, keeping `max_num_seqs` = B. Then V1, batch B and V1, KV K x
  max_model_len: the two engine runs on the V1 engine (`use_v1=True`,
  minivllm/v1/) with its defaults (prefix caching and chunked prefill on,
  4096 tokens a step on a CPU), given one block more than the classic engine: V1
  keeps block 0 as its null block.

Throughput is generated tokens (each request's own output length) per
second of wall time, prompt processing included. Greedy tokens are
compared with HF's: random weights have near-ties that float rounding can
flip, so we report the share of requests that agree exactly and where the
others first diverge, rather than fail.

    python -m tools.bench.throughput                 # the CPU workload above (7-9 min)
    python -m tools.bench.throughput --quick         # 16 requests of 16-64 + 16-64
    python -m tools.bench.throughput --repeats 5 --hf-cb-batch-sizes 8 16 32 64 --extra-runs
    python -m tools.bench.throughput --compilation-level 3   # the engine's model compiled
    python -m tools.bench.throughput --v1            # the repeated engine runs on V1
    python -m tools.bench.throughput --model-size 0.5b --device cuda --num-requests 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from minivllm import LLM, SamplingParams
from minivllm.v1.engine.llm_engine import resolve_multiprocess_mode
from tools.bench.common import (
    BLOCK_SIZE,
    BenchRequest,
    Repeated,
    WorkloadSpec,
    add_model_args,
    add_workload_args,
    make_bench_model,
    percentile,
    plot_path,
    print_table,
    sample_requests,
    set_threads,
    timed,
    workload_spec,
    write_result,
)

PAD_TOKEN_ID = 0  # left padding; masked out by the attention mask
NO_EOS = -1  # HF continuous batching's "no end-of-sequence token"
DEFAULT_HF_CB_BATCH_SIZES = (8, 16, 64)  # 32 was slower than 8 and 16 here: see --help


@dataclass
class RunResult:
    name: str
    batch_size: int
    kv_cache_tokens: int  # KV slots the run may use: blocks x block size, or rows x max_model_len
    num_requests: int
    output_tokens: int
    seconds: list[float]  # wall time of each repetition
    # Token positions the model ran (prompts, padding, outputs, recomputes):
    # on a compute-bound CPU, time follows this more than anything else.
    computed_tokens: int
    num_preemptions: int | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)  # the first repetition's
    repeats_identical: bool = True  # every repetition generated the same tokens

    @property
    def rates(self) -> Repeated:
        """Tokens/s of each repetition."""
        return Repeated(tuple(self.output_tokens / s for s in self.seconds))

    @property
    def tokens_per_s(self) -> float:
        """The median over the repetitions."""
        return self.rates.median

    @property
    def median_seconds(self) -> float:
        return percentile(self.seconds, 50)


def add_repetition(run: RunResult, again: RunResult) -> None:
    """Fold a later repetition of the same run into `run`: its time, and
    whether it generated the same tokens. The work must be the same: the
    same tokens out, the same token positions computed (a prefix cache
    still holding an earlier repetition's prompts would compute fewer)."""
    if (again.name, again.output_tokens, again.computed_tokens) != (
        run.name, run.output_tokens, run.computed_tokens
    ):
        raise ValueError(
            f"{again.name!r} ({again.output_tokens} tokens out, {again.computed_tokens} "
            f"computed) is not a repetition of {run.name!r} ({run.output_tokens}, "
            f"{run.computed_tokens})"
        )
    run.seconds += again.seconds
    run.repeats_identical &= again.outputs == run.outputs


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
        [seconds],
        computed,
        outputs=outputs,
    )


@contextmanager
def counting_positions(hf) -> Iterator[list[int]]:
    """Count the token positions HF's decoder runs (a one-element list, read
    it after the block): continuous batching packs a step's tokens into one
    row, [1, tokens], so the count is exact, padding included if any."""
    count = [0]

    def hook(module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        count[0] += ids.numel()

    handle = hf.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def submit_and_collect(manager, requests: list[BenchRequest], tag: str) -> list[list[int]]:
    """Give every request to a running continuous-batching manager at once,
    each with its own output length and no EOS, and wait for all of them;
    their generated tokens, in request order.

    The loop is paused while the requests are queued so that its next step
    sees all of them, as the engine's first step does (`LLM.generate` adds
    every request before stepping): queued one by one into a running loop,
    the first step would often hold only the first request."""
    with manager.pause():
        ids = [
            manager.add_request(
                r.prompt_token_ids,
                request_id=f"{tag}-{i}",
                max_new_tokens=r.output_len,
                eos_token_id=NO_EOS,
            )
            for i, r in enumerate(requests)
        ]
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("HF's continuous-batching loop stopped before the end")
            continue
        if out.error is not None:
            raise RuntimeError(f"HF request {out.request_id} failed: {out.error}")
        if out.is_finished():
            done[out.request_id] = list(out.generated_tokens)
    return [done[i] for i in ids]


def hf_cb_config(
    batch_size: int, kv_cache_tokens: int, max_batch_tokens: int
) -> ContinuousBatchingConfig:
    """HF continuous batching on the engine's terms: its block size, its
    number of blocks, its tokens per step, `batch_size` requests a step, no
    prefix sharing (the classic engine's default, and a random workload has
    no shared prefix to find)."""
    return ContinuousBatchingConfig(
        page_size=BLOCK_SIZE,
        num_blocks=kv_cache_tokens // BLOCK_SIZE,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=batch_size,
        allow_block_sharing=False,
        seed=0,
    )


def hf_continuous(
    hf,
    requests: list[BenchRequest],
    batch_size: int,
    kv_cache_tokens: int,
    max_batch_tokens: int,
) -> RunResult:
    """transformers' continuous batching (`generate_batch`'s manager), greedy.
    Setting up the manager (its paged cache is allocated here) and a warm-up
    on the first two requests are not timed, as for the engine."""
    generation = GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=PAD_TOKEN_ID)
    config = hf_cb_config(batch_size, kv_cache_tokens, max_batch_tokens)
    manager = hf.init_continuous_batching(generation, config)
    manager.warmup()  # builds the batch processor and its cache
    with torch.inference_mode(), counting_positions(hf) as positions:
        manager.start()  # the loop thread runs in the caller's inference mode
        try:
            warm = [BenchRequest(r.prompt_token_ids, min(4, r.output_len)) for r in requests[:2]]
            submit_and_collect(manager, warm, "warm-up")
            positions[0] = 0
            outputs, seconds = timed(lambda: submit_and_collect(manager, requests, "bench"))
            computed = positions[0]
        finally:
            manager.stop(block=True)
            manager.destroy()
    return RunResult(
        f"HF generate_batch, batch {batch_size}",
        batch_size,
        kv_cache_tokens,
        len(requests),
        sum(len(o) for o in outputs),
        [seconds],
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


def engine_step_tokens(llm: LLM) -> int:
    """The engine's tokens per step (`max_num_batched_tokens`): both engines
    keep their whole `engine_config`."""
    return llm.llm_engine.engine_config.scheduler_config.max_num_batched_tokens


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
    # Every run starts from an empty prefix cache (V1 has one on by default;
    # the classic engine, no reset): the warm-up's or an earlier repetition's
    # prompts must not make this run's work smaller.
    reset = getattr(llm.llm_engine, "reset_prefix_cache", None)
    if reset is not None and not reset():
        raise RuntimeError(f"{name!r}: the engine could not empty its prefix cache")
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
        [seconds],
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
    hf_cb_sweep: dict[int, float]  # batch size -> tokens/s, first repetition
    hf_cb_best_batch_size: int
    # Engine / peer, repetition by repetition (they ran back to back): a
    # slow spell of the machine moves both, so these vary less than either.
    paired_ratios: dict[str, Repeated]


def paired_ratio(ours: RunResult, peer: RunResult) -> Repeated:
    """Our tokens/s over the peer's, repetition by repetition."""
    pairs = zip(ours.rates.values, peer.rates.values, strict=True)
    return Repeated(tuple(a / b for a, b in pairs))


@dataclass
class KeyRuns:
    """The repeated runs: the engine and the three HF peers."""

    engine: RunResult
    hf_cb_matched: RunResult
    hf_cb_best: RunResult
    hf_static: RunResult
    sweep: dict[int, RunResult]  # every HF continuous-batching size, matched and best included


def run_key_runs(
    run_engine: Callable[[], RunResult],
    run_hf_cb: Callable[[int], RunResult],
    run_hf_static: Callable[[], RunResult],
    matched_batch: int,
    sweep_sizes: Sequence[int],
    repeats: int,
) -> KeyRuns:
    """The first repetition runs the engine, HF continuous batching at every
    size of the sweep (`matched_batch` included) and HF static batching; the
    sweep's fastest size is HF's best. Each later repetition runs the engine,
    HF at the matched and the best size and HF static again, in that order."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    engine = run_engine()
    sweep = {b: run_hf_cb(b) for b in sorted({*sweep_sizes, matched_batch})}
    static = run_hf_static()
    best = max(sweep.values(), key=lambda r: r.tokens_per_s)
    matched = sweep[matched_batch]
    for _ in range(repeats - 1):
        add_repetition(engine, run_engine())
        add_repetition(matched, run_hf_cb(matched_batch))
        if best is not matched:
            add_repetition(best, run_hf_cb(best.batch_size))
        add_repetition(static, run_hf_static())
    return KeyRuns(engine, matched, best, static, sweep)


def run_throughput(
    model_dir: str,
    spec: WorkloadSpec,
    max_num_seqs: int,
    budget_seqs: int,
    single_requests: int,
    device: str = "cpu",
    dtype: str = "float32",
    repeats: int = 3,
    hf_cb_batch_sizes: Sequence[int] = DEFAULT_HF_CB_BATCH_SIZES,
    extra_runs: bool = False,
    compilation_level: int = 0,
    enforce_eager: bool = False,
    use_v1: bool = False,
) -> ThroughputResult:
    """Every run of the module docstring, side by side; with `use_v1` the
    repeated engine runs are V1's."""
    if use_v1 and extra_runs:
        raise ValueError("extra_runs set V1 beside the classic engine; with use_v1 the "
                         "repeated runs are V1's already")
    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    vocab = hf.config.vocab_size
    requests = sample_requests(spec, vocab)
    max_len = spec.max_model_len
    batch_kv, budget_kv = max_num_seqs * max_len, budget_seqs * max_len

    def new_engine(use_v1: bool, kv_tokens: int, eager: bool = enforce_eager) -> LLM:
        llm = make_engine(
            model_dir, max_num_seqs, kv_tokens, max_len, use_v1, device=device, dtype=dtype,
            compilation_level=compilation_level, enforce_eager=eager,
        )
        warm_up(llm, hf, requests)
        return llm

    engine_name = f"{'V1' if use_v1 else 'engine'}, batch {max_num_seqs}"

    def key_runs() -> tuple[KeyRuns, int, LLM]:
        """The repeated runs, the engine's tokens per step (HF gets the same)
        and the engine."""
        llm = new_engine(use_v1, batch_kv)
        step_tokens = engine_step_tokens(llm)
        name = engine_name
        if compilation_level:
            name += f", -O{compilation_level}"
        if device == "cuda":
            name += ", eager" if enforce_eager else ", CUDA graphs"
        key = run_key_runs(
            lambda: engine_run(llm, requests, name, max_num_seqs, batch_kv),
            lambda b: hf_continuous(hf, requests, b, batch_kv, step_tokens),
            lambda: hf_static(hf, requests, max_num_seqs, max_len),
            max_num_seqs,
            hf_cb_batch_sizes,
            repeats,
        )
        return key, step_tokens, llm

    key, step_tokens, llm = key_runs()
    ours = key.engine
    hf_single = hf_static(hf, requests[:single_requests], 1, max_len)
    runs = [ours, key.hf_cb_matched]
    if key.hf_cb_best is not key.hf_cb_matched:
        runs.append(key.hf_cb_best)
    runs += [r for r in key.sweep.values() if all(r is not x for x in runs)]
    runs += [key.hf_static, hf_single]

    ratios = {
        "vs_generate_batch_matched": ours.tokens_per_s / key.hf_cb_matched.tokens_per_s,
        "vs_generate_batch_best": ours.tokens_per_s / key.hf_cb_best.tokens_per_s,
        "equal_batch": ours.tokens_per_s / key.hf_static.tokens_per_s,
        "vs_one_at_a_time": ours.tokens_per_s / hf_single.tokens_per_s,
    }
    paired = {
        "vs_generate_batch_matched": paired_ratio(ours, key.hf_cb_matched),
        "vs_generate_batch_best": paired_ratio(ours, key.hf_cb_best),
        "equal_batch": paired_ratio(ours, key.hf_static),
    }
    # How many more token positions the peer runs for the same output.
    compute = {
        "vs_generate_batch_matched": key.hf_cb_matched.computed_tokens / ours.computed_tokens,
        "vs_generate_batch_best": key.hf_cb_best.computed_tokens / ours.computed_tokens,
        "equal_batch": key.hf_static.computed_tokens / ours.computed_tokens,
    }
    agree = {
        f"engine_vs_hf_generate_batch_{b}": agreement(ours.outputs, r.outputs).summary()
        for b, r in key.sweep.items()
    }
    agree["engine_vs_hf_static_batch"] = agreement(ours.outputs, key.hf_static.outputs).summary()
    agree["engine_vs_hf_one_at_a_time"] = agreement(ours.outputs, hf_single.outputs).summary()

    if device == "cuda" and not enforce_eager:
        # What the graphs buy: the same engine without them, runs alternated.
        eager_llm = new_engine(use_v1, batch_kv, eager=True)
        graphs, eager = (
            engine_run(llm, requests, f"{engine_name}, CUDA graphs (pair)",
                       max_num_seqs, batch_kv),
            engine_run(eager_llm, requests, f"{engine_name}, eager", max_num_seqs, batch_kv),
        )
        for _ in range(repeats - 1):
            add_repetition(graphs, engine_run(llm, requests, graphs.name, max_num_seqs, batch_kv))
            add_repetition(
                eager, engine_run(eager_llm, requests, eager.name, max_num_seqs, batch_kv)
            )
        runs += [graphs, eager]
        ratios["cuda_graphs_over_eager"] = graphs.tokens_per_s / eager.tokens_per_s
        paired["cuda_graphs_over_eager"] = paired_ratio(graphs, eager)
        agree["engine_vs_engine_eager"] = agreement(ours.outputs, eager.outputs).summary()

    if extra_runs:
        budget_name = f"KV {budget_seqs}x{max_len}"

        def once(use_v1: bool, kv_tokens: int, name: str) -> RunResult:
            llm = new_engine(use_v1, kv_tokens)
            return engine_run(llm, requests, name, max_num_seqs, kv_tokens)

        ours_budget = once(False, budget_kv, f"engine, {budget_name}")
        hf_budget = hf_static(hf, requests, budget_seqs, max_len)
        v1_batch = once(True, batch_kv, f"V1, batch {max_num_seqs}")
        v1_budget = once(True, budget_kv, f"V1, {budget_name}")
        runs += [ours_budget, hf_budget, v1_batch, v1_budget]
        ratios["equal_kv_memory"] = ours_budget.tokens_per_s / hf_budget.tokens_per_s
        ratios["v1_over_classic_equal_batch"] = v1_batch.tokens_per_s / ours.tokens_per_s
        ratios["v1_over_classic_equal_kv_memory"] = (
            v1_budget.tokens_per_s / ours_budget.tokens_per_s
        )
        compute["equal_kv_memory"] = hf_budget.computed_tokens / ours_budget.computed_tokens
        agree["engine_batch_vs_engine_budget"] = agreement(
            ours.outputs, ours_budget.outputs
        ).summary()
        agree["v1_vs_engine_batch"] = agreement(v1_batch.outputs, ours.outputs).summary()
        agree["v1_budget_vs_engine_budget"] = agreement(
            v1_budget.outputs, ours_budget.outputs
        ).summary()

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
        "max_num_batched_tokens": step_tokens,
        "budget_seqs": budget_seqs,
        "single_requests": single_requests,
        "repeats": repeats,
        "hf_cb_batch_sizes": sorted(key.sweep),
        "extra_runs": extra_runs,
        "engine": "V1" if use_v1 else "classic",
        # Where V1's engine core ran (MINIVLLM_ENABLE_V1_MULTIPROCESSING).
        "v1_multiprocess": use_v1 and resolve_multiprocess_mode(None),
    }
    sweep = {b: r.rates.values[0] for b, r in key.sweep.items()}
    return ThroughputResult(
        model, workload, runs, ratios, compute, agree, sweep, key.hf_cb_best.batch_size, paired
    )


def plot(result: ThroughputResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.35 * len(result.runs)))
    runs = result.runs[::-1]
    values = [r.tokens_per_s for r in runs]
    # Error bars from the slowest to the fastest repetition.
    low = [r.tokens_per_s - min(r.rates.values) for r in runs]
    high = [max(r.rates.values) - r.tokens_per_s for r in runs]
    colors = ["tab:orange" if r.name.startswith("HF") else "tab:blue" for r in runs]
    bars = ax.barh([r.name for r in runs], values, xerr=[low, high], color=colors, capsize=3)
    ax.bar_label(bars, fmt="%.0f", padding=6)
    ax.set_xlabel(f"generated tokens / s (median of {result.workload['repeats']} where repeated)")
    m = result.model
    ax.set_title(
        f"{m['architecture']} {m['parameters'] / 1e6:.1f}M, {m['dtype']} on {m['device']}: "
        f"{result.workload['num_requests']} requests"
    )
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table_rows(result: ThroughputResult) -> list[dict]:
    rows = []
    for r in result.runs:
        n = len(r.seconds)
        rows.append(
            {
                "run": r.name,
                "requests": r.num_requests,
                "KV slots": r.kv_cache_tokens,
                "output tokens": r.output_tokens,
                "tokens computed": r.computed_tokens,
                "seconds": r.median_seconds,
                "tokens/s": r.tokens_per_s,
                "runs": n,
                "spread": f"{r.rates.spread:.1%}" if n > 1 else "",
                "preemptions": "" if r.num_preemptions is None else r.num_preemptions,
            }
        )
    return rows


RATIO_LABELS = {
    "vs_generate_batch_matched": "engine / HF generate_batch, matched batch",
    "vs_generate_batch_best": "engine / HF generate_batch, its best batch",
    "equal_batch": "engine / HF static, equal batch",
    "vs_one_at_a_time": "engine / HF one at a time",
    "equal_kv_memory": "engine / HF static, equal KV memory",
    "v1_over_classic_equal_batch": "V1 / classic, equal batch",
    "v1_over_classic_equal_kv_memory": "V1 / classic, equal KV memory",
    "cuda_graphs_over_eager": "engine with CUDA graphs / eager, runs alternated",
}


def print_result(result: ThroughputResult) -> None:
    m = result.model
    print_table(
        table_rows(result),
        title=f"Throughput, {m['architecture']} {m['parameters'] / 1e6:.1f}M "
        f"parameters, {m['dtype']} on {m['device']} (tokens/s: median of the runs; "
        "spread: (max - min) / median)",
    )
    sweep = ", ".join(f"{b}: {v:.0f}" for b, v in result.hf_cb_sweep.items())
    print(
        f"HF generate_batch sweep (tokens/s, first repetition): {sweep}; "
        f"best batch {result.hf_cb_best_batch_size}"
    )
    for name, ratio in result.ratios.items():
        notes = []
        pairs = result.paired_ratios.get(name)
        if pairs is not None and len(pairs.values) > 1:
            notes.append(f"per repetition {min(pairs.values):.2f}-{max(pairs.values):.2f}x")
        extra = result.compute_ratios.get(name)
        if extra:
            notes.append(f"HF computes {extra:.2f}x the token positions")
        note = f" ({'; '.join(notes)})" if notes else ""
        print(f"{RATIO_LABELS[name]}: {ratio:.2f}x{note}")
    for name, a in result.agreement.items():
        print(
            f"greedy agreement, {name.replace('_', ' ')}: {a['identical']}/{a['compared']} "
            f"identical; first divergence min {a['first_divergence_min']}, "
            f"median {a['first_divergence_median']}"
        )
    unstable = [r.name for r in result.runs if not r.repeats_identical]
    if unstable:
        print(f"tokens changed between repetitions: {', '.join(unstable)}")


def result_payload(result: ThroughputResult) -> dict:
    return {
        "model": result.model,
        "workload": result.workload,
        "runs": [
            {
                **{k: v for k, v in asdict(r).items() if k != "outputs"},
                "tokens_per_s": r.tokens_per_s,
                "tokens_per_s_repeats": r.rates.summary(),
            }
            for r in result.runs
        ],
        "ratios": result.ratios,
        "ratios_per_repetition": {k: v.summary() for k, v in result.paired_ratios.items()},
        "computed_tokens_hf_over_engine": result.compute_ratios,
        "greedy_agreement": result.agreement,
        "hf_generate_batch_sweep_tokens_per_s": result.hf_cb_sweep,
        "hf_generate_batch_best_batch_size": result.hf_cb_best_batch_size,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_requests=64)
    add_model_args(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--budget-seqs",
        type=int,
        default=16,
        help="the equal-memory KV budget, in requests of max_model_len tokens (--extra-runs)",
    )
    parser.add_argument("--single-requests", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of the engine and each HF peer, interleaved"
    )
    parser.add_argument(
        "--hf-cb-batch-sizes",
        type=int,
        nargs="+",
        default=list(DEFAULT_HF_CB_BATCH_SIZES),
        help="HF generate_batch's max_requests_per_batch values tried in the first repetition "
        "(--max-num-seqs is always one): the fastest is HF's best. Default 8 16 (and 64): on "
        "the 2-core VM 8 and 16 were fastest and 32 below both; 8 16 32 64 adds about 45 s",
    )
    parser.add_argument(
        "--extra-runs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also the equal-KV-memory pair and V1 at both settings, once each "
        "(about 2 minutes more; default: only with --quick)",
    )
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 ...")
    parser.add_argument(
        "--compilation-level", type=int, default=0, help="the engines' (0: eager)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="the engines': no CUDA graphs on a GPU"
    )
    parser.add_argument(
        "--v1", action="store_true",
        help="the repeated engine runs on V1 (use_v1=True, its defaults: prefix caching, reset "
        "before each run, and chunked prefill on, 4096 tokens a step on a CPU, which HF gets too); "
        "written to throughput_v1.json",
    )
    parser.add_argument("--quick", action="store_true", help="16 requests of 16-64 + 16-64 tokens")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 16, [16, 64], [16, 64]
        args.max_num_seqs, args.budget_seqs, args.single_requests = 8, 2, 4
        if args.hf_cb_batch_sizes == list(DEFAULT_HF_CB_BATCH_SIZES):
            args.hf_cb_batch_sizes = [2, 4, 8]
    extra_runs = (args.quick and not args.v1) if args.extra_runs is None else args.extra_runs
    if args.v1 and extra_runs:
        parser.error("--extra-runs sets V1 beside the classic engine; with --v1 the repeated "
                     "runs are V1's already")
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
            args.repeats,
            args.hf_cb_batch_sizes,
            extra_runs,
            args.compilation_level,
            args.enforce_eager,
            args.v1,
        )
    print_result(result)
    name = "throughput_v1" if args.v1 else "throughput"
    out = write_result(name, result_payload(result), args.json)
    if not args.no_plot:
        plot(result, plot_path(name, args.json))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
