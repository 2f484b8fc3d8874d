"""Roofline per step: how close one engine step comes to this machine's limits.

A step's time has two floors (the roofline): the FLOPs it must do over the
machine's matmul peak, and the bytes it must move over its memory bandwidth.
Both limits are measured here, at the thread count in use, before and after
the steps (tools/bench/machine.py; the best of each is kept: on a shared
machine the least disturbed run is the closest to the hardware; the
peak is a 1024-wide square product, which a step's larger products may
slightly beat). Between the two, the classic engine (`LLM(...)`, float32 on the
CPU, the default attention backend: the Numba decode kernel) runs

- decode steps at batch 1, 8 and 64, every sequence with a 256-token prompt
  (so each decode attends to 257 to ~275 tokens: a realistic context, and
  at batch 64 the K/V read outweighs the weights), and
- prefill steps of 4 prompts of 256 tokens (1024 tokens in one step),

- the throughput benchmark's workload, start to finish (`Plan.workload`:
  64 requests of 16-256 prompt and 16-256 output tokens, all at once, on an
  engine set up as `tools/bench/throughput.py`'s at batch 64), once timed
  and once profiled step by step: the issue's FLOP/s target is a rate
  *during the throughput run*, and there steps of every size and context
  follow each other,

and for each kind of step reports:

1. its wall time (median of 10 steps after 3 warm-up steps, no profiler),
   and their spread (10th to 90th percentile, over the median);
2. its work, counted analytically from the model's shape and the step's
   batch (`step_work`): matmul FLOPs (2 x the weights a token multiplies by
   x the tokens, plus the LM head for the rows that sample), attention
   FLOPs, and the bytes: every weight read once, K/V read by attention plus
   its query and output rows, the new K/V written (the other activations
   are left out: a few per cent of a decode step's bytes, and a prefill,
   far above the ridge point, is bound by its FLOPs anyway);
3. achieved FLOP/s and bytes/s, their fractions of the measured peak and
   bandwidth, and the roofline's limit time (the larger floor) over the
   measured time;
4. from a profile of 3 more steps (tools/bench/profiling.py's
   labels), the split of a step into matmuls, the model's other operators,
   attention, sampling, input preparation and bookkeeping (scheduler,
   output processing, the engine's own code), and the matmuls' and the
   attention regions' own rates (attention's region holds its K/V write
   and its prefills too);
5. decode attention's own bandwidth, without the profiler: every call of
   the backend's decode half (each layer's `AttentionImpl.forward_decode`)
   is timed during the timed steps, and the K/V bytes the step's decodes
   read (their `attention_bytes`) over that time is its achieved bandwidth.

The profiler adds a few µs per operator, so the split is of the profiled
step (its time is shown beside the wall time); the wall time and the rates
in (3) and (5) are measured without it.

The workload's row is of the whole run: its time, its work summed over its
steps, and its limit the sum of each step's own (the larger floor of each
step: steps run one after another, so their floors add up; the floor of
the summed work would let a prefill's FLOPs hide a decode's bytes). Its
split and its matmul rate are over every profiled step.

Counting conventions (the tests check them against FlopCounterMode on the
real model and against Day 8's decode oracles):
- attention FLOPs are what the backends compute: every query row against
  all `seq_len` keys of its sequence, q.k and p.v, for every query head.
  A prefill's masked upper triangle is computed too (the reference path
  masks after the product), so a causal prefill counts the full square.
- attention bytes are K and V of `seq_len` tokens per KV head (grouped
  query heads share them) plus the query read and the output written,
  as tools/bench/attention.py's `moved_bytes`; a prefill's gather through
  the block table is counted as one read of its tokens (the floor).
- biases (Qwen2's q/k/v) and the embedding rows gathered are left out.

    python -m tools.bench.roofline                  # ~2 min on 2 cores
    python -m tools.bench.roofline --threads 1
    python -m tools.bench.roofline --quick          # batches 1 and 8, shorter
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from minivllm import LLM, SamplingParams
from minivllm.worker.model_runner import FlatBatch
from tools.bench import machine
from tools.bench.common import (
    BLOCK_SIZE,
    FIRST_ORDINARY_TOKEN,
    WorkloadSpec,
    add_model_args,
    make_bench_model,
    percentile,
    print_table,
    sample_requests,
    set_threads,
    write_result,
)
from tools.bench.profiling import (
    attention_impls,
    in_model_matmul,
    innermost_label,
    profile_steps,
    timed_into,
    wrap_method,
)
from tools.bench.throughput import engine_run
from tools.bench.throughput import make_engine as make_throughput_engine

# Where a profiled event's self time goes, by the innermost label around it.
PARTS = ("matmul", "model_other", "attention", "sampling", "prepare_inputs", "schedule",
         "process", "engine_other")
_PART_OF_LABEL = {"attention": "attention", "sampler": "sampling",
                  "prepare_inputs": "prepare_inputs", "schedule": "schedule",
                  "process": "process", "step": "engine_other"}
# The table's coarser groups of PARTS.
GROUPS = {
    "model": ("matmul", "model_other"),
    "attention": ("attention",),
    "sampling": ("sampling",),
    "prepare_inputs": ("prepare_inputs",),
    "bookkeeping": ("schedule", "process", "engine_other"),
}


# -- counting a step's work ------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's FLOPs and bytes (Llama/Qwen2 layout:
    q, k, v, o projections, a gated MLP of three matrices, two RMSNorms per
    layer, a final norm and an untied or tied LM head)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.float32) -> ModelShape:
        """From a Hugging Face config (the engine's `model_config.hf_config`)."""
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_size=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
        )

    @property
    def layer_matmul_params(self) -> int:
        """The weights one token is multiplied by in one layer."""
        q = self.num_heads * self.head_size
        kv = self.num_kv_heads * self.head_size
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size  # qkv, o
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down
        return attention + mlp

    @property
    def token_matmul_params(self) -> int:
        """The weights every token is multiplied by (all layers; not the LM head,
        which only the rows that sample go through)."""
        return self.num_layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def matmul_weight_bytes(self) -> int:
        """The matmuls' weights, the LM head's included."""
        return (self.token_matmul_params + self.lm_head_params) * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """What a step reads of the weights, each once: the matmuls' and the
        norms' (not the embedding table: only its rows for this step's tokens
        are read)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.matmul_weight_bytes + norms * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class StepShape:
    """What one step ran: per sequence, its new tokens and the tokens it
    attends to; and how many rows went through the LM head."""

    query_lens: tuple[int, ...]  # new tokens per sequence (1 for a decode)
    seq_lens: tuple[int, ...]  # tokens in the cache once the step is done
    logit_rows: int
    num_prefills: int

    @classmethod
    def from_batch(cls, batch: FlatBatch, logit_rows: int) -> StepShape:
        return cls(
            query_lens=tuple(s - c for s, c in zip(batch.seq_lens, batch.context_lens,
                                                   strict=True)),
            seq_lens=tuple(batch.seq_lens),
            logit_rows=logit_rows,
            num_prefills=batch.num_prefills,
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_decode(self) -> bool:
        return self.num_prefills == 0


@dataclass(frozen=True)
class StepWork:
    """One step's FLOPs and bytes, counted (see the module docstring)."""

    matmul_flops: int
    attention_flops: int
    weight_bytes: int
    attention_bytes: int  # K/V read, query read, output written
    kv_write_bytes: int  # this step's new K/V

    @property
    def flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.attention_bytes + self.kv_write_bytes


