"""Property test: random workloads through the scheduler, invariants at every step.

No model runs: `simulate_model_step` does what `LLMEngine._process_model_outputs`
does after a forward pass. Each request finishes when it has generated its
target number of tokens or reaches max_model_len tokens in all (as the
engine's StopChecker does), or is ignored by the scheduler.

Requests with n=2 sequences sharing one prompt are drawn only with SWAP
preemption (what preemption_mode=None picks for them): they exercise shared,
ref-counted blocks, copy-on-write and the swapping of shared blocks.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.block_manager import Device
from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import Sequence, SequenceGroup, SequenceStatus

MAX_STEPS = 2000


@dataclass
class Request:
    arrival_step: int
    prompt_len: int
    target: int  # output tokens to generate
    n: int  # sequences sharing the prompt


@dataclass
class Workload:
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str | None
    watermark: float
    requests: list[Request]


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_gpu_blocks = draw(st.integers(4, 40))
    num_cpu_blocks = draw(st.integers(0, 40))
    max_model_len = draw(st.integers(2, 48))
    max_num_seqs = draw(st.integers(1, 8))
    max_num_batched_tokens = max(max_model_len, max_num_seqs) + draw(st.integers(0, 24))
    # None means RECOMPUTE for the single-sequence requests it is drawn with.
    mode = draw(st.sampled_from(["recompute", "swap", "swap", None]))
    watermark = draw(st.sampled_from([0.0, 0.01, 0.1, 0.25]))
    requests = draw(
        st.lists(
            st.builds(
                Request,
                arrival_step=st.integers(0, 8),
                prompt_len=st.integers(1, max_model_len),
                target=st.integers(1, 20),
                # A group needs all its sequences admitted at once (n <= max_num_seqs).
                n=st.sampled_from([1, 2]) if mode == "swap" and max_num_seqs >= 2 else st.just(1),
            ),
            min_size=1,
            max_size=12,
        )
    )
    if mode == "swap":
        # Swapped requests hold CPU blocks while others keep growing; a
        # sequence never holds more than ceil(max_model_len / block_size)
        # blocks, so this pool can never run out (running out raises).
        per_seq = math.ceil(max_model_len / block_size)
        num_cpu_blocks = max(num_cpu_blocks, sum(r.n for r in requests) * per_seq)
    return Workload(
        block_size,
        num_gpu_blocks,
        num_cpu_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        mode,
        watermark,
        requests,
    )


def simulate_model_step(
    scheduler: Scheduler, out: SchedulerOutputs, targets: dict[str, int], max_model_len: int
) -> list[SequenceGroup]:
    """What the engine does after the forward pass; returns the groups it finished."""
    finished = []
    for scheduled in out.scheduled_seq_groups:
        group = scheduled.seq_group
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.data.update_num_computed_tokens(scheduled.token_chunk_size)
            # Distinct per sequence, so sequences of one group diverge.
            seq.append_token_id(1000 * seq.seq_id + seq.get_output_len(), 0.0)
            if seq.get_output_len() >= targets[group.request_id] or seq.get_len() >= max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
                scheduler.free_seq(seq)
        if group.is_finished():
            finished.append(group)
    scheduler.free_finished_seq_groups()
    return finished


def check_block_pools(scheduler: Scheduler, live_seqs: list[Sequence]) -> None:
    bm = scheduler.block_manager
    live_ids = {seq.seq_id for seq in live_seqs}
    assert set(bm.block_tables) <= live_ids, "a finished or unknown sequence still holds blocks"
    objects: dict[tuple[Device, int], set[int]] = {}
    references: Counter = Counter()
    by_id = {}
    for block_table in bm.block_tables.values():
        assert len({id(b) for b in block_table}) == len(block_table)
        for block in block_table:
            objects.setdefault((block.device, block.block_number), set()).add(id(block))
            references[id(block)] += 1
            by_id[id(block)] = block
    for key, object_ids in objects.items():
        # One block number is one block: two sequences may only share it
        # through the same ref-counted object.
        assert len(object_ids) == 1, f"block {key} handed out twice"
    for object_id, count in references.items():
        assert by_id[object_id].ref_count == count, by_id[object_id]
    for device, allocator, total in (
        (Device.GPU, bm.gpu_allocator, bm.num_total_gpu_blocks),
        (Device.CPU, bm.cpu_allocator, bm.num_total_cpu_blocks),
    ):
        used = {number for dev, number in objects if dev == device}
        free = allocator.free_block_numbers
        assert len(set(free)) == len(free), f"{device} block freed twice"
        assert not used & set(free), f"{device} block both used and free"
        assert all(0 <= n < total for n in used | set(free))
        assert allocator.get_num_free_blocks() + len(used) == total


def check_shared_blocks_hold_equal_tokens(scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Sequences mapping one physical block must agree on the tokens in it.

    The block holds the KV of the computed tokens, and after scheduling a
    running sequence's forward pass writes the rest of its tokens too.
    """
    bs = scheduler.block_manager.block_size
    owners: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in seqs:
        for i, block in enumerate(scheduler.block_manager.block_tables.get(seq.seq_id, [])):
            owners.setdefault(id(block), []).append((seq, i))
    for shared in owners.values():
        contents = set()
        for seq, i in shared:
            running = seq.status == SequenceStatus.RUNNING
            end = seq.get_len() if running else seq.data.num_computed_tokens
            contents.add(tuple(seq.get_token_ids()[i * bs : min((i + 1) * bs, end)]))
        assert len(contents) == 1, f"shared block with different tokens: {shared}"


