"""Small CPU steps on one thread (worker/cpu_threads.py): the load-time
check picks the largest step size up to which one thread wins, refuses when
one thread changes a product's bits, and the workers run exactly the steps
of at most that many tokens on one thread, with the same tokens and
logprobs, bit for bit, as steps run on the whole pool."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model_executor.layers.utils import supports_packed_cpu_gemm
from minivllm.worker import cpu_threads
from minivllm.worker.cpu_threads import (
    STEP_TOKENS_TRIED,
    largest_one_thread_win,
    one_thread_max_tokens,
    step_threads,
)


@pytest.fixture
def two_threads():
    """torch on 2 threads for the test (make test runs on 1), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "wins, expected, asked",
    [
        ("TTTFFF", 4, [1, 2, 4, 8]),
        ("FTTTTT", 0, [1]),
        ("TTTTTT", 32, [1, 2, 4, 8, 16, 32]),
        # The first loss ends it: wins at larger sizes after it do not count.
        ("TFTTTT", 1, [1, 2]),
    ],
)
def test_largest_one_thread_win(wins, expected, asked):
    """`wins`: whether one thread won at each of STEP_TOKENS_TRIED."""
    tried = []

    def faster_alone(n: int) -> bool:
        tried.append(n)
        return wins[STEP_TOKENS_TRIED.index(n)] == "T"

    assert largest_one_thread_win(STEP_TOKENS_TRIED, faster_alone) == expected
    assert tried == asked  # smallest first, none after the first loss


def test_step_threads_one_thread_only_for_small_steps(two_threads):
    for num_tokens, max_tokens, inside in [(1, 4, 1), (4, 4, 1), (5, 4, 2), (1, 0, 2)]:
        with step_threads(num_tokens, max_tokens):
            assert torch.get_num_threads() == inside, (num_tokens, max_tokens)
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), step_threads(1, 4):
        raise RuntimeError("a step that fails")
    assert torch.get_num_threads() == 2  # put back all the same


class FakeLayer(torch.nn.Module):
    def __init__(self, out_features: int = 16, in_features: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features))


def test_no_check_where_it_cannot_pay(two_threads, monkeypatch):
    def must_not_run(*args):
        raise AssertionError("no product should be timed")

    monkeypatch.setattr(cpu_threads, "unquantized_gemm", must_not_run)
    layers = [FakeLayer()]
    assert one_thread_max_tokens(layers, torch.device("cuda")) == 0
    assert one_thread_max_tokens([], torch.device("cpu")) == 0
    torch.set_num_threads(1)
    assert one_thread_max_tokens(layers, torch.device("cpu")) == 0


def product_costing(seconds_at: dict[int, float], perturb_alone: bool = False):
    """A stand-in for the layers' product whose time depends on the rows and
    on the thread count it runs on: seconds_at[threads](rows) seconds."""

    def product(layer, x):
        threads = torch.get_num_threads()
        time.sleep(seconds_at[threads](x.shape[0]))
        out = x @ layer.weight.detach().T
        if perturb_alone and threads == 1:
            out = torch.nextafter(out, torch.full_like(out, float("inf")))  # one bit off
        return out

    return product


def test_threshold_follows_the_timed_products(two_threads, monkeypatch):
    # One thread takes 1 ms a row, the pool 10 ms plus 0.1 ms a row (its
    # wake-ups): one thread wins up to 8 rows, loses from 16 (16 ms > 11.6).
    costs = {1: lambda rows: 1e-3 * rows, 2: lambda rows: 10e-3 + 1e-4 * rows}
    monkeypatch.setattr(cpu_threads, "unquantized_gemm", product_costing(costs))
    assert one_thread_max_tokens([FakeLayer()], torch.device("cpu")) == 8


def test_a_near_tie_keeps_the_pool(two_threads, monkeypatch):
    # One thread 1 % faster at every size: inside ONE_THREAD_MARGIN, so never.
    costs = {1: lambda rows: 9.9e-3, 2: lambda rows: 10e-3}
    monkeypatch.setattr(cpu_threads, "unquantized_gemm", product_costing(costs))
    assert one_thread_max_tokens([FakeLayer()], torch.device("cpu")) == 0


def test_other_bits_on_one_thread_mean_never(two_threads, monkeypatch):
    # One thread would win everywhere, but it changes the last bit of a product.
    costs = {1: lambda rows: 0.0, 2: lambda rows: 2e-3}
    monkeypatch.setattr(
        cpu_threads, "unquantized_gemm", product_costing(costs, perturb_alone=True)
    )
    assert one_thread_max_tokens([FakeLayer()], torch.device("cpu")) == 0


@pytest.mark.skipif(
    not supports_packed_cpu_gemm(torch.empty(1, 1)), reason="needs an x86 CPU with oneDNN"
)
def test_one_thread_gives_the_pools_bits_for_real_layers(two_threads, tiny_model_dir):
    """On the tiny model's packed layers, oneDNN on one thread gives every
    product the bits it gives on two (the check does not refuse), so a step
    may switch."""
    llm = LLM(tiny_model_dir("llama"), kv_cache_memory_bytes=1 << 22)
    runner = llm.llm_engine.worker.model_runner
    assert runner.packed_layers
    found = one_thread_max_tokens(runner.packed_layers, runner.device)
    assert found in (0, *STEP_TOKENS_TRIED)
    # 0 could be a timing; the bits themselves must agree.
    g = torch.Generator().manual_seed(1)
    for layer in runner.packed_layers:
        for rows in (1, 3, 7):
            x = torch.randn(rows, layer.weight.shape[1], generator=g)
            pooled = cpu_threads.unquantized_gemm(layer, x)
            with cpu_threads.set_threads(1):
                alone = cpu_threads.unquantized_gemm(layer, x)
            assert torch.equal(pooled.view(torch.int32), alone.view(torch.int32))


def run_and_spy(llm: LLM, worker, max_tokens: int) -> tuple[list, list[tuple[int, int]]]:
    """Outputs of a mixed workload with steps of at most `max_tokens` tokens
    on one thread, and (tokens, threads) of every step the worker's runner ran."""
    worker.one_thread_max_tokens = max_tokens
    runner = worker.model_runner
    seen: list[tuple[int, int]] = []
    execute = runner.execute_model

    def spy(inputs, *args):
        tokens = (
            inputs.total_num_scheduled_tokens
            if hasattr(inputs, "total_num_scheduled_tokens")
            else inputs.input_ids.shape[0]
        )
        seen.append((tokens, torch.get_num_threads()))
        return execute(inputs, *args)

    runner.execute_model = spy
    try:
        # Three prompts of 3-7 tokens, then decodes of 3, 2 and 1 sequences.
        prompts = [{"prompt_token_ids": list(range(5 + 2 * i, 8 + 3 * i))} for i in range(3)]
        params = [
            SamplingParams(temperature=0, max_tokens=6, logprobs=3),
            SamplingParams(temperature=0.8, seed=7, max_tokens=9, logprobs=3),
            SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, logprobs=3),
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.execute_model = execute
    return outputs, seen


def logprob_bits(outputs) -> list:
    return [
        [
            [(t, lp.logprob) for t, lp in sorted(entry.items())]
            for entry in out.outputs[0].logprobs
        ]
        for out in outputs
    ]


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_small_steps_run_on_one_thread_with_the_same_bits(two_threads, tiny_model_dir, use_v1):
    llm = LLM(
        tiny_model_dir("llama"), kv_cache_memory_bytes=1 << 22, use_v1=use_v1,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    worker = (
        engine.engine_core.engine_core.model_executor.driver_worker if use_v1 else engine.worker
    )
    pooled, pooled_steps = run_and_spy(llm, worker, 0)
    alone, alone_steps = run_and_spy(llm, worker, 4)
    assert {threads for _, threads in pooled_steps} == {2}
    assert [tokens for tokens, _ in alone_steps] == [tokens for tokens, _ in pooled_steps]
    # Exactly the steps of at most 4 tokens ran on one thread, and there were both kinds.
    assert [threads for _, threads in alone_steps] == [
        1 if tokens <= 4 else 2 for tokens, _ in alone_steps
    ]
    assert {threads for _, threads in alone_steps} == {1, 2}
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in pooled]
    assert logprob_bits(alone) == logprob_bits(pooled)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_tensor_parallel_ranks_keep_their_threads(tiny_model_dir, monkeypatch, caplog,
                                                  tensor_parallel_size):
    """Whatever the timing says, a tensor-parallel worker never switches:
    one rank on fewer threads would hold the others up at each all-reduce.
    (The driver worker runs in this process, where the timing is patched.)
    A worker that switches says so in its start-up log."""
    from minivllm.worker import worker

    monkeypatch.setattr(worker, "one_thread_max_tokens", lambda *args: 8)
    with caplog.at_level(logging.INFO, logger="minivllm.worker.worker"):
        llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=tensor_parallel_size,
                  disable_log_stats=True, kv_cache_memory_bytes=1 << 22)
    switches = tensor_parallel_size == 1
    assert llm.llm_engine.worker.one_thread_max_tokens == (8 if switches else 0)
    said = [r.getMessage() for r in caplog.records if "on one CPU thread" in r.getMessage()]
    assert said == (["steps of at most 8 tokens run on one CPU thread, larger ones on "
                     f"{torch.get_num_threads()} (worker/cpu_threads.py)"] if switches else [])
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                         SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    llm.llm_engine.model_executor.shutdown()
