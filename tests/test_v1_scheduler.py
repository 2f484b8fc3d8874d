"""V1's scheduler (`minivllm/v1/core/sched/scheduler.py`) driven step by step
with a simulated worker, on scenarios worked by hand from vLLM's
`vllm/v1/core/sched/scheduler.py`, and a property test over random workloads.

Conventions of the scenarios: blocks hold BS = 4 tokens; block 0 is the null
block, so a pool of N blocks hands out blocks 1..N-1, first from the head of
the free queue, which starts as [1, 2, ..., N-1]. Prompts are runs of
distinct token ids (`toks(start, n)`), so two prompts share cached blocks
only where a test says so. The simulated worker samples SAMPLED for every
request whose prompt (or recompute) is complete after the step, unless the
test picks another token, and nothing for a prompt chunk that is not.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.sampling_params import SamplingParams
from minivllm.utils import cdiv
from minivllm.v1.core.kv_cache_utils import get_request_block_hasher
from minivllm.v1.core.sched.scheduler import Scheduler
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.request import Request, RequestStatus

BS = 4
EOS = 2
SAMPLED = 7


def make_scheduler(
    *,
    blocks: int = 64,
    budget: int = 16,
    max_num_seqs: int = 4,
    max_model_len: int = 64,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = True,
    block_size: int = BS,
    long_prefill_token_threshold: int = 0,
    reserve_full_isl: bool = True,
) -> Scheduler:
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    cache_config.num_gpu_blocks = blocks
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduler_reserve_full_isl=reserve_full_isl,
    )
    return Scheduler(scheduler_config, cache_config)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make_request(
    rid: str,
    prompt: list[int],
    *,
    max_tokens: int = 16,
    arrival: float = 0.0,
    priority: int = 0,
    block_size: int = BS,
    **params,
) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        EOS,
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size),
    )


def worker_output(scheduler: Scheduler, out, sample: dict[str, int] | None = None):
    """What the worker would return for `out` (called right after schedule():
    a request has sampled iff its num_computed_tokens reached num_tokens)."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens == req.num_tokens
        sampled.append([(sample or {}).get(rid, SAMPLED)] if done else [])
    return ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)}, sampled)


def step(scheduler: Scheduler, sample: dict[str, int] | None = None):
    """One engine step: schedule, simulate the worker, take the tokens back.
    Returns (SchedulerOutput, {request id: EngineCoreOutput})."""
    out = scheduler.schedule()
    result = scheduler.update_from_output(out, worker_output(scheduler, out, sample))
    return out, {o.request_id: o for o in result.outputs}


def free_ids(scheduler: Scheduler) -> list[int]:
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    return [b.block_id for b in queue.get_all_free_blocks()]


def block_ids(scheduler: Scheduler, rid: str) -> list[int]:
    return scheduler.kv_cache_manager.get_block_ids(rid)


def new_req_data(out, rid):
    (data,) = [d for d in out.scheduled_new_reqs if d.req_id == rid]
    return data


# -- 1. one budget for running and waiting --------------------------------


def _two_decodes_and_a_long_prompt():
    """Budget 10. Step 1: A and B (3-token prompts) take 3 + 3 = 6. From
    step 2 each decodes one token, and C (20 tokens, arriving before step 2)
    gets what is left: 10 - 1 - 1 = 8 in step 2, 8 more in step 3 (16 of
    20 computed), and the last 20 - 16 = 4 in step 4, where the budget is
    not even full (1 + 1 + 4 = 6)."""
    s = make_scheduler(budget=10)
    s.add_request(make_request("A", toks(100, 3)))
    s.add_request(make_request("B", toks(200, 3)))
    outs = [step(s)]
    s.add_request(make_request("C", toks(300, 20)))
    outs += [step(s), step(s), step(s)]
    return s, outs


def test_running_decodes_come_first_and_a_waiting_prompt_is_chunked_into_what_is_left():
    s, outs = _two_decodes_and_a_long_prompt()
    expected = [
        {"A": 3, "B": 3},
        {"A": 1, "B": 1, "C": 8},
        {"A": 1, "B": 1, "C": 8},
        {"A": 1, "B": 1, "C": 4},
    ]
    assert [out.num_scheduled_tokens for out, _ in outs] == expected
    assert [out.total_num_scheduled_tokens for out, _ in outs] == [6, 10, 10, 6]
    # C samples only when its last chunk ran (step 4); A and B every step.
    assert ["C" in results for _, results in outs] == [False, False, False, True]
    assert outs[3][1]["C"].new_token_ids == [SAMPLED]
    assert all(results["A"].new_token_ids == [SAMPLED] for _, results in outs)
    c = s.requests["C"]
    assert c.num_computed_tokens == 20 and c.num_tokens == 21 and c.num_cached_tokens == 0