def attention_flops(model: ModelShape, query_len: int, seq_len: int) -> int:
    """One sequence, all layers: `query_len` rows, each against `seq_len` keys
    (q.k) and values (p.v), head_size multiply-adds each, every query head."""
    per_layer = 2 * 2 * model.num_heads * model.head_size * query_len * seq_len
    return model.num_layers * per_layer


def attention_bytes(model: ModelShape, query_len: int, seq_len: int) -> int:
    """One sequence, all layers: K and V of `seq_len` tokens for each KV head,
    plus `query_len` query rows read and output rows written."""
    kv = 2 * seq_len * model.num_kv_heads * model.head_size
    rows = 2 * query_len * model.num_heads * model.head_size
    return model.num_layers * (kv + rows) * model.dtype_bytes


def decode_attention_bytes(model: ModelShape, step: StepShape) -> int:
    """What the step's decodes (the sequences after its prefills) read and
    write in attention: the part of its `attention_bytes` that the backend's
    decode half moves."""
    return sum(attention_bytes(model, q, s) for q, s in
               zip(step.query_lens[step.num_prefills:], step.seq_lens[step.num_prefills:],
                   strict=True))


def step_work(model: ModelShape, step: StepShape) -> StepWork:
    """The FLOPs and bytes of one step of `model` over the batch `step`."""
    pairs = list(zip(step.query_lens, step.seq_lens, strict=True))
    return StepWork(
        matmul_flops=2 * (model.token_matmul_params * step.num_tokens
                          + model.lm_head_params * step.logit_rows),
        attention_flops=sum(attention_flops(model, q, s) for q, s in pairs),
        weight_bytes=model.weight_bytes,
        attention_bytes=sum(attention_bytes(model, q, s) for q, s in pairs),
        kv_write_bytes=step.num_tokens * model.kv_bytes_per_token,
    )


