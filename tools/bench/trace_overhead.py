"""What tracing costs per step, with the tiny model on the CPU and in a dry run.

    python tools/bench/trace_overhead.py [--repeats 3] [--model DIR]

The same workload (16 prompts of 24-96 tokens, 48 new tokens each, at most
8 running at once, so steps mix prefills and decodes) runs untraced and
traced, alternately, `--repeats` times; each run's first step is left out
(warm-up) and the best of the repeats is kept. Two figures:

- A/B: mean step time traced over untraced. Honest but noisy on a shared
  machine: two runs never see the same load.
- in-step: within each traced step, its wall time minus the schedule,
  execute and process phases the trace itself records; what is left is the
  tracer's work (the queue snapshot, flattening the batch, building and
  writing the JSON line), measured under the same load as the step.

Two engines: the tiny random Llama of the tests (a real forward pass), and
the dry run (no model: the scheduler, block manager and output processing
alone), where the tracer's cost stands out most. Not a test: timings vary
by machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minivllm import LLM, SamplingParams  # noqa: E402
from tools.tiny_models import make_tiny_model  # noqa: E402

NUM_PROMPTS = 16
MAX_TOKENS = 48


def step_times_ms(model: str, dry_run: bool, trace: str | None) -> list[float]:
    """Wall time of every step but the first, in ms."""
    llm = LLM(model, dry_run=dry_run, trace=trace, max_num_seqs=8, seed=0)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_PROMPTS):
        length = 24 + (i * 37) % 73
        prompt = {"prompt_token_ids": [2 + (i + j) % 300 for j in range(length)]}
        engine.add_request(str(i), prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    engine.stop_trace()
    return times[1:]


def phase_ms(trace: str) -> list[float]:
    """Per step but the first: schedule + execute + process, as traced."""
    with open(trace, encoding="utf-8") as f:
        steps = [json.loads(line) for line in f if '"type":"step"' in line]
    return [sum(s["timings"].values()) for s in steps[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="checkpoint directory (default: a tiny random Llama)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    model = args.model or make_tiny_model("llama", os.path.join(tmp, "tiny-llama"))
    trace = os.path.join(tmp, "trace.jsonl")
    columns = ("steps", "untraced ms", "traced ms", "A/B", "tracer ms", "in-step")
    print(f"{'engine':<20}" + "".join(f"{c:>13}" for c in columns))
    for label, dry_run in (("model on CPU", False), ("dry run (no model)", True)):
        plain, traced, extra = [], [], []
        for _ in range(args.repeats):
            plain.append(statistics.mean(step_times_ms(model, dry_run, None)))
            walls = step_times_ms(model, dry_run, trace)
            traced.append(statistics.mean(walls))
            phases = phase_ms(trace)
            extra.append(statistics.mean(w - p for w, p in zip(walls, phases, strict=True)))
        base, with_trace, tracer = min(plain), min(traced), min(extra)
        row = (
            f"{len(walls):>13}{base:>13.3f}{with_trace:>13.3f}"
            f"{(with_trace / base - 1) * 100:>12.1f}%{tracer:>13.3f}{tracer / base * 100:>12.1f}%"
        )
        print(f"{label:<20}{row}")
    print(f"trace size: {os.path.getsize(trace) / 1e3:.0f} kB for {len(walls) + 1} steps")


if __name__ == "__main__":
    main()