def check_queues(scheduler: Scheduler, groups: list[SequenceGroup]) -> None:
    bm = scheduler.block_manager
    queues = {
        SequenceStatus.WAITING: scheduler.waiting,
        SequenceStatus.RUNNING: scheduler.running,
        SequenceStatus.SWAPPED: scheduler.swapped,
    }
    placed = Counter(id(g) for q in queues.values() for g in q)
    for group in groups:
        if group.is_finished():
            assert placed[id(group)] == 0
            continue
        assert placed[id(group)] == 1, f"{group} is in {placed[id(group)]} queues"
    for status, queue in queues.items():
        arrivals = [g.arrival_time for g in queue]
        assert arrivals == sorted(arrivals), f"{status.name} queue out of arrival order"
        for group in queue:
            for seq in group.get_unfinished_seqs():
                assert seq.status == status, (group, seq)
                if status == SequenceStatus.WAITING:
                    assert seq.seq_id not in bm.block_tables
                    assert seq.data.num_computed_tokens == 0
                else:
                    block_table = bm.block_tables[seq.seq_id]
                    if status == SequenceStatus.RUNNING:
                        assert all(b.device == Device.GPU for b in block_table)
                        # A slot for every token, the newest (uncomputed) one included.
                        assert len(block_table) == seq.n_blocks
                    else:
                        # Swapped out before or after its newest token got a slot.
                        assert all(b.device == Device.CPU for b in block_table)
                        assert len(block_table) in (seq.n_blocks - 1, seq.n_blocks)


def check_step(
    scheduler: Scheduler,
    out: SchedulerOutputs,
    config: SchedulerConfig,
    groups: list[SequenceGroup],
    done: set[str],
) -> None:
    live_seqs = [s for g in groups for s in g.seqs]
    check_block_pools(scheduler, live_seqs)
    check_shared_blocks_hold_equal_tokens(scheduler, live_seqs)
    check_queues(scheduler, groups)

    assert out.num_batched_tokens <= config.max_num_batched_tokens
    num_running = 0
    expected_tokens = 0
    for i, scheduled in enumerate(out.scheduled_seq_groups):
        group = scheduled.seq_group
        assert group.request_id not in done
        running = group.get_seqs(SequenceStatus.RUNNING)
        assert running, f"{group} scheduled with no running sequence"
        num_running += len(running)
        if i < out.num_prefill_groups:
            # A prefill computes every token the sequence has: the prompt,
            # plus the generated tokens after a RECOMPUTE preemption.
            assert group.is_prefill()
            for seq in running:
                assert seq.data.num_computed_tokens == 0
                assert scheduled.token_chunk_size == seq.get_len()
            # The budget counts a group's prompt once, however many sequences
            # share it (n=2 groups are drawn here; the engine itself takes n=1).
            expected_tokens += scheduled.token_chunk_size
        else:
            assert not group.is_prefill()
            assert scheduled.token_chunk_size == 1
            for seq in running:
                assert seq.get_len() - seq.data.num_computed_tokens == 1
            expected_tokens += len(running)
    assert num_running <= config.max_num_seqs
    assert out.num_batched_tokens == expected_tokens
    assert len({id(s.seq_group) for s in out.scheduled_seq_groups}) == len(out.scheduled_seq_groups)

    if out.preempted:
        # Victims are the last arrivals: everything that kept running is older.
        assert out.num_prefill_groups == 0
        assert not out.blocks_to_swap_in
        newest_kept = max((s.seq_group.arrival_time for s in out.scheduled_seq_groups), default=-1)
        for victim, mode in out.preempted:
            assert victim.arrival_time > newest_kept
            expected_queue = (
                scheduler.waiting if mode == PreemptionMode.RECOMPUTE else scheduler.swapped
            )
            assert victim in expected_queue
    assert len(out.blocks_to_swap_out) == len({gpu for gpu, _ in out.blocks_to_swap_out})
    assert len(out.blocks_to_swap_in) == len({cpu for cpu, _ in out.blocks_to_swap_in})

    for group in out.ignored_seq_groups:
        assert all(s.status == SequenceStatus.FINISHED_IGNORED for s in group.seqs)
        assert group not in [s.seq_group for s in out.scheduled_seq_groups]


