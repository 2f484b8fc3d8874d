"""A long trace for timing the tracer's views, written by the dry run.

    python tools/bench/long_trace.py --steps 20000 -o long.jsonl [--model DIR]
    /usr/bin/time -v minivllm-trace render long.jsonl -o steps.html --steps 0:20000

A request arrives every 12 steps (8 to 119 prompt tokens, 20 to 149 new
ones) on 64 blocks of 16 tokens, at most 8 running: the block tables change
every few steps, as in a busy server, and 20,000 steps make about 53 MB.
The tiny random Llama of the tests gives the configuration; the dry run
loads no weights, so 20,000 steps take seconds. Not a test: what is timed
is up to whoever runs it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minivllm import LLM, SamplingParams  # noqa: E402
from tools.tiny_models import make_tiny_model  # noqa: E402

ARRIVAL_EVERY = 12


def write_long_trace(model: str, path: str, num_steps: int, seed: int = 0) -> None:
    llm = LLM(model, dry_run=True, trace=path, num_gpu_blocks_override=64, max_num_seqs=8)
    engine = llm.llm_engine
    vocab = engine.model_config.hf_config.vocab_size
    rng = random.Random(seed)
    for n in range(num_steps):
        if n % ARRIVAL_EVERY == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 120))]
            params = SamplingParams(max_tokens=rng.randrange(20, 150))
            engine.add_request(str(n), {"prompt_token_ids": prompt}, params)
        engine.step()
    engine.stop_trace()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("-o", "--output", default="long.jsonl")
    parser.add_argument("--model", help="default: a tiny random Llama, made here")
    args = parser.parse_args()
    model = args.model or make_tiny_model("llama", os.path.join(tempfile.mkdtemp(), "tiny"))
    start = time.perf_counter()
    write_long_trace(model, args.output, args.steps)
    size = os.path.getsize(args.output) / 1e6
    print(
        f"wrote {args.output}: {args.steps} steps, {size:.1f} MB, "
        f"{time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
