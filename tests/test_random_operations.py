"""Random add / abort / step sequences on a real model with a tight KV cache.

Each case draws an engine configuration (preemption mode, a CPU pool from
empty to roomy, prefix caching, chunked prefill) and a stream of operations:
requests with random prompts (some sharing prefixes) and random sampling
(greedy, or seeded with n and best_of up to 3), aborts of live requests, and
steps. The oracle is the same requests run to completion on an engine with a
cache too large to preempt: seeded sampling and greedy decoding do not
depend on what else shares the batch, so every request that finished on its
own must give exactly the same tokens there, and an aborted one a prefix of
them. Afterwards the tight engine holds nothing: no request, no block.
"""

from __future__ import annotations

import random

import pytest

from minivllm import LLM, SamplingParams
from minivllm.worker.cache_engine import CacheEngine
from tests.engine_spies import record_schedules

NUM_OPERATIONS = 70
BLOCK_SIZE = 4


def random_options(rng: random.Random, block_bytes: int) -> dict:
    chunked = rng.random() < 0.5
    return dict(
        block_size=BLOCK_SIZE,
        # A request holds at most 3 sequences of 32 tokens: 24 blocks.
        num_gpu_blocks_override=rng.choice([24, 28]),
        swap_space=rng.choice([0, 6, 256]) * block_bytes / (1 << 30),
        preemption_mode=rng.choice([None, "recompute", "swap"]),
        enable_prefix_caching=rng.random() < 0.5,
        enable_chunked_prefill=chunked,
        max_num_seqs=8,
        max_num_batched_tokens=16 if chunked else None,
    )


def random_request(
    rng: random.Random, earlier: list[list[int]]
) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(2, 384) for _ in range(rng.randint(1, 16))]
    if earlier and rng.random() < 0.4:  # share a prefix with an earlier prompt
        prompt = (rng.choice(earlier)[: rng.randint(4, 12)] + prompt)[:16]
    max_tokens = rng.randint(1, 16)
    ignore_eos = rng.random() < 0.7
    if rng.random() < 0.35:
        return prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    n = rng.choice([1, 2])
    return prompt, SamplingParams(
        n=n,
        best_of=rng.choice([n, n + 1]),
        temperature=rng.choice([0.7, 1.0]),
        top_k=rng.choice([-1, 20]),
        seed=rng.randrange(1 << 32),
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        logprobs=rng.choice([None, 2]),
    )


def drive(llm: LLM, rng: random.Random) -> tuple[dict, dict, set[str]]:
    """Random operations, then steps until done. Returns (requests by id,
    final outputs by id, ids aborted by the driver)."""
    engine = llm.llm_engine
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    finals, aborted, live = {}, set(), []

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                live.remove(out.request_id)

    for i in range(NUM_OPERATIONS):
        r = rng.random()
        if r < 0.45:
            rid = f"r{i}"
            requests[rid] = random_request(rng, [p for p, _ in requests.values()])
            engine.add_request(rid, {"prompt_token_ids": requests[rid][0]}, requests[rid][1])
            live.append(rid)
        elif r < 0.5 and live:
            rid = rng.choice(live)
            engine.abort_request(rid)
            aborted.add(rid)
        elif engine.has_unfinished_requests():
            step()
    while engine.has_unfinished_requests():
        step()
    assert not live
    return requests, finals, aborted


def completions(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_match_a_roomy_engine(seed, tiny_model_dir):
    model = tiny_model_dir("llama")
    rng = random.Random(seed)
    roomy = LLM(model, block_size=BLOCK_SIZE, num_gpu_blocks_override=1024)
    block_bytes = CacheEngine.get_cache_block_size(BLOCK_SIZE, roomy.llm_engine.model_config)
    options = random_options(rng, block_bytes)
    tight = LLM(model, **options)
    schedules = record_schedules(tight)
    requests, finals, aborted = drive(tight, rng)
    assert any(out.preempted for _, out in schedules), "the cache should be tight"
    assert set(finals) == set(requests), "every request finishes exactly once"

    ids = sorted(requests)
    expected = dict(zip(ids, roomy.generate(
        [{"prompt_token_ids": requests[rid][0]} for rid in ids],
        [requests[rid][1] for rid in ids], use_tqdm=False,
    ), strict=True))
    checked = 0
    for rid, out in finals.items():
        reasons = {c.finish_reason for c in out.outputs}
        if "abort" not in reasons:
            assert completions(out) == completions(expected[rid]), (rid, options)
            checked += 1
        elif requests[rid][1].best_of == requests[rid][1].n:
            # Stopped early (by the driver, or by the scheduler with nowhere
            # to swap it): each sequence so far is the start of the full one.
            full = completions(expected[rid])
            for tokens in completions(out):
                assert any(f[: len(tokens)] == tokens for f in full), (rid, options)
    assert checked >= len(requests) // 2, "most requests run to their own end"

    engine = tight.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == options["num_gpu_blocks_override"]
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks
