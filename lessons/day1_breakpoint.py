"""Day 1: a tiny engine run to stop in a debugger (lessons/day1_the_map.md, section 4).

A dry run (no weights: the real scheduler and block manager, hashed tokens)
with a KV cache of only 10 blocks of 4 tokens, so requests are preempted by
SWAP: their blocks move to the CPU pool and come back later. Request B asks
for two completions (n=2), so its sequences share blocks and one step
copies a block (copy-on-write). Run it, or stop in it:

    python lessons/day1_breakpoint.py            # one line per step
    python -m pdb lessons/day1_breakpoint.py     # then: break <file>:<line>, continue

(Run from the repository root with `reference_impl` on PYTHONPATH, as the
labs do.)
"""

from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import LLMEngine

# request id -> (prompt length, max_tokens, n)
REQUESTS = {"A": (6, 10, 1), "B": (5, 8, 2), "C": (7, 6, 1)}


def build_engine() -> LLMEngine:
    """The scenario's engine, its requests added and no step taken."""
    llm = LLM(
        dry_run=True,
        block_size=4,
        num_gpu_blocks_override=10,
        swap_space=0.001,  # GiB: about a hundred CPU blocks to swap out to
        preemption_mode="swap",
        disable_log_stats=True,
    )
    engine = llm.llm_engine
    for request_id, (prompt_len, max_tokens, n) in REQUESTS.items():
        prompt = {"prompt_token_ids": list(range(10, 10 + prompt_len))}
        # n > 1 samples, so it needs a temperature; the dry run's tokens are hashes anyway.
        params = SamplingParams(
            n=n, temperature=0.8 if n > 1 else 0.0, max_tokens=max_tokens, ignore_eos=True
        )
        engine.add_request(request_id, prompt, params)
    return engine


def main() -> None:
    engine = build_engine()
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        done = [o.request_id for o in outputs if o.finished]
        print(f"step {step}: {len(outputs)} request(s) in the batch, finished {done}")
        step += 1


if __name__ == "__main__":
    main()
