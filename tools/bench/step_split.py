"""Where a decode step's wall time goes, on any device: timers around the
engine's parts.

    python -m tools.bench.step_split --device cuda      # graphs, then eager
    python -m tools.bench.step_split --batch 8 --steps 10
    python -m tools.bench.step_split --v1               # the V1 engine's parts

The classic engine on the benchmark model runs `--batch` requests of
`--prompt-len` tokens to the point where all of them decode, then times
`--steps` decode steps of the whole batch, part by part:

    schedule        Scheduler.schedule
    prepare_inputs  ModelRunner.prepare_model_input
    model           ModelRunner.execute_model, the sampler left out
                    (the forward or the graph replay, the LM head)
    sampler         Sampler.forward
    process         LLMEngine._process_model_outputs
    other           the rest of LLMEngine.step

With `--v1`, the V1 engine (its engine core in this process), whose parts
are named for the same work: `schedule` is V1's Scheduler.schedule;
`prepare_inputs` GPUModelRunner._update_states and _prepare_inputs (the
persistent batch's diff, then the step's tensors); `model` the rest of
GPUModelRunner.execute_model but the sampler; `process` the scheduler's
update_from_output and the front end's OutputProcessor.process_outputs.

On a CPU every part's time is its own. On a GPU work is queued, and the
host waits only where it reads a result back, in the sampler; so on a GPU
each engine is timed twice. As it runs, the sampler's time includes the
wait for the model's kernels; in the second run ("synced sampler") a
`torch.cuda.synchronize()` before and after the sampler charges that wait
to `model` and leaves the sampler its own time, at the price of a step a
little longer. `tools.bench.roofline` splits a CPU step by the profiler,
operator by operator; this is its coarse twin for a GPU, where a profiler
would distort a 5 ms step. Only this engine's objects are wrapped, and
only while the timing runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator

import torch

from minivllm import LLM, SamplingParams
from minivllm.v1.engine.core_client import InprocClient
from tools.bench.common import (
    BLOCK_SIZE,
    add_model_args,
    make_bench_model,
    print_table,
    set_threads,
)
from tools.bench.profiling import timed_into, wrap_method

PARTS = ("schedule", "prepare_inputs", "model", "sampler", "process", "other")


@contextlib.contextmanager
def timed_parts(llm: LLM, sync: bool = False) -> Iterator[dict[str, float]]:
    """Seconds spent in each part of the engine's steps while the block runs
    (`model` and `other` are filled in at the end, from the totals)."""
    engine = llm.llm_engine
    core = v1_engine_core(llm)
    seconds = dict.fromkeys(("step", "execute", *PARTS), 0.0)
    device_sync = torch.cuda.synchronize if sync and torch.cuda.is_available() else None
    undo: list[Callable[[], None]] = []

    def time_calls(
        obj: object, attr: str, part: str, synced: Callable[[], None] | None = None
    ) -> None:
        wrap_method(obj, attr, functools.partial(timed_into, seconds, part, synced), undo)

    time_calls(engine, "step", "step")
    if core is None:
        runner = engine.worker.model_runner
        time_calls(engine.scheduler, "schedule", "schedule")
        time_calls(runner, "prepare_model_input", "prepare_inputs")
        time_calls(engine, "_process_model_outputs", "process")
    else:  # V1: the inputs are prepared inside execute_model
        runner = core.model_executor.driver_worker.model_runner
        time_calls(core.scheduler, "schedule", "schedule")
        time_calls(runner, "_update_states", "prepare_inputs")
        time_calls(runner, "_prepare_inputs", "prepare_inputs")
        time_calls(core.scheduler, "update_from_output", "process")
        time_calls(engine.output_processor, "process_outputs", "process")
    time_calls(runner, "execute_model", "execute")
    time_calls(runner.sampler, "forward", "sampler", device_sync)
    try:
        yield seconds
    finally:
        for restore in reversed(undo):
            restore()
        seconds["model"] = seconds.pop("execute") - seconds["sampler"]
        if core is not None:
            seconds["model"] -= seconds["prepare_inputs"]
        seconds["other"] = seconds["step"] - sum(seconds[p] for p in PARTS if p != "other")


def v1_engine_core(llm: LLM):
    """V1's engine core when `llm` runs V1 in this process, None for the
    classic engine; V1 in a process of its own cannot be timed from here."""
    engine = llm.llm_engine
    if not hasattr(engine, "engine_core"):
        return None
    if not isinstance(engine.engine_core, InprocClient):
        raise ValueError(
            "step_split times V1's engine core in this process: unset "
            "MINIVLLM_ENABLE_V1_MULTIPROCESSING"
        )
    return engine.engine_core.engine_core


def decode_split(llm: LLM, batch: int, prompt_len: int, steps: int, sync: bool) -> dict:
    """Milliseconds per decode step of `batch` sequences, by part."""
    engine = llm.llm_engine
    core = v1_engine_core(llm)
    scheduler = engine.scheduler if core is None else core.scheduler
    vocab = engine.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"split-{sync}-{i}", {"prompt_token_ids": prompt}, params)

    def prefilling(request) -> bool:
        if core is None:  # a SequenceGroup
            return request.is_prefill()
        return request.num_computed_tokens < request.num_prompt_tokens

    while scheduler.waiting or any(prefilling(r) for r in scheduler.running):
        engine.step()
    engine.step()  # the first decode: buffers and graphs warm
    with timed_parts(llm, sync) as seconds:
        for _ in range(steps):
            if len(scheduler.running) != batch:
                raise RuntimeError(f"a timed step must decode all {batch} sequences")
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return {part: 1e3 * s / steps for part, s in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--dtype", default=None, help="float16 on a GPU, float32 on a CPU")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--v1", action="store_true", help="the V1 engine (use_v1=True)")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    on_gpu = args.device == "cuda"
    dtype = args.dtype or ("float16" if on_gpu else "float32")
    with tempfile.TemporaryDirectory() as directory:
        model_dir = args.model or make_bench_model(args.model_size, directory)
        rows = []
        max_model_len = args.prompt_len + args.steps + 16
        # A cache of exactly what the batch needs: by gpu_memory_utilization
        # the first engine takes 90 % of the card, and on an H200 the second
        # found it still in use after `del llm` (-284 MB left).
        num_blocks = args.batch * -(-max_model_len // BLOCK_SIZE)
        for eager in (False, True) if on_gpu else (True,):
            llm = LLM(model_dir, device=args.device, dtype=dtype, enforce_eager=eager,
                      max_model_len=max_model_len, max_num_seqs=args.batch,
                      block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks,
                      swap_space=0, seed=0, use_v1=args.v1)
            for sync in (False, True) if on_gpu else (False,):
                ms = decode_split(llm, args.batch, args.prompt_len, args.steps, sync)
                name = ("eager" if eager else "CUDA graphs") if on_gpu else "engine"
                rows.append({"run": name + (", synced sampler" if sync else ""),
                             "ms/step": round(ms["step"], 2),
                             **{p: round(ms[p], 2) for p in PARTS}})
            del llm
    engine = "V1" if args.v1 else "The classic engine"
    print_table(rows, f"{engine}: decode steps of {args.batch} sequences, "
                      f"{args.prompt_len}-token prompts, {args.model_size} model in {dtype} "
                      f"on {args.device} (ms per step, mean of {args.steps} steps)")


if __name__ == "__main__":
    main()