def test_new_requests_carry_all_their_blocks_and_cached_ones_only_the_blocks_added():
    """Same workload, block ids by hand (free queue [1, 2, ...]):
    step 1: A's 3 tokens need cdiv(3, 4) = 1 block -> [1]; B -> [2].
    step 2: A and B compute their 4th token: still 1 block, so [] each;
            C's first 8 tokens need 2 blocks -> [3, 4] (new request: all of them).
    step 3: A and B compute their 5th token: a 2nd block each, [5] and [6];
            C's tokens 8..15 need blocks 3 and 4 of the request -> [7, 8].
    The cached data says where each step starts: A and B have computed 4 and
    emitted 2 tokens (steps 1 and 2), C has computed 8 and emitted none."""
    s, outs = _two_decodes_and_a_long_prompt()
    (out1, _), (out2, _), (out3, _), _ = outs
    assert [(d.req_id, d.block_ids, d.num_computed_tokens) for d in out1.scheduled_new_reqs] == [
        ("A", [1], 0),
        ("B", [2], 0),
    ]
    assert out1.scheduled_cached_reqs.num_reqs == 0

    assert [(d.req_id, d.block_ids) for d in out2.scheduled_new_reqs] == [("C", [3, 4])]
    assert new_req_data(out2, "C").prompt_token_ids == toks(300, 20)
    cached = out2.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B"]
    assert cached.new_block_ids == [[], []]
    assert cached.num_computed_tokens == [3, 3]
    assert cached.num_output_tokens == [1, 1]

    assert out3.scheduled_new_reqs == []
    cached = out3.scheduled_cached_reqs
    assert cached.req_ids == ["A", "B", "C"]
    assert cached.new_block_ids == [[5], [6], [7, 8]]
    assert cached.num_computed_tokens == [4, 4, 8]
    assert cached.num_output_tokens == [2, 2, 0]
    # All three ran in the previous step: the worker's copy of their tokens is current.
    assert cached.resumed_req_ids == set() and cached.all_token_ids == {}
    assert block_ids(s, "C") == [3, 4, 7, 8, 9]  # step 4 added block 9 for tokens 16..19


# -- 2. chunked prefill, and without it ----------------------------------


def test_a_prompt_is_chunked_across_steps_and_samples_only_after_its_last_chunk():
    """Budget 4, a 10-token prompt: chunks 4, 4, 2 (10 = 4 + 4 + 2), so
    num_computed_tokens goes 4, 8, 10; only the step that reaches 10 = the
    prompt length samples a token. Then one token a step up to max_tokens = 3:
    steps 4 and 5 bring the 2nd and 3rd tokens, the last with "length"."""
    s = make_scheduler(budget=4)
    r = make_request("R", toks(100, 10), max_tokens=3)
    s.add_request(r)
    scheduled, computed, emitted = [], [], []
    for _ in range(5):
        out, results = step(s)
        scheduled.append(out.num_scheduled_tokens["R"])
        computed.append(r.num_computed_tokens)
        emitted.append(results["R"].new_token_ids if "R" in results else None)
    assert scheduled == [4, 4, 2, 1, 1]
    assert computed == [4, 8, 10, 11, 12]
    assert emitted == [None, None, [SAMPLED], [SAMPLED], [SAMPLED]]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [SAMPLED] * 3


@pytest.mark.parametrize("chunked", [True, False])
def test_without_chunking_a_prompt_longer_than_the_budget_left_waits_and_blocks_the_queue(
    chunked,
):
    """Budget 16 (= max_model_len, as unchunked scheduling requires). Step 1:
    A, B and E (4-token prompts) take 12 and sample; max_tokens = 2.
    Step 2: A, B and E decode (1 + 1 + 1), 13 left. C (14 tokens) arrived,
    then D (2).
      chunked:   C gets the 13 left, D nothing (budget 0).
      unchunked: 14 > 13, so C waits and the loop stops: D waits too, though
                 its 2 tokens would fit (the queue is served in order).
    A, B and E end with their 2nd token (length). Step 3, unchunked: C takes
    14 of 16 and D the 2 left; step 4 decodes both (1 + 1)."""
    s = make_scheduler(budget=16, max_model_len=16, max_num_seqs=5, chunked=chunked)
    for rid, start in (("A", 100), ("B", 200), ("E", 500)):
        s.add_request(make_request(rid, toks(start, 4), max_tokens=2))
    out1, _ = step(s)
    assert out1.num_scheduled_tokens == {"A": 4, "B": 4, "E": 4}
    s.add_request(make_request("C", toks(300, 14)))
    s.add_request(make_request("D", toks(400, 2)))
    out2, results = step(s)
    assert all(results[rid].finished for rid in "ABE")
    if chunked:
        assert out2.num_scheduled_tokens == {"A": 1, "B": 1, "E": 1, "C": 13}
        return
    assert out2.num_scheduled_tokens == {"A": 1, "B": 1, "E": 1}
    assert [r.request_id for r in s.waiting] == ["C", "D"]
    out3, _ = step(s)
    assert out3.num_scheduled_tokens == {"C": 14, "D": 2}
    out4, _ = step(s)
    assert out4.num_scheduled_tokens == {"C": 1, "D": 1}


# -- 3. preemption from the tail ------------------------------------------


