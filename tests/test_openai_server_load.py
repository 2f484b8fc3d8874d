"""Load: 64 streaming clients arriving as a seeded Poisson process, on a
KV cache small enough that the scheduler must preempt. Every request
completes exactly once with the offline engine's text, and afterwards no
block is held (the cache usage gauge is back to 0). The server's steps are
paced (tests/paced_scheduler.py), so the requests overlap as designed on a
machine of any speed."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from tests.server_utils import RemoteOpenAIServer, num_successes

pytestmark = pytest.mark.slow

MODEL = "minivllm-stories"
NUM_REQUESTS = 64
RATE = 40.0  # requests per second, on average
# 40 blocks of 16 tokens: about 12 of the 64 requests fit at once. At 20 ms a
# step or more, a request lives at least 0.16-1.3 s: about 30 are in flight.
ENGINE_FLAGS = ["--block-size", "16", "--num-gpu-blocks-override", "40",
                "--scheduler-cls", "tests.paced_scheduler.PacedScheduler"]
ENGINE = dict(block_size=16, num_gpu_blocks_override=40)
OPENINGS = [
    "Once upon a time",
    "The little dog",
    "Long ago, there was a shy rabbit called Tom",
    "One windy day",
    "There was a kind duck named Jack",
    "Mia had a red ball",
]


def workload(seed: int = 0) -> list[tuple[float, str, dict]]:
    """(arrival time, prompt, sampling fields) per request, all seeded."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / RATE, NUM_REQUESTS))
    requests = []
    for i, arrival in enumerate(arrivals):
        fields = {"max_tokens": int(rng.integers(8, 64))}
        if i % 2:
            fields |= {"temperature": 0.8, "seed": int(rng.integers(1 << 30))}
        else:
            fields |= {"temperature": 0.0}
        if i % 3 == 0:
            fields["ignore_eos"] = True
        requests.append((float(arrival), OPENINGS[i % len(OPENINGS)], fields))
    return requests


async def run_client(client, start: float, arrival: float, prompt: str, fields: dict):
    await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
    extra = {k: fields[k] for k in ("ignore_eos",) if k in fields}
    standard = {k: v for k, v in fields.items() if k not in extra}
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, stream=True, extra_body=extra, **standard
    )
    text, finishes = "", []
    async for chunk in stream:
        text += chunk.choices[0].text
        if chunk.choices[0].finish_reason is not None:
            finishes.append(chunk.choices[0].finish_reason)
    return text, finishes


def test_64_poisson_streaming_clients_get_the_offline_outputs_and_leak_nothing():
    requests = workload()
    llm = LLM(**ENGINE)
    expected = llm.generate(
        [prompt for _, prompt, _ in requests],
        [SamplingParams(**fields) for _, _, fields in requests],
        use_tqdm=False,
    )
    with RemoteOpenAIServer(ENGINE_FLAGS) as server:
        before = server.metrics()

        async def main():
            client = server.get_async_client()
            start = time.monotonic()
            return await asyncio.gather(
                *(run_client(client, start, *request) for request in requests)
            )

        results = asyncio.run(main())
        after = server.metrics()
    for (text, finishes), want in zip(results, expected, strict=True):
        assert finishes == [want.outputs[0].finish_reason]  # finished once
        assert text == want.outputs[0].text
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:gpu_cache_usage_perc"] == 0
    assert num_successes(after) - num_successes(before) == NUM_REQUESTS
    # The small cache made the scheduler preempt: the load was real.
    assert after["vllm:num_preemptions_total"] > 0