# -- the profile's split --------------------------------------------------------------------


def part_of(event) -> str:
    """The part of PARTS an event's self time belongs to: decided by the
    innermost label around it (itself included); inside `model`, an event
    with a matrix product on its way up (the product itself, or what it
    calls) is "matmul", the rest "model_other"; the step's own code and
    anything unlabelled is "engine_other"."""
    label = innermost_label(event)
    if label == "model":
        return "matmul" if in_model_matmul(event) else "model_other"
    return _PART_OF_LABEL.get(label, "engine_other")


def time_by_part(events) -> dict[str, float]:
    """µs per part: every event's SELF time, each counted once, so the parts
    add up to the profiled steps' total time."""
    parts = dict.fromkeys(PARTS, 0.0)
    for event in events:
        parts[part_of(event)] += event.self_cpu_time_total
    return parts


def profiled_step_us(events) -> float:
    """The total time of the `step` regions (µs)."""
    return sum(e.cpu_time_total for e in events if e.name == "step")


def grouped(parts: dict[str, float]) -> dict[str, float]:
    return {group: sum(parts[p] for p in members) for group, members in GROUPS.items()}


# -- running steps ---------------------------------------------------------------------------


@contextlib.contextmanager
def recording_shapes(llm: LLM) -> Iterator[list[StepShape]]:
    """Append the `StepShape` of every model input this engine builds while
    the block runs (this engine's model runner only)."""
    runner = llm.llm_engine.worker.model_runner
    inner = runner.prepare_model_input
    had_own = "prepare_model_input" in vars(runner)
    shapes: list[StepShape] = []

    def recorded(seq_group_metadata_list):
        model_input = inner(seq_group_metadata_list)
        rows = len(model_input.selected_token_indices)
        shapes.append(StepShape.from_batch(model_input.batch, rows))
        return model_input

    runner.prepare_model_input = recorded
    try:
        yield shapes
    finally:
        if had_own:
            runner.prepare_model_input = inner
        else:
            del runner.prepare_model_input


@contextlib.contextmanager
def timing_decode_attention(llm: LLM) -> Iterator[dict[str, float]]:
    """{"seconds", "calls"} of every call of each layer's `forward_decode`
    in this engine while the block runs (its own objects only; one call per
    layer in each step with decodes). A timer costs about a microsecond a
    call, against the tens to thousands a call takes."""
    totals = {"seconds": 0.0, "calls": 0}

    def timed_call() -> contextlib.AbstractContextManager:
        totals["calls"] += 1
        return timed_into(totals, "seconds")

    undo: list = []
    for impl in attention_impls(llm):
        wrap_method(impl, "forward_decode", timed_call, undo)
    try:
        yield totals
    finally:
        for restore in reversed(undo):
            restore()


@dataclass
class StepsRun:
    """The timed and the profiled steps of one kind of step."""

    seconds: list[float] = field(default_factory=list)  # wall, unprofiled
    # The backend's decode half in each timed step (or in the whole timed run)
    decode_attention_seconds: list[float] = field(default_factory=list)
    decode_attention_calls: int = 0  # over all the timed steps
    shapes: list[StepShape] = field(default_factory=list)  # of the timed steps
    events: list = field(default_factory=list)  # profiler events of the profiled steps
    profiled_shapes: list[StepShape] = field(default_factory=list)


def timed_step(llm: LLM, run: StepsRun) -> None:
    with recording_shapes(llm) as shapes, timing_decode_attention(llm) as attention:
        start = time.perf_counter()
        llm.llm_engine.step()
        run.seconds.append(time.perf_counter() - start)
    run.shapes += shapes
    run.decode_attention_seconds.append(attention["seconds"])
    run.decode_attention_calls += attention["calls"]


def profiled_step(llm: LLM, run: StepsRun) -> None:
    with recording_shapes(llm) as shapes:
        run.events += profile_steps(llm, 1)
    run.profiled_shapes += shapes


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def add_prompts(llm: LLM, rng: random.Random, num: int, prompt_len: int, max_tokens: int,
                prefix: str) -> None:
    """`num` random prompts of `prompt_len` tokens, greedy, run to `max_tokens`."""
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    for i in range(num):
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(prompt_len)]
        llm.llm_engine.add_request(f"{prefix}{i}", {"prompt_token_ids": prompt},
                                   greedy(max_tokens))


def drain(llm: LLM) -> None:
    """Abort every request left and run the step that hands them back."""
    engine = llm.llm_engine
    scheduler = engine.scheduler
    ids = [sg.request_id for queue in (scheduler.waiting, scheduler.running, scheduler.swapped)
           for sg in queue]
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


@dataclass(frozen=True)
class Plan:
    """What to run: the decode batches and the prefill step, and how many steps."""

    batch_sizes: tuple[int, ...] = (1, 8, 64)
    prompt_len: int = 256
    prefill_prompts: int = 4
    warmup: int = 3
    steps: int = 10
    profile_steps: int = 3
    # The throughput benchmark's (its defaults) and its engine's batch; None: skipped.
    workload: WorkloadSpec | None = WorkloadSpec()
    workload_max_num_seqs: int = 64

    @property
    def decode_tokens(self) -> int:
        """Tokens a decoding request generates in all: warm-up, timed, profiled, 1 spare."""
        return self.warmup + self.steps + self.profile_steps + 1

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.decode_tokens + 1

    @property
    def max_num_seqs(self) -> int:
        return max(*self.batch_sizes, self.prefill_prompts)

    @property
    def num_blocks(self) -> int:
        """Enough blocks for the largest batch at its longest, never a preemption."""
        return self.max_num_seqs * -(-self.max_model_len // BLOCK_SIZE) + 1


WORKLOAD = "workload"  # the name of the workload's row

QUICK = Plan(batch_sizes=(1, 8), prompt_len=64, prefill_prompts=2, warmup=1, steps=3,
             profile_steps=1,
             workload=WorkloadSpec(num_requests=4, min_prompt_len=8, max_prompt_len=32,
                                   min_output_len=4, max_output_len=12),
             workload_max_num_seqs=4)


def make_engine(model_dir: str, plan: Plan, attention_backend: str | None) -> LLM:
    return LLM(
        model_dir,
        max_model_len=plan.max_model_len,
        max_num_seqs=plan.max_num_seqs,
        max_num_batched_tokens=max(plan.prefill_prompts * plan.prompt_len, plan.max_model_len,
                                   plan.max_num_seqs),
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=plan.num_blocks,
        swap_space=0,
        seed=0,
        attention_backend=attention_backend,
    )


def run_decode(llm: LLM, plan: Plan, batch: int, rng: random.Random) -> StepsRun:
    """`batch` prompts prefilled, then decode steps of all of them."""
    engine = llm.llm_engine
    add_prompts(llm, rng, batch, plan.prompt_len, plan.decode_tokens, prefix=f"d{batch}_")
    run = StepsRun()
    try:
        while engine.scheduler.waiting:  # the prefills
            engine.step()
        for _ in range(plan.warmup):
            engine.step()
        for _ in range(plan.steps):
            timed_step(llm, run)
        for _ in range(plan.profile_steps):
            profiled_step(llm, run)
    finally:
        drain(llm)
    expect_steps(run, f"decode steps of {batch}",
                 lambda s: s.is_decode and len(s.seq_lens) == batch)
    return run


def run_prefill(llm: LLM, plan: Plan, rng: random.Random) -> StepsRun:
    """Steps that each prefill `prefill_prompts` new prompts (one token each:
    they finish in that same step)."""
    run = StepsRun()
    n = plan.prefill_prompts
    for i in range(plan.warmup + plan.steps + plan.profile_steps):
        add_prompts(llm, rng, n, plan.prompt_len, max_tokens=1, prefix=f"p{i}_")
        if i < plan.warmup:
            llm.llm_engine.step()
        elif i < plan.warmup + plan.steps:
            timed_step(llm, run)
        else:
            profiled_step(llm, run)
        drain(llm)
    expect_steps(run, f"prefills of {n} prompts",
                 lambda s: s.num_prefills == n and s.num_tokens == n * plan.prompt_len)
    return run


def run_workload(model_dir: str, plan: Plan, attention_backend: str | None) -> StepsRun:
    """The throughput benchmark's workload on an engine set up as that
    benchmark's (`max_num_seqs` = plan.workload_max_num_seqs, the KV memory
    of that many requests of max_model_len): after a warm-up of two short
    requests, once timed (`run.seconds` holds the whole run's time) and once
    profiled, every step. The schedule depends only on the workload, so
    both runs take the same steps (checked)."""
    spec, batch = plan.workload, plan.workload_max_num_seqs
    kv_tokens = batch * spec.max_model_len
    llm = make_throughput_engine(model_dir, batch, kv_tokens, spec.max_model_len,
                                 attention_backend=attention_backend)
    requests = sample_requests(spec, llm.llm_engine.model_config.hf_config.vocab_size)
    engine_run(llm, [dataclasses.replace(r, output_len=4) for r in requests[:2]], "warm-up",
               batch, kv_tokens)
    run = StepsRun()
    with recording_shapes(llm) as shapes, timing_decode_attention(llm) as attention:
        timed = engine_run(llm, requests, "workload", batch, kv_tokens)
    run.seconds, run.shapes = timed.seconds, shapes
    run.decode_attention_seconds = [attention["seconds"]]
    run.decode_attention_calls = attention["calls"]
    if timed.num_preemptions:
        raise RuntimeError(f"the workload preempted {timed.num_preemptions} times")
    for i, r in enumerate(requests):
        llm.llm_engine.add_request(f"w{i}", {"prompt_token_ids": r.prompt_token_ids},
                                   greedy(r.output_len))
    with recording_shapes(llm) as profiled:
        run.events = profile_steps(llm, len(shapes))
    run.profiled_shapes = profiled
    # Equal steps, and none left over (which equal first steps would not show).
    if run.profiled_shapes != run.shapes or llm.llm_engine.has_unfinished_requests():
        common = min(len(shapes), len(profiled))
        differ = next((i for i in range(common) if shapes[i] != profiled[i]), common)
        raise RuntimeError(f"the profiled run of the workload left the timed run's steps at "
                           f"step {differ} of {len(shapes)}")
    return run


def expect_steps(run: StepsRun, what: str, ok) -> None:
    """Every measured step ran the batch intended (no preemption, no split prefill)."""
    shapes = run.shapes + run.profiled_shapes
    if not shapes or not all(ok(s) for s in shapes):
        raise RuntimeError(f"expected {what}, the engine ran: {shapes}")


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """This machine's measured limits at the thread count in use."""

    matmul_flops: float  # FLOP/s
    read_bandwidth: float  # bytes/s
    threads: int

    @property
    def ridge(self) -> float:
        return machine.ridge_point(self.matmul_flops, self.read_bandwidth)


def measure_limits(quick: bool) -> Limits:
    """The matmul peak (a square product, 1024 wide) and the read bandwidth
    (256 MiB), each the best of 10 runs: on a shared machine the least
    disturbed run is the closest to what the hardware can do."""
    nbytes = machine.DEFAULT_BYTES // (4 if quick else 1)
    read = machine.read_bandwidth(nbytes, repeats=3 if quick else 10)
    peak = machine.matmul_peak(512 if quick else 1024, repeats=3 if quick else 10)
    return Limits(peak.per_second, read.per_second, torch.get_num_threads())


def best_limits(*measured: Limits) -> Limits:
    """The highest of each limit measured (before and after the steps)."""
    return Limits(max(m.matmul_flops for m in measured),
                  max(m.read_bandwidth for m in measured), measured[0].threads)


def _combined_work(model: ModelShape, shapes: list[StepShape], combine) -> StepWork:
    """Each field of the steps' work combined: `statistics.fmean` or `sum`."""
    works = [step_work(model, s) for s in shapes]
    return StepWork(*(round(combine(getattr(w, f) for w in works))
                      for f in StepWork.__dataclass_fields__))


def floor_seconds(work: StepWork, limits: Limits) -> float:
    """The roofline's limit for one step: the larger of its two floors."""
    return max(work.flops / limits.matmul_flops, work.bytes / limits.read_bandwidth)


def phases_floor_seconds(work: StepWork, limits: Limits) -> float:
    """A stricter floor, for an engine that runs a step's parts one after
    another on the same cores, as ours does layer by layer: the products'
    floor (their FLOPs or the weights they read, whichever takes longer)
    plus attention's (its FLOPs or its bytes, the new K/V included). While
    the products are bound by FLOPs the memory is underused, and while
    decode attention is bound by bytes the arithmetic is; the roofline's
    single floor for the whole step assumes each hides the other."""
    products = max(work.matmul_flops / limits.matmul_flops,
                   work.weight_bytes / limits.read_bandwidth)
    attention = max(work.attention_flops / limits.matmul_flops,
                    (work.attention_bytes + work.kv_write_bytes) / limits.read_bandwidth)
    return products + attention


def run_floors(steps: list[StepWork], limits: Limits) -> tuple[float, float]:
    """The floors of steps run one after another, each summed step by step:
    (the roofline's, the stricter `phases_floor_seconds`). Summed per step,
    not taken of the summed work: a prefill's spare bandwidth cannot serve
    a later decode, nor a decode's idle arithmetic a later prefill."""
    return (sum(floor_seconds(w, limits) for w in steps),
            sum(phases_floor_seconds(w, limits) for w in steps))


def summarize(name: str, run: StepsRun, model: ModelShape, limits: Limits,
              whole_run: bool = False) -> dict:
    """One row of the report (a JSON-able dict): work, rates, fractions, split.
    Per step (the median step, the mean work), or with `whole_run` of the
    whole run: `seconds` and `step_seconds` its one time, the work and the
    floors of its steps summed, the parts of all its profiled steps, and
    `context` the mean over every sequence of every step."""
    if whole_run:
        (seconds,) = run.seconds
        (decode_attention_s,) = run.decode_attention_seconds
        decode_bytes = sum(decode_attention_bytes(model, s) for s in run.shapes)
        work = _combined_work(model, run.shapes, sum)
        profiled_work = _combined_work(model, run.profiled_shapes, sum)
        per = 1  # the parts are of the whole profiled run
        limit_s, phases_s = run_floors([step_work(model, s) for s in run.shapes], limits)
        spread = None
    else:
        seconds = statistics.median(run.seconds)
        decode_attention_s = statistics.median(run.decode_attention_seconds)
        decode_bytes = statistics.fmean(decode_attention_bytes(model, s) for s in run.shapes)
        work = _combined_work(model, run.shapes, statistics.fmean)
        profiled_work = _combined_work(model, run.profiled_shapes, statistics.fmean)
        per = len(run.profiled_shapes)
        limit_s, phases_s = run_floors([work], limits)
        spread = (percentile(run.seconds, 90) - percentile(run.seconds, 10)) / seconds
    parts = {k: v / per for k, v in time_by_part(run.events).items()}  # µs
    step_us = profiled_step_us(run.events) / per
    matmul_s = parts["matmul"] / 1e6
    attention_s = parts["attention"] / 1e6
    weights_read = model.matmul_weight_bytes * (len(run.profiled_shapes) if whole_run else 1)
    return {
        "step": name,
        "steps": len(run.shapes),
        "sequences": max(len(sh.seq_lens) for sh in run.shapes),  # in one step, at most
        "tokens": (sum if whole_run else max)(sh.num_tokens for sh in run.shapes),
        "context": statistics.fmean(s for sh in run.shapes for s in sh.seq_lens),
        "seconds": seconds,
        "spread": spread,
        "step_seconds": run.seconds,
        "work": asdict(work),
        "flops": work.flops,
        "bytes": work.bytes,
        "intensity": work.flops / work.bytes,
        "flops_per_second": work.flops / seconds,
        "bytes_per_second": work.bytes / seconds,
        "fraction_of_peak": work.flops / seconds / limits.matmul_flops,
        "fraction_of_bandwidth": work.bytes / seconds / limits.read_bandwidth,
        "roofline_seconds": limit_s,
        "fraction_of_roofline": limit_s / seconds,
        "phases_floor_seconds": phases_s,
        "fraction_of_phases_floor": phases_s / seconds,
        # The most of the matmul peak the work could reach, at either floor.
        "fraction_of_peak_at_floor": work.flops / limit_s / limits.matmul_flops,
        "fraction_of_peak_at_phases_floor": work.flops / phases_s / limits.matmul_flops,
        "profiled_step_seconds": step_us / 1e6,
        "parts_us": parts,
        "shares": {k: v / step_us for k, v in grouped(parts).items()},
        "matmul_seconds": matmul_s,
        "matmul_flops_per_second": _rate(profiled_work.matmul_flops, matmul_s),
        "matmul_weight_bytes_per_second": _rate(weights_read, matmul_s),
        "matmul_fraction_of_peak": _rate(profiled_work.matmul_flops, matmul_s,
                                         limits.matmul_flops),
        "attention_seconds": attention_s,
        "attention_bytes_per_second": _rate(profiled_work.attention_bytes, attention_s),
        "attention_flops_per_second": _rate(profiled_work.attention_flops, attention_s),
        "attention_fraction_of_bandwidth": _rate(profiled_work.attention_bytes, attention_s,
                                                 limits.read_bandwidth),
        # Timed without the profiler: the backend's decode half alone.
        "decode_attention_seconds": decode_attention_s,
        "decode_attention_calls": run.decode_attention_calls,
        "decode_attention_bytes": decode_bytes,
        "decode_attention_bytes_per_second": _rate(decode_bytes, decode_attention_s),
        "decode_attention_fraction_of_bandwidth": _rate(decode_bytes, decode_attention_s,
                                                        limits.read_bandwidth),
    }


def _rate(work: float, seconds: float, limit: float = 1.0) -> float | None:
    """work / seconds / limit; None when the profile gave no time at all."""
    return work / seconds / limit if seconds else None


def rate_rows(rows: list[dict]) -> list[dict]:
    """The first table: each step against the roofline."""
    return [{
        "step": r["step"],
        "tokens": r["tokens"],
        "context": round(r["context"]),
        "ms": r["seconds"] * 1e3,
        "spread %": 100 * r["spread"] if r["spread"] is not None else "",
        "GFLOP": r["flops"] / 1e9,
        "MB": r["bytes"] / 1e6,
        "FLOP/B": r["intensity"],
        "GFLOP/s": r["flops_per_second"] / 1e9,
        "% peak": 100 * r["fraction_of_peak"],
        "GB/s": r["bytes_per_second"] / 1e9,
        "% bw": 100 * r["fraction_of_bandwidth"],
        "limit ms": r["roofline_seconds"] * 1e3,
        "% of limit": 100 * r["fraction_of_roofline"],
        "phases ms": r["phases_floor_seconds"] * 1e3,
        "% of phases": 100 * r["fraction_of_phases_floor"],
    } for r in rows]


def split_rows(rows: list[dict]) -> list[dict]:
    """The second table: the profiled step's time by group, in per cent."""
    out = []
    for r in rows:
        step_us = r["profiled_step_seconds"] * 1e6
        out.append({
            "step": r["step"],
            "profiled ms": step_us / 1e3,
            **{f"% {k}": 100 * v for k, v in r["shares"].items()},
            "(% matmul)": 100 * r["parts_us"]["matmul"] / step_us,
        })
    return out


def region_rows(rows: list[dict]) -> list[dict]:
    """The third table: the matmuls' and attention's own regions."""
    pct = lambda x: 100 * x if x is not None else float("nan")  # noqa: E731
    giga = lambda x: x / 1e9 if x is not None else float("nan")  # noqa: E731
    return [{
        "step": r["step"],
        "matmul ms": r["matmul_seconds"] * 1e3,
        "matmul GFLOP/s": giga(r["matmul_flops_per_second"]),
        "% peak": pct(r["matmul_fraction_of_peak"]),
        "weights GB/s": giga(r["matmul_weight_bytes_per_second"]),
        "attn ms": r["attention_seconds"] * 1e3,
        "attn GB/s": giga(r["attention_bytes_per_second"]),
        "attn % bw": pct(r["attention_fraction_of_bandwidth"]),
        "decode ms": r["decode_attention_seconds"] * 1e3,
        "decode GB/s": giga(r["decode_attention_bytes_per_second"]),
        "decode % bw": pct(r["decode_attention_fraction_of_bandwidth"]),
    } for r in rows]


def print_report(rows: list[dict], limits: Limits, title: str) -> None:
    print(title)
    print(f"machine: matmul peak {limits.matmul_flops / 1e9:.1f} GFLOP/s, read bandwidth "
          f"{limits.read_bandwidth / 1e9:.1f} GB/s at {limits.threads} thread(s); ridge "
          f"{limits.ridge:.1f} FLOP/B")
    print_table(rate_rows(rows),
                "\nPer step (wall time, median; work counted; limit = the larger floor; phases = "
                "the products' floor + attention's); the workload: its whole run, its steps' "
                "work and floors summed")
    print_table(split_rows(rows), "\nWhere a step's time goes (profiled; bookkeeping = "
                                  "schedule + process + the engine's own code)")
    print_table(region_rows(rows), "\nThe matmuls and attention alone (their profiled "
                                   "regions; attention includes its K/V write); decode: the "
                                   "backend's decode calls, timed without the profiler")
    for r in rows:
        if r["step"] == WORKLOAD:
            pct = {k: 100 * r[k] for k in ("fraction_of_peak", "matmul_fraction_of_peak",
                                           "fraction_of_peak_at_floor",
                                           "fraction_of_peak_at_phases_floor")}
            print(f"\nThe workload's FLOP/s over its whole run: {pct['fraction_of_peak']:.1f} % "
                  f"of the matmul peak (its products in their own time: "
                  f"{pct['matmul_fraction_of_peak']:.1f} %). At its floor an engine would reach "
                  f"{pct['fraction_of_peak_at_floor']:.0f} % (the roofline), "
                  f"{pct['fraction_of_peak_at_phases_floor']:.0f} % with a step's parts one "
                  f"after another. Its decode attention read "
                  f"{r['decode_attention_bytes_per_second'] / 1e9:.1f} GB/s, "
                  f"{100 * r['decode_attention_fraction_of_bandwidth']:.0f} % of the read "
                  f"bandwidth (timed without the profiler).")


def run_roofline(model_dir: str, plan: Plan,
                 attention_backend: str | None = None) -> tuple[list[tuple[str, StepsRun]], dict]:
    """The measured steps of each kind, by name, and what was run."""
    llm = make_engine(model_dir, plan, attention_backend)
    model = ModelShape.from_config(llm.llm_engine.model_config.hf_config)
    rng = random.Random(0)
    runs = [(f"decode b={batch}", run_decode(llm, plan, batch, rng))
            for batch in plan.batch_sizes]
    runs.append((f"prefill {plan.prefill_prompts}x{plan.prompt_len}", run_prefill(llm, plan, rng)))
    runner = llm.llm_engine.worker.model_runner
    config = {
        **asdict(plan),
        "attention_backend": runner.attn_backend.get_name(),
        "block_size": BLOCK_SIZE,
        "model_shape": asdict(model),
        "weight_bytes": model.weight_bytes,
        "parameters": sum(p.numel() for p in runner.model.parameters()),
    }
    if plan.workload:
        runs.append((WORKLOAD, run_workload(model_dir, plan, attention_backend)))
    return runs, config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="decode batches (1 8 64)")
    parser.add_argument("--prompt-len", type=int, help="tokens per prompt (256)")
    parser.add_argument("--steps", type=int, help="timed steps per kind (10)")
    parser.add_argument("--attention-backend", default=None, help="default: the engine's (numba)")
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 64-token prompts, "
                                                            "3 timed steps")
    parser.add_argument("--workload", action=argparse.BooleanOptionalAction, default=True,
                        help="also the throughput benchmark's workload, start to finish "
                             "(about 40 s more)")
    parser.add_argument("--json", help="result path (default: tools/bench/results/roofline.json)")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        parser.error("the roofline benchmark measures the CPU (use --device cpu)")
    set_threads(args.threads)
    plan = QUICK if args.quick else Plan()
    overrides = {"batch_sizes": tuple(args.batch_sizes or ()), "prompt_len": args.prompt_len,
                 "steps": args.steps}
    plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v})
    if not args.workload:
        plan = dataclasses.replace(plan, workload=None)

    before = measure_limits(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_bench_model(args.model_size, tmp)
        runs, config = run_roofline(model_dir, plan, args.attention_backend)
    after = measure_limits(args.quick)
    limits = best_limits(before, after)
    model = ModelShape(**config["model_shape"])
    rows = [summarize(name, run, model, limits, whole_run=name == WORKLOAD)
            for name, run in runs]
    config["model"] = args.model or args.model_size
    print_report(rows, limits, f"Roofline per step: {config['model']} "
                               f"({config['parameters'] / 1e6:.1f}M, float32, "
                               f"{config['attention_backend']} attention)")
    path = write_result("roofline", {
        "config": config,
        "limits": {**asdict(limits), "ridge_flop_per_byte": limits.ridge,
                   "before": asdict(before), "after": asdict(after)},
        "rows": rows,
    }, args.json)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