@pytest.mark.parametrize(
    ("caching", "recomputed", "queue_after_a", "b_blocks", "c_blocks"),
    [(True, 4, [4, 3, 2, 1], [3, 4], [2]), (False, 8, [4, 2, 1, 3], [4, 2], [1])],
)
def test_the_tail_of_running_is_preempted_and_comes_back_finding_its_own_blocks(
    caching, recomputed, queue_after_a, b_blocks, c_blocks
):
    """5 blocks: 4 usable (1..4). Freed blocks join the free queue last
    block first: cached ones at the tail, uncached ones at the head.
    Step 1: A (8 tokens) takes 2 blocks [1, 2]; B (7 tokens) takes 2 more,
      [3, 4]. Block 3 is full (tokens 0..3 of B): cached; block 4 is not.
      Both sample: A has 9 tokens, B 8 (7 + 1).
    Step 2 (C, 3 tokens, arrived): A's 9th token needs a 3rd block; none is
      free, so the tail of RUNNING, B, is preempted: its blocks are freed
      last first (4 to the head, then 3: queue [4, 3]) and A takes block 4
      from the head. B goes to the front of WAITING (before C) with nothing
      computed. Block 3 and 15 tokens of budget are left, enough for C, but
      a step that preempted admits nobody. A ends (max_tokens = 2): its
      partial block 4 goes to the head, its cached 2 and 1 to the tail:
      queue [4, 3, 2, 1]. With caching off nothing is cached, every freed
      block goes to the head: [4, 2, 1, 3].
    Step 3: B comes back, resumed. Its 8 tokens allow a hit of 7 // 4 = 1
      block: block 3 still holds its first 4 tokens, so only 8 - 4 = 4 are
      recomputed, in blocks [3, 4]; the worker is sent all of B's tokens,
      the one it sampled before included. C takes block 2. With caching off
      all 8 are recomputed in blocks [4, 2] and C takes block 1. B samples
      again: its recompute is complete."""
    s = make_scheduler(blocks=5, caching=caching)
    a = make_request("A", toks(100, 8), max_tokens=2)
    b = make_request("B", toks(200, 7), max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    out1, _ = step(s)
    assert out1.num_scheduled_tokens == {"A": 8, "B": 7}
    assert block_ids(s, "A") == [1, 2] and block_ids(s, "B") == [3, 4]
    assert free_ids(s) == []

    s.add_request(make_request("C", toks(300, 3)))
    out2 = s.schedule()
    assert out2.preempted_req_ids == {"B"}
    assert out2.num_scheduled_tokens == {"A": 1}  # C not admitted: this step preempted
    assert out2.scheduled_new_reqs == []
    assert block_ids(s, "A") == [1, 2, 4] and free_ids(s) == [3]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["B", "C"]
    assert s.running == [a]
    s.update_from_output(out2, worker_output(s, out2))
    assert a.is_finished() and free_ids(s) == queue_after_a

    out3, results = step(s)
    assert out3.num_scheduled_tokens == {"B": recomputed, "C": 3}
    cached = out3.scheduled_cached_reqs
    assert cached.req_ids == ["B"] and cached.resumed_req_ids == {"B"}
    assert cached.all_token_ids == {"B": toks(200, 7) + [SAMPLED]}
    assert cached.num_computed_tokens == [8 - recomputed]
    assert cached.new_block_ids == [b_blocks]  # a resumed request's blocks replace its old ones
    assert [(d.req_id, d.block_ids) for d in out3.scheduled_new_reqs] == [("C", c_blocks)]
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 1
    assert results["B"].new_token_ids == [SAMPLED] and b.output_token_ids == [SAMPLED] * 2
    assert b.num_cached_tokens == 0  # reported once: the first time it was scheduled


# -- 4. priority -----------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "y", "x", "victim"),
    [
        ("priority", (5, 0.0), (0, 1.0), "Y"),  # Y is less important
        ("priority", (0, 5.0), (0, 1.0), "Y"),  # same priority: Y arrived later
        ("priority", (0, 0.0), (1, 1.0), "X"),  # X is less important: X itself
        ("fcfs", (5, 0.0), (0, 1.0), "X"),  # fcfs ignores priority: the tail, X
    ],
)
def test_priority_preempts_the_largest_priority_and_arrival_even_if_already_scheduled(
    policy, y, x, victim
):
    """5 blocks (1..4), (priority, arrival) given per case.
    Step 1: Y (4 tokens) alone: block [1]; it samples (5 tokens).
    Step 2: Y's 5th token needs block 2; X (8 tokens) arrives and takes
      [3, 4]. Both sample: Y has 6 tokens, X 9.
    Step 3: RUNNING is [Y, X]. Y's 6th token fits its 2 blocks: Y is
      scheduled (1 token). X's 9th token needs a 3rd block and none is free:
      - priority: the victim is the running request with the largest
        (priority, arrival_time). If that is Y, Y's token goes back to the
        budget and Y is preempted: its blocks [1, 2] are freed (queue [2, 1])
        and X takes block 2. The step schedules X's 1 token, not 2.
      - otherwise (fcfs: the tail; or X is the largest) X preempts itself
        and the step schedules Y's token only."""
    s = make_scheduler(blocks=5, policy=policy)
    yr = make_request("Y", toks(100, 4), priority=y[0], arrival=y[1])
    xr = make_request("X", toks(200, 8), priority=x[0], arrival=x[1])
    s.add_request(yr)
    assert step(s)[0].num_scheduled_tokens == {"Y": 4}
    s.add_request(xr)
    assert step(s)[0].num_scheduled_tokens == {"Y": 1, "X": 8}
    assert block_ids(s, "Y") == [1, 2] and block_ids(s, "X") == [3, 4]

    out = s.schedule()
    assert out.preempted_req_ids == {victim}
    survivor = "X" if victim == "Y" else "Y"
    assert out.num_scheduled_tokens == {survivor: 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == [survivor]
    preempted = s.requests[victim]
    assert preempted.status == RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == [survivor]
    if victim == "Y":
        assert block_ids(s, "X") == [3, 4, 2] and free_ids(s) == [1]
    else:
        assert block_ids(s, "Y") == [1, 2] and free_ids(s) == [4, 3]


def test_priority_ties_are_broken_by_request_id_in_string_order():
    """vLLM's `Request.__lt__`: priority, then arrival_time, then request_id
    compared as strings, whatever the order the requests were added in.
    Twelve requests of equal priority and arrival, added as 0_p, 1_p, ...,
    11_p; room for 3 (max_num_seqs): in string order '0_p' < '10_p' <
    '11_p' < '1_p', so those three are admitted, not 0_p, 1_p, 2_p.
    A lower priority value, then an earlier arrival, still come first."""
    s = make_scheduler(policy="priority", budget=64, max_num_seqs=3)
    for i in range(12):
        s.add_request(make_request(f"{i}_p", toks(100 + 10 * i, 4), arrival=5.0))
    assert [r.request_id for r in s.waiting][:4] == ["0_p", "10_p", "11_p", "1_p"]
    assert list(s.schedule().num_scheduled_tokens) == ["0_p", "10_p", "11_p"]

    s = make_scheduler(policy="priority", budget=64, max_num_seqs=3)
    s.add_request(make_request("a", toks(100, 4), priority=1, arrival=0.0))
    s.add_request(make_request("c", toks(200, 4), arrival=2.0))
    s.add_request(make_request("b", toks(300, 4), arrival=2.0))
    s.add_request(make_request("z", toks(400, 4), arrival=1.0))
    assert list(s.schedule().num_scheduled_tokens) == ["z", "b", "c"]


# -- 5. the prefix hit is capped at num_tokens - 1 -----------------------


def test_a_fully_cached_prompt_recomputes_its_last_block():
    """A (8 tokens = 2 full blocks) runs, is cached as blocks [1, 2], ends.
    B has the same 8 tokens. Both blocks are cached, but the hit is capped
    at 8 - 1 = 7 tokens, i.e. 7 // 4 = 1 block: the last token must be
    computed for its logits, and a block is hit whole or not at all. So B
    starts at 4 and computes 4 (block 1 shared, the second block new).
    C has those 8 tokens and one more: the cap is 9 - 1 = 8 tokens, 2 blocks,
    so C starts at 8 and computes only its 9th token."""
    s = make_scheduler()
    prompt = toks(100, 8)
    s.add_request(make_request("A", prompt, max_tokens=1))
    step(s)
    s.add_request(make_request("B", prompt, max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"B": 4}
    data = new_req_data(out, "B")
    assert data.num_computed_tokens == 4 and data.block_ids[0] == 1 and len(data.block_ids) == 2
    s.add_request(c := make_request("C", prompt + [999], max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"C": 1}
    data = new_req_data(out, "C")
    assert data.num_computed_tokens == 8 and data.block_ids[0] == 1 and len(data.block_ids) == 3
    assert c.num_cached_tokens == 8


def test_a_block_filled_by_decoding_is_cached_when_it_fills():
    """A 6-token prompt fills block 1 of the request (tokens 0..3) and half
    of its second block (4, 5). Decoding computes token 6 in step 2 and
    token 7 in step 3: the second block is full (4..7) once step 3 is
    scheduled, and is cached then. A request starting with those 8 tokens
    plus one hits both blocks: 8 tokens.
    (Regression: the manager used to count a running request's partly
    filled last block as cached, so it was never cached once full.)"""
    s = make_scheduler()
    r = make_request("R", toks(100, 6), max_tokens=3)
    s.add_request(r)
    pool = s.kv_cache_manager.block_pool
    for n in (1, 2):
        step(s)
        assert pool.get_cached_block(r.block_hashes[0]).block_id == 1
        assert len(r.block_hashes) == 1 + (n == 2)  # 8 tokens known after step 2
        assert block_ids(s, "R") == [1, 2] and pool.blocks[2].block_hash is None
    step(s)  # computes token 7; R ends (3 tokens)
    assert r.is_finished() and pool.blocks[2].block_hash == r.block_hashes[1]
    s.add_request(make_request("S", r.all_token_ids[:8] + [999]))
    out, _ = step(s)
    assert new_req_data(out, "S").num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"S": 1}


def _step_prefix_stats(s: Scheduler):
    """One step; (scheduled tokens, that step's PrefixCacheStats as counts)."""
    out = s.schedule()
    result = s.update_from_output(out, worker_output(s, out))
    st = result.scheduler_stats.prefix_cache_stats
    counts = (st.requests, st.queries, st.hits)
    preempted = (st.preempted_requests, st.preempted_queries, st.preempted_hits)
    return out.num_scheduled_tokens, counts, preempted


def test_prefix_cache_stats_count_a_blocked_request_once_when_it_is_admitted():
    """vLLM records a lookup when the request is admitted
    (`record_prefix_cache_stats` after allocate_slots succeeds), not each
    time the head of WAITING is looked up and does not fit.
    5 blocks (1..4). A (13 tokens, max_tokens 3) takes all 4 blocks in step
    1; its first block (tokens 100..103) is cached at once. B (6 tokens:
    A's first 4, then 2 of its own) is looked up in steps 1, 2 and 3: it
    hits 4 tokens but needs a new block and none is free, so it waits. A
    ends after step 3 (3 tokens). Step 4 admits B: only now is B counted,
    once: 1 request, 6 queries, 4 hits. Over the four steps: 2 requests,
    13 + 6 = 19 queries, 4 hits (counting each lookup would give 4, 31, 12)."""
    s = make_scheduler(blocks=5)
    s.add_request(make_request("A", toks(100, 13), max_tokens=3))
    s.add_request(make_request("B", toks(100, 4) + toks(200, 2)))
    steps = [_step_prefix_stats(s) for _ in range(4)]
    assert [sched for sched, _, _ in steps] == [{"A": 13}, {"A": 1}, {"A": 1}, {"B": 2}]
    assert [counts for _, counts, _ in steps] == [(1, 13, 0), (0, 0, 0), (0, 0, 0), (1, 6, 4)]
    assert all(preempted == (0, 0, 0) for _, _, preempted in steps)


def test_prefix_cache_stats_count_a_resumed_request_once_apart_when_it_is_readmitted():
    """A preempted request is counted in the preempted_* stats, with all its
    tokens (prompt and output) as queries, once, when it is admitted again.
    5 blocks (1..4). Step 1: A (8 tokens, max_tokens 3) takes [1, 2], B (7
    tokens) [3, 4]; block 3 (B's first 4 tokens) is cached. Both sample.
    Step 2: A's 9th token needs a block: B is preempted (free queue [4, 3])
    and A takes block 4; a step that preempts admits nobody, so no lookup.
    Step 3: B (now 8 tokens) hits block 3 (4 tokens) but needs one more
    block besides it, and block 3 is the only free one: B waits, uncounted.
    A ends (3 tokens). Step 4: B is admitted: 1 preempted request, 8
    queries, 4 hits."""
    s = make_scheduler(blocks=5)
    s.add_request(make_request("A", toks(100, 8), max_tokens=3))
    s.add_request(make_request("B", toks(200, 7)))
    steps = [_step_prefix_stats(s) for _ in range(4)]
    assert [sched for sched, _, _ in steps] == [{"A": 8, "B": 7}, {"A": 1}, {"A": 1}, {"B": 4}]
    assert [counts for _, counts, _ in steps] == [(2, 15, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    assert [pre for _, _, pre in steps] == [(0, 0, 0), (0, 0, 0), (0, 0, 0), (1, 8, 4)]


# -- 6. free-queue order and LRU eviction ---------------------------------


def test_finished_blocks_are_freed_tail_first_and_evicted_least_recently_freed_first():
    """7 blocks (1..6).
    Step 1: A and B (8 tokens each, max_tokens 1) take [1, 2] and [3, 4],
      both cached, and end in that order. Each frees last block first:
      queue [5, 6] + [2, 1] + [4, 3].
    Step 2: C (15 tokens) needs cdiv(15, 4) = 4 blocks: 5, 6, then 2 and 1,
      evicting all of A's cached blocks (A was freed before B: least
      recently). C caches 3 full blocks (5, 6, 2); its last, 1, holds 3
      tokens. C ends, freeing 1, 2, 6, 5: the uncached 1 to the head, the
      cached ones to the tail: queue [1] + [4, 3] + [2, 6, 5].
    Step 3: E = B's prompt + 1 token hits B's 2 blocks (3, 4: cap 8 tokens)
      and takes 1 new block from the head, 1; D = A's prompt + 1 token finds nothing
      (A's first block went first: the chain breaks there) and takes 3
      blocks [2, 6, 5]."""
    s = make_scheduler(blocks=7)
    s.add_request(make_request("A", toks(100, 8), max_tokens=1))
    s.add_request(make_request("B", toks(200, 8), max_tokens=1))
    _, results = step(s)
    assert results["A"].finished and results["B"].finished
    assert free_ids(s) == [5, 6, 2, 1, 4, 3]

    s.add_request(make_request("C", toks(300, 15), max_tokens=1))
    out, _ = step(s)
    assert new_req_data(out, "C").block_ids == [5, 6, 2, 1]
    assert free_ids(s) == [1, 4, 3, 2, 6, 5]

    s.add_request(make_request("E", toks(200, 8) + [999], max_tokens=1))
    s.add_request(make_request("D", toks(100, 8) + [999], max_tokens=1))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"E": 1, "D": 9}
    e, d = new_req_data(out, "E"), new_req_data(out, "D")
    assert (e.num_computed_tokens, e.block_ids) == (8, [3, 4, 1])
    assert (d.num_computed_tokens, d.block_ids) == (0, [2, 6, 5])


# -- 7. update_from_output ---------------------------------------------------


def _run_one(sampled: list[int], **params):
    """R (3 tokens) runs one step per sampled token; returns the scheduler,
    R and the EngineCoreOutput of the step it ended (or of the last step)."""
    s = make_scheduler(blocks=8)
    r = make_request("R", toks(100, 3), **params)
    s.add_request(r)
    last = None
    for token in sampled:
        _, results = step(s, {"R": token})
        last = results["R"]
        if last.finished:
            break
    return s, r, last


def test_eos_stops_with_stop_and_the_next_step_reports_the_request_finished():
    s, r, out = _run_one([SAMPLED, EOS, SAMPLED])
    assert r.output_token_ids == [SAMPLED, EOS]  # EOS is kept, nothing after it
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert str(out.finish_reason) == "stop" and out.new_token_ids == [EOS]
    assert "R" not in s.requests and s.running == []
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 7  # all blocks back
    assert s.schedule().finished_req_ids == {"R"}  # the worker is told once
    assert s.schedule().finished_req_ids == set()


def test_a_stop_token_id_stops_with_its_id_as_stop_reason():
    _, r, out = _run_one([SAMPLED, 42], stop_token_ids=[42])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert str(out.finish_reason) == "stop" and out.stop_reason == 42


def test_max_tokens_ends_with_length_and_ignore_eos_runs_through_eos():
    _, r, out = _run_one([EOS, EOS, EOS, EOS], max_tokens=3, ignore_eos=True)
    assert r.output_token_ids == [EOS] * 3
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and str(out.finish_reason) == "length"


def test_min_tokens_suppresses_eos_until_that_many_tokens():
    """min_tokens = 2: the EOS as 1st token does not stop (1 < 2); as 2nd it does."""
    _, r, out = _run_one([EOS, EOS, SAMPLED], min_tokens=2)
    assert r.output_token_ids == [EOS, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and str(out.finish_reason) == "stop"


def test_aborted_requests_are_freed_and_reported_running_or_waiting():
    """max_num_seqs = 1: R runs, W waits. Aborting both frees R's block
    (1 + 1 of 3 free again) and the next step reports both."""
    s = make_scheduler(blocks=4, max_num_seqs=1)
    s.add_request(make_request("R", toks(100, 3)))
    s.add_request(make_request("W", toks(200, 3)))
    step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 2
    s.finish_requests(["R", "W"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("R", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 3
    assert not s.has_unfinished_requests() and s.has_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"R", "W"} and out.total_num_scheduled_tokens == 0
    assert not s.has_requests()


# -- 8. max_num_seqs ---------------------------------------------------------


def test_max_num_seqs_caps_the_running_requests_not_the_tokens():
    """max_num_seqs = 2, budget 16, three 3-token prompts: step 1 runs A and
    B (6 tokens) and C waits although 10 tokens are left. A ends (max_tokens
    1), so step 2 has a seat: B decodes, C's prompt runs (1 + 3)."""
    s = make_scheduler(max_num_seqs=2)
    s.add_request(make_request("A", toks(100, 3), max_tokens=1))
    s.add_request(make_request("B", toks(200, 3)))
    s.add_request(make_request("C", toks(300, 3)))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 3, "B": 3}
    assert [r.request_id for r in s.waiting] == ["C"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"B": 1, "C": 3}
    assert len(s.running) == 2


# -- property test -----------------------------------------------------------

MAX_MODEL_LEN = 32
STOP_ID = 13


def check_blocks(s: Scheduler, num_gpu_blocks: int, block_size: int, caching: bool) -> None:
    """No block leaks, reference counts equal the holders, running requests
    (and only they) hold exactly the blocks their computed tokens need, and every cached
    block carries the hash of the tokens it holds."""
    mgr = s.kv_cache_manager
    pool = mgr.block_pool
    running_ids = {r.request_id for r in s.running}
    holders: Counter[int] = Counter()
    # Only running requests have an entry: a refused allocation creates none.
    assert set(mgr.req_to_blocks) <= running_ids, set(mgr.req_to_blocks) - running_ids
    for r in s.running:
        blocks = mgr.req_to_blocks[r.request_id]
        assert len(blocks) == cdiv(r.num_computed_tokens, block_size)
        holders.update(b.block_id for b in blocks)
        if caching:
            num_cached = mgr.num_cached_block[r.request_id]
            assert num_cached == r.num_computed_tokens // block_size
            for i in range(num_cached):
                assert blocks[i].block_hash == r.block_hashes[i]
    assert pool.get_num_free_blocks() + len(holders) == num_gpu_blocks - 1
    assert len(free_ids(s)) == pool.get_num_free_blocks()
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id] >= 0
    for block_hash, blocks in pool.cached_block_hash_to_block.items():
        assert blocks and all(b.block_hash == block_hash for b in blocks.values())
    if not caching:
        assert not pool.cached_block_hash_to_block


request_spec = st.tuples(
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 5),  # arrival step
    st.integers(0, 2),  # priority
    st.integers(0, 2),  # prompt family (requests of one family share prefixes)
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.integers(0, 8),
    budget=st.sampled_from([4, 8, 16]),
    max_num_seqs=st.integers(2, 4),
    specs=st.lists(request_spec, min_size=2, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_the_scheduler_consistent(
    policy, caching, chunked, block_size, extra_blocks, budget, max_num_seqs, specs, seed
):
    """Random arrivals, aborts (between steps and while a step runs), EOS
    and stop tokens, pools barely larger than one max_model_len request (so
    preemption is common). After every step: the budget holds, no request
    gets more tokens than it lacks, a step that preempts admits nobody, no
    block leaks; every request finishes exactly once and the worker is told
    about it in the next step; at the end every block is free."""
    rng = random.Random(seed)
    if not chunked:
        budget = MAX_MODEL_LEN  # unchunked needs room for a whole max_model_len prompt
    # Enough blocks for one request of max_model_len: it can always run alone.
    num_gpu_blocks = cdiv(MAX_MODEL_LEN, block_size) + 1 + extra_blocks
    s = make_scheduler(
        blocks=num_gpu_blocks,
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        chunked=chunked,
        policy=policy,
        caching=caching,
        block_size=block_size,
    )
    families = [[rng.randrange(10, 13) for _ in range(20)] for _ in range(3)]
    pending = []
    for i, (length, max_tokens, arrival_step, priority, family) in enumerate(specs):
        prompt = families[family][:length]
        if rng.random() < 0.3:
            prompt = prompt[: length // 2] + [rng.randrange(10, 13) for _ in prompt[length // 2 :]]
        params = {"stop_token_ids": [STOP_ID], "min_tokens": 1} if i % 3 == 0 else {}
        req = make_request(
            f"r{i}",
            prompt,
            max_tokens=max_tokens,
            arrival=float(arrival_step) + i / 100,
            priority=priority,
            block_size=block_size,
            **params,
        )
        pending.append((arrival_step, req))
    requests = [req for _, req in pending]
    all_ids = {req.request_id for req in requests}
    finished: dict[str, str] = {}
    reported_since_schedule: set[str] = set()  # finished, not yet told to the worker

    def finish(rid: str, reason: str) -> None:
        assert rid not in finished, f"{rid} finished twice"
        finished[rid] = reason
        reported_since_schedule.add(rid)

    def abort_one(candidates) -> None:
        rid = rng.choice(sorted(candidates))
        s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        finish(rid, "abort")

    step_no = 0
    while pending or s.has_requests():
        step_no += 1
        assert step_no < 2000, "the workload does not drain"
        for arrival_step, req in [p for p in pending if p[0] <= step_no]:
            s.add_request(req)
            pending.remove((arrival_step, req))
        if s.requests and rng.random() < 0.05:
            abort_one(s.requests)

        num_tokens_before = {rid: r.num_tokens for rid, r in s.requests.items()}
        out = s.schedule()
        assert out.finished_req_ids == reported_since_schedule
        reported_since_schedule = set()

        # The budget, and no request given more than it lacks.
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= budget
        computed_before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        assert set(computed_before) == set(scheduled)
        assert len(computed_before) == len(out.scheduled_new_reqs) + cached.num_reqs
        for rid, n in scheduled.items():
            lacking = num_tokens_before[rid] - computed_before[rid]
            assert 0 < n <= lacking
            joined = rid in cached.resumed_req_ids or any(
                d.req_id == rid for d in out.scheduled_new_reqs
            )
            if not chunked and joined:
                assert n == lacking  # unchunked: a prompt (or recompute) runs whole
        if out.preempted_req_ids:
            assert not out.scheduled_new_reqs and not cached.resumed_req_ids
            assert not out.preempted_req_ids & set(scheduled)
            for rid in out.preempted_req_ids:
                req = s.requests[rid]
                assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
        assert len(s.running) <= max_num_seqs
        assert all(r.status == RequestStatus.RUNNING for r in s.running)

        model_output = worker_output(s, out)
        for sampled in model_output.sampled_token_ids:  # the worker's tokens: EOS, stop, others
            if sampled:
                sampled[:] = [rng.choice([EOS, STOP_ID] + [10, 11, 12] * 6)]
        if scheduled and rng.random() < 0.05:
            abort_one(scheduled)  # aborted while the step runs: its tokens are dropped
        result = s.update_from_output(out, model_output)
        for o in result.outputs:
            assert o.request_id not in finished
            if o.finished:
                finish(o.request_id, str(o.finish_reason))
        for rid in finished:
            assert rid not in s.requests
        check_blocks(s, num_gpu_blocks, block_size, caching)

    assert set(finished) == all_ids
    for req in requests:
        reason = finished[req.request_id]
        assert req.num_output_tokens <= req.max_tokens
        if reason == "length":
            assert req.num_output_tokens == req.max_tokens or req.num_tokens == MAX_MODEL_LEN
        elif reason == "stop":
            assert req.output_token_ids[-1] in (EOS, STOP_ID)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == num_gpu_blocks - 1
    assert not s.running and not s.waiting and not s.requests


# -- long_prefill_token_threshold --------------------------------------------------


def test_long_prefill_token_threshold_caps_every_prompt_chunk():
    """vLLM's rule, in both loops: 0 < threshold < what is missing -> the
    threshold. Threshold 4, budget 16: A's 10-token prompt goes 4 (admitted),
    4, 2 (running); B, admitted beside A's second chunk, gets 4 of its 5; a
    decode (1 token) is never capped."""
    s = make_scheduler(budget=16, long_prefill_token_threshold=4)
    s.add_request(make_request("A", toks(100, 10)))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"A": 4}
    s.add_request(make_request("B", toks(200, 5)))
    assert step(s)[0].num_scheduled_tokens == {"A": 4, "B": 4}
    assert step(s)[0].num_scheduled_tokens == {"A": 2, "B": 1}
    assert step(s)[0].num_scheduled_tokens == {"A": 1, "B": 1}  # both decode


# -- preemptions between two steps ----------------------------------------------------


def test_requests_a_reset_preempts_are_named_by_the_next_output_and_counted():
    """reset_prefix_cache(reset_running_requests=True) preempts between two
    steps: as in vLLM (`reset_preempted_req_ids`), the next SchedulerOutput
    names them among its preempted requests (while resuming them at once),
    and its stats count them; the step after names none."""
    s = make_scheduler()
    for rid, start in (("A", 100), ("B", 200)):
        s.add_request(make_request(rid, toks(start, 6)))
    step(s)
    assert s.reset_prefix_cache(reset_running_requests=True)
    out = s.schedule()
    result = s.update_from_output(out, worker_output(s, out))
    assert out.preempted_req_ids == {"A", "B"}
    assert out.num_scheduled_tokens == {"A": 7, "B": 7}  # resumed, recomputed
    assert result.scheduler_stats.num_preempted_reqs == 2
    out, _ = step(s)
    assert out.preempted_req_ids == set()


# -- admission: room for the whole prompt ---------------------------------------------


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_a_waiting_request_is_admitted_only_if_its_whole_prompt_fits(reserve_full_isl):
    """vLLM's scheduler_reserve_full_isl (on by default): allocate_slots(...,
    full_sequence_must_fit=True) admits a waiting request only if the free
    blocks hold its whole prompt, not only this step's chunk. 6 blocks of 4
    (5 usable), 8 tokens a step. A (8 tokens) takes [1, 2], then block 3 for
    its 9th token; B (16 tokens, 4 blocks) arrives at step 2 with 2 blocks
    free and 7 tokens of budget. With the rule B waits, and nothing is
    preempted; without it B's first chunk (7 tokens, 2 blocks) is admitted,
    and at the next step B, the tail, has to preempt itself for its second."""
    s = make_scheduler(blocks=6, budget=8, reserve_full_isl=reserve_full_isl)
    s.add_request(make_request("A", toks(100, 8), max_tokens=20))
    assert step(s)[0].num_scheduled_tokens == {"A": 8}
    s.add_request(make_request("B", toks(200, 16)))
    second, _ = step(s)
    third, _ = step(s)
    if reserve_full_isl:
        assert second.num_scheduled_tokens == third.num_scheduled_tokens == {"A": 1}
        assert third.preempted_req_ids == set() and s.requests["B"].num_preemptions == 0
    else:
        assert second.num_scheduled_tokens == {"A": 1, "B": 7}
        assert third.num_scheduled_tokens == {"A": 1} and third.preempted_req_ids == {"B"}


# -- the common prefix (cascade attention's count) -------------------------


def test_num_common_prefix_blocks_counts_the_blocks_every_running_request_holds():
    """Block size 4. A's prompt is 10 tokens: blocks [1, 2, 3], 2 full and
    cached. Alone, all 3 of its blocks are held by every running request
    (itself): 3. B and C start with A's 8 tokens plus tails of their own, so
    they hit A's 2 full blocks and take new ones after: the first 2 blocks
    have ref_cnt 3 = the requests holding blocks, the third is A's alone: 2.
    D shares nothing: 0, until D finishes: 2 again. When A ends, B and C
    still share the 2 blocks (ref_cnt 2, two holders): 2."""
    s = make_scheduler(budget=32)
    prefix = toks(100, 8)
    s.add_request(a := make_request("A", prefix + [900, 901], max_tokens=4))
    out, _ = step(s)
    assert out.num_common_prefix_blocks == 3 and block_ids(s, "A") == [1, 2, 3]
    s.add_request(make_request("B", prefix + [910, 911, 912], max_tokens=8))
    s.add_request(make_request("C", prefix + [920], max_tokens=8))
    out, _ = step(s)
    assert block_ids(s, "B")[:2] == block_ids(s, "C")[:2] == [1, 2]
    assert out.num_common_prefix_blocks == 2
    s.add_request(make_request("D", toks(500, 5), max_tokens=1))
    out, _ = step(s)  # D's prompt is computed and D ends with its one token
    assert "D" in out.num_scheduled_tokens and out.num_common_prefix_blocks == 0
    out, _ = step(s)  # A's fourth and last token
    assert out.num_common_prefix_blocks == 2 and a.is_finished()
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"B", "C"} and out.num_common_prefix_blocks == 2


def test_num_common_prefix_blocks_without_prefix_caching_is_zero_with_two_requests():
    """Without the prefix cache nothing is shared: the same prompt twice
    gets blocks of its own, so two running requests have no common block;
    an empty running queue reports 0 too."""
    s = make_scheduler(caching=False)
    out, _ = step(s)
    assert out.num_common_prefix_blocks == 0
    for rid in "AB":
        s.add_request(make_request(rid, toks(100, 8), max_tokens=4))
    out, _ = step(s)
    assert block_ids(s, "A") != block_ids(s, "B")
    assert out.num_common_prefix_blocks == 0