def run_workload(w: Workload) -> Counter:
    """Run `w` to completion, checking every step; returns what happened."""
    cache_config = CacheConfig(block_size=w.block_size)
    cache_config.num_gpu_blocks = w.num_gpu_blocks
    cache_config.num_cpu_blocks = w.num_cpu_blocks
    config = SchedulerConfig(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        preemption_mode=w.preemption_mode,
    )
    scheduler = Scheduler(config, cache_config, watermark=w.watermark)

    order = sorted(range(len(w.requests)), key=lambda i: (w.requests[i].arrival_step, i))
    pending: list[tuple[int, SequenceGroup]] = []
    targets: dict[str, int] = {}
    next_seq_id = 0
    for arrival, i in enumerate(order):
        r = w.requests[i]
        prompt = [100 * i + k for k in range(r.prompt_len)]
        seqs = []
        for _ in range(r.n):
            seqs.append(Sequence(next_seq_id, None, prompt, w.block_size))
            next_seq_id += 1
        if r.n == 1:
            params = SamplingParams(temperature=0, max_tokens=r.target)
        else:
            params = SamplingParams(n=r.n, temperature=1.0, max_tokens=r.target)
        group = SequenceGroup(f"req{i}", seqs, params, float(arrival))
        targets[group.request_id] = r.target
        pending.append((r.arrival_step, group))

    added: list[SequenceGroup] = []
    events: Counter = Counter()
    finished: Counter = Counter()
    ignored: Counter = Counter()
    step = 0
    while pending or scheduler.has_unfinished_seqs():
        assert step < MAX_STEPS, f"not done after {MAX_STEPS} steps"
        while pending and pending[0][0] <= step:
            group = pending.pop(0)[1]
            scheduler.add_seq_group(group)
            added.append(group)
        _, out = scheduler.schedule()
        for group in out.ignored_seq_groups:
            ignored[group.request_id] += 1
        check_step(scheduler, out, config, added, set(finished) | set(ignored))
        events.update(mode.value for _, mode in out.preempted)
        events["ignored"] += len(out.ignored_seq_groups)
        events["swap_in"] += bool(out.blocks_to_swap_in)
        events["copy_on_write"] += len(out.blocks_to_copy)
        for group in simulate_model_step(scheduler, out, targets, w.max_model_len):
            finished[group.request_id] += 1
        step += 1

    all_ids = {g.request_id for g in added}
    assert len(added) == len(w.requests)
    assert set(finished) | set(ignored) == all_ids
    assert not set(finished) & set(ignored), "a request both finished and ignored"
    assert all(c == 1 for c in finished.values()), finished
    assert all(c == 1 for c in ignored.values()), ignored
    for group in added:
        assert group.is_finished()
        if group.request_id in finished:
            target = targets[group.request_id]
            for seq in group.seqs:
                # Stopped by its target or by max_model_len; a preemption
                # neither lost nor repeated a generated token.
                assert seq.get_output_len() <= target
                # (A prompt of max_model_len tokens still gets its one token.)
                assert seq.get_output_len() == target or seq.get_len() >= w.max_model_len
                assert seq.get_len() <= max(w.max_model_len, seq.get_prompt_len() + 1)
                assert seq.get_output_token_ids() == [
                    1000 * seq.seq_id + k for k in range(seq.get_output_len())
                ]
    bm = scheduler.block_manager
    assert bm.block_tables == {}
    assert bm.get_num_free_gpu_blocks() == w.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == w.num_cpu_blocks
    return events


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_random_workloads_keep_invariants_and_all_finish(w: Workload) -> None:
    events = run_workload(w)
    for name, count in events.items():
        if count:
            event(name)


def test_run_workload_exercises_preemption_paths():
    """The harness itself on hand-picked workloads that must preempt.

    6 blocks of 2. r0 and r1 (3 tokens, 2 blocks each) start at step 0 and
    r2 (2 tokens, 1 block) at step 1, taking the last block. At step 2 r0
    and r1 have 5 tokens and each need a third block: r0 takes the one free
    block and r1 can only get one by preempting r2.
    """
    requests = [Request(0, 3, 8, 1), Request(0, 3, 8, 1), Request(1, 2, 8, 1)]
    for mode in ("recompute", "swap"):
        w = Workload(2, 6, 40, 4, 16, 16, mode, 0.0, requests)
        events = run_workload(w)
        assert events[mode] >= 1
        assert events["ignored"] == 0
    assert events["swap_in"] >= 1

    # A 2-sequence group: its shared, half-full last prompt block is copied
    # on the first decode; it is the last arrival, so it is swapped out.
    requests = [Request(0, 3, 8, 1), Request(0, 3, 6, 2)]
    events = run_workload(Workload(2, 7, 40, 4, 16, 16, "swap", 0.0, requests))
    assert events["copy_on_write"] >= 1
    assert events["swap"] >= 1
    assert events["swap_in"] >= 1


def test_run_workload_reports_never_fitting_request_as_ignored():
    # 16 tokens in blocks of 4 need 4 blocks; the pool has 4 but a watermark
    # of int(0.25 * 4) = 1 block must stay free, so it can never be admitted.
    requests = [Request(0, 16, 3, 1), Request(0, 4, 3, 1)]
    events = run_workload(Workload(4, 4, 0, 2, 16, 16, "recompute", 0.25, requests))
    assert events["ignored"] == 1
