"""The scheduler: which requests run in the next forward pass.

Three queues hold every unfinished request: `waiting` (not yet prefilled,
or preempted by RECOMPUTE), `running` (KV cache on the device) and
`swapped` (KV cache moved to the CPU pool). They keep the order things
happen in, as vLLM v0.6's deques do: a new request joins the tail of
`waiting`, a RECOMPUTE victim its head, a SWAP victim the tail of
`swapped`; the preemption victim is always the tail of `running`.

What one step's batch holds follows `enable_chunked_prefill`, as in vLLM:

* off: `_schedule_default`. While prompts wait and nothing is swapped,
  admit as many as fit: the step is prefills only. Only a step that
  admitted no prompt runs the decodes (preempting from the tail of
  `running` when blocks run out), then, if nothing was preempted, swaps
  requests back in.
* on: `_schedule_chunked_prefill`. Walk `running` in order, giving each
  group its next token or the next chunk of its prompt while the token
  budget lasts (preempting when blocks run out); then, if nothing was
  preempted, swap requests back in; then admit new prompts, the last one
  chunked to the budget that is left. Decodes and prefills share a step.

`scheduling_policy` only orders the queues: "fcfs" keeps arrival order;
"priority" sorts `waiting` and `running` by (priority, arrival) at the
start of every step, as later vLLM does (its priority preemption of
running requests is not reproduced here; see lessons/vllm_differences.md).

`MixedBatchScheduler` (at the end of this file) is the course's simplified
scheduler: the chunked-prefill flow with prompts never split.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from minivllm.config import CacheConfig, PreemptionMode, SchedulerConfig
from minivllm.core.block_manager import AllocStatus, BlockSpaceManager
from minivllm.sequence import (
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceStatus,
)

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSequenceGroup:
    """A group in this step's batch. A prefill computes `token_chunk_size`
    tokens of its prompt; a decode group has 1 (each of its running
    sequences computes its one new token)."""

    seq_group: SequenceGroup
    token_chunk_size: int


@dataclass
class SchedulerOutputs:
    """The scheduler's decisions for one step.

    scheduled_seq_groups: the batch, prefills first, then decodes.
    blocks_to_swap_in: (cpu block, gpu block) pairs to copy before the pass.
    blocks_to_swap_out: (gpu block, cpu block) pairs to copy before the pass.
    blocks_to_copy: (src, dst) gpu block pairs (copy-on-write).
    ignored_seq_groups: prompts that can never run (too long, or too big
        for the cache); finished as ignored.
    preempted: groups preempted this step, with how, in preemption order.
    aborted_seq_groups: preemption victims that could be neither swapped out
        (the CPU pool is full) nor recomputed (several sequences); finished
        as aborted, with the tokens they had.
    """

    scheduled_seq_groups: list[ScheduledSequenceGroup]
    num_prefill_groups: int
    num_batched_tokens: int
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    ignored_seq_groups: list[SequenceGroup]
    preempted: list[tuple[SequenceGroup, PreemptionMode]] = field(default_factory=list)
    aborted_seq_groups: list[SequenceGroup] = field(default_factory=list)

    def is_empty(self) -> bool:
        """Nothing for the workers to do: no group to run and no block to
        move (prompts ignored this step do not count, as in vLLM)."""
        return not (
            self.scheduled_seq_groups
            or self.blocks_to_swap_in
            or self.blocks_to_swap_out
            or self.blocks_to_copy
        )


@dataclass
class SchedulingBudget:
    """What one step has spent of its token and sequence limits.

    Charges are recorded per request id, and a second charge for the same
    id is ignored, as in vLLM: `_schedule_default` reserves every running
    group's sequences before it knows whether they will run, and the same
    group may be charged again when it is scheduled.
    """

    token_budget: int
    max_num_seqs: int
    _request_ids_num_batched_tokens: set[str] = field(default_factory=set)
    _request_ids_num_curr_seqs: set[str] = field(default_factory=set)
    _num_batched_tokens: int = 0
    _num_curr_seqs: int = 0

    def can_schedule(self, *, num_new_tokens: int, num_new_seqs: int) -> bool:
        assert num_new_tokens != 0 and num_new_seqs != 0, "nothing to schedule"
        return (
            self.num_batched_tokens + num_new_tokens <= self.token_budget
            and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs
        )

    def remaining_token_budget(self) -> int:
        return self.token_budget - self.num_batched_tokens

    def add_num_batched_tokens(self, req_id: str, num_batched_tokens: int) -> None:
        if req_id not in self._request_ids_num_batched_tokens:
            self._request_ids_num_batched_tokens.add(req_id)
            self._num_batched_tokens += num_batched_tokens

    def subtract_num_batched_tokens(self, req_id: str, num_batched_tokens: int) -> None:
        if req_id in self._request_ids_num_batched_tokens:
            self._request_ids_num_batched_tokens.remove(req_id)
            self._num_batched_tokens -= num_batched_tokens

    def add_num_seqs(self, req_id: str, num_curr_seqs: int) -> None:
        if req_id not in self._request_ids_num_curr_seqs:
            self._request_ids_num_curr_seqs.add(req_id)
            self._num_curr_seqs += num_curr_seqs

    def subtract_num_seqs(self, req_id: str, num_curr_seqs: int) -> None:
        if req_id in self._request_ids_num_curr_seqs:
            self._request_ids_num_curr_seqs.remove(req_id)
            self._num_curr_seqs -= num_curr_seqs

    @property
    def num_batched_tokens(self) -> int:
        return self._num_batched_tokens

    @property
    def num_curr_seqs(self) -> int:
        return self._num_curr_seqs


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        watermark: float = 0.01,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        if (
            scheduler_config.enable_chunked_prefill
            and cache_config.enable_prefix_caching
            and scheduler_config.max_num_batched_tokens < cache_config.block_size
        ):
            # Chunks are whole blocks then: a smaller budget fits none.
            raise ValueError(
                f"max_num_batched_tokens ({scheduler_config.max_num_batched_tokens}) must be "
                f">= block_size ({cache_config.block_size}) with chunked prefill and prefix "
                "caching, whose chunks are whole blocks"
            )
        self.block_manager: BlockSpaceManager = scheduler_config.block_manager_cls(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks,
            watermark=watermark,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_cumulative_preemption = 0

    # -- queue management ----------------------------------------------------

    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str | Iterable[str]) -> list[SequenceGroup]:
        """Finish requests (one id, or several) as aborted, from whichever
        queue holds them, and free their blocks at once. Unknown ids are
        skipped. Returns the aborted groups."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in [sg for sg in queue if sg.request_id in ids]:
                queue.remove(seq_group)
                for seq in seq_group.get_unfinished_seqs():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    self.free_seq(seq)
                aborted.append(seq_group)
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent, child)

    def free_finished_seq_groups(self) -> None:
        self.running = deque(sg for sg in self.running if not sg.is_finished())

    # -- one step ------------------------------------------------------------

    def schedule(self) -> tuple[list[SequenceGroupMetadata], SchedulerOutputs]:
        scheduler_outputs = self._schedule()
        now = time.time()
        seq_group_metadata_list = []
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            seq_group.maybe_set_first_scheduled_time(now)
            running = seq_group.get_seqs(SequenceStatus.RUNNING)
            is_prompt = seq_group.is_prefill()
            # Only the chunk that completes the prompt samples a token.
            completes = running[0].data.num_computed_tokens + scheduled.token_chunk_size
            seq_group_metadata_list.append(
                SequenceGroupMetadata(
                    request_id=seq_group.request_id,
                    is_prompt=is_prompt,
                    seq_data={seq.seq_id: seq.data for seq in running},
                    sampling_params=seq_group.sampling_params,
                    block_tables={
                        seq.seq_id: self.block_manager.get_block_table(seq) for seq in running
                    },
                    token_chunk_size=scheduled.token_chunk_size,
                    do_sample=not is_prompt or completes == running[0].get_len(),
                    generator=seq_group.generator,
                )
            )
        return seq_group_metadata_list, scheduler_outputs

    def _schedule(self) -> SchedulerOutputs:
        if self.scheduler_config.scheduling_policy == "priority":
            self._sort_by_priority()
        if self.scheduler_config.enable_chunked_prefill:
            return self._schedule_chunked_prefill()
        return self._schedule_default()

    def _sort_by_priority(self) -> None:
        """Order `waiting` and `running` by (priority, arrival): admission
        takes the head of `waiting`, preemption the tail of `running`."""
        self.waiting = deque(sorted(self.waiting, key=self._get_priority))
        self.running = deque(sorted(self.running, key=self._get_priority))

    @staticmethod
    def _get_priority(seq_group: SequenceGroup) -> tuple[int, float]:
        return seq_group.priority, seq_group.arrival_time

    def _schedule_default(self) -> SchedulerOutputs:
        """vLLM v0's default step: all prefills, or all decodes.

        Prompts are admitted only while nothing is swapped (swapped requests
        come back first). A step that admitted any prompt runs no decode:
        the running requests wait one step. Swapped requests come back only
        in a decode step that preempted nothing (a step cannot both swap
        out and swap in).
        """
        budget, out = self._new_budget(), self._new_outputs()
        # Running requests keep their sequence slots, scheduled or not.
        for seq_group in self.running:
            budget.add_num_seqs(seq_group.request_id, seq_group.get_max_num_running_seqs())
        prefills: list[ScheduledSequenceGroup] = []
        if not self.swapped:
            prefills = self._schedule_prefills(budget, out, enable_chunking=False)
        decodes: list[ScheduledSequenceGroup] = []
        swapped_in: list[ScheduledSequenceGroup] = []
        if not prefills:
            decodes, _ = self._schedule_running(budget, out, enable_chunking=False)
            if not self._preempted_any(out):
                swapped_in, _ = self._schedule_swapped(budget, out)
        self._requeue_preempted(out)
        self.running.extend(s.seq_group for s in prefills + decodes + swapped_in)
        return self._finish(out, budget, prefills, decodes + swapped_in)

    def _schedule_chunked_prefill(self) -> SchedulerOutputs:
        """vLLM v0's chunked-prefill step: decodes and prefills together."""
        return self._schedule_mixed_batch(enable_chunking=True)

    def _schedule_mixed_batch(self, enable_chunking: bool) -> SchedulerOutputs:
        """Running first (decodes and prompt chunks under way, in queue
        order), then swap-ins unless something was preempted, then new
        prompts, always tried: the step's own victims join `waiting` only
        at the end, so none is readmitted in the step that preempted it."""
        budget, out = self._new_budget(), self._new_outputs()
        running_decodes, running_prefills = self._schedule_running(budget, out, enable_chunking)
        swapped_decodes: list[ScheduledSequenceGroup] = []
        swapped_prefills: list[ScheduledSequenceGroup] = []
        if not self._preempted_any(out):
            swapped_decodes, swapped_prefills = self._schedule_swapped(budget, out, enable_chunking)
        prefills = self._schedule_prefills(budget, out, enable_chunking)
        self._requeue_preempted(out)
        joined = swapped_decodes + swapped_prefills + running_decodes + running_prefills + prefills
        self.running.extend(s.seq_group for s in joined)
        return self._finish(
            out,
            budget,
            prefills + running_prefills + swapped_prefills,
            running_decodes + swapped_decodes,
        )

    @staticmethod
    def _preempted_any(out: SchedulerOutputs) -> bool:
        return bool(out.preempted or out.aborted_seq_groups)

    def _requeue_preempted(self, out: SchedulerOutputs) -> None:
        """Put this step's victims back in line, as vLLM does. RECOMPUTE
        victims go to the head of `waiting`, ahead of prompts that never
        ran, in the order they had in `running` (they were taken from its
        tail, so they are put back front-first); SWAP victims join the tail
        of `swapped` in the order they were preempted, the last of
        `running` first."""
        for seq_group, mode in out.preempted:
            if mode == PreemptionMode.RECOMPUTE:
                self.waiting.appendleft(seq_group)
            else:
                self.swapped.append(seq_group)

    def _new_budget(self) -> SchedulingBudget:
        return SchedulingBudget(
            token_budget=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )

    @staticmethod
    def _new_outputs() -> SchedulerOutputs:
        return SchedulerOutputs(
            scheduled_seq_groups=[],
            num_prefill_groups=0,
            num_batched_tokens=0,
            blocks_to_swap_in=[],
            blocks_to_swap_out=[],
            blocks_to_copy=[],
            ignored_seq_groups=[],
        )

    @staticmethod
    def _finish(
        out: SchedulerOutputs,
        budget: SchedulingBudget,
        prefills: list[ScheduledSequenceGroup],
        decodes: list[ScheduledSequenceGroup],
    ) -> SchedulerOutputs:
        out.scheduled_seq_groups = prefills + decodes  # the runner wants prefills first
        out.num_prefill_groups = len(prefills)
        out.num_batched_tokens = budget.num_batched_tokens
        return out

    def _scheduled(self, seq_group: SequenceGroup, num_tokens: int) -> ScheduledSequenceGroup:
        """Record that the group computes `num_tokens` this step (its
        prefill chunk, or 1 to decode); with prefix caching, the blocks this
        fills become findable for the requests scheduled after it."""
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            computed = seq.data.num_computed_tokens + num_tokens
            self.block_manager.mark_blocks_as_computed(seq, computed)
        return ScheduledSequenceGroup(seq_group, token_chunk_size=num_tokens)

    def _get_num_new_tokens(
        self,
        seq_group: SequenceGroup,
        status: SequenceStatus,
        enable_chunking: bool,
        budget: SchedulingBudget,
    ) -> int:
        """Tokens the group's sequences in `status` compute this step.

        All their uncomputed tokens (one per decoding sequence), unless
        chunking a single-sequence group: then at most what the token budget
        has left, and with prefix caching a whole number of blocks unless
        the chunk ends the prompt, so that full blocks can be cached as they
        complete. A group of several sequences is never chunked: 0 when it
        does not fit what is left. With prefix
        caching, a waiting prompt's cached blocks are not counted (see
        `_num_uncached_tokens`).
        """
        seqs = seq_group.get_seqs(status)
        if status == SequenceStatus.WAITING or seq_group.is_prefill():
            # Sequences that still share their prompt compute it once, for
            # all (in vLLM a prompt is forked only after its prefill).
            seqs = seqs[:1]
        if status == SequenceStatus.WAITING:
            num_new_tokens = self._num_uncached_tokens(seqs[0])
        else:
            num_new_tokens = sum(seq.get_num_new_tokens() for seq in seqs)
        if not enable_chunking:
            return num_new_tokens
        remaining = budget.remaining_token_budget()
        if remaining >= num_new_tokens:
            return num_new_tokens
        if len(seqs) != 1:
            # Never chunked: it waits for a step with room (vLLM schedules it
            # anyway, past the budget, and fails its budget assertion).
            return 0
        if self.cache_config.enable_prefix_caching:
            return remaining - remaining % self.cache_config.block_size
        return remaining

    def _num_uncached_tokens(self, seq: Sequence) -> int:
        """A waiting sequence's tokens minus those found in the prefix
        cache. vLLM v0.6 charges the budget for the whole prompt; we charge
        what the model computes, as vLLM v1 does."""
        return seq.get_len() - self.block_manager.get_num_cached_tokens(seq)

    def _get_prompt_limit(self) -> int:
        """The longest prefill one step may compute: a chunk is checked
        against max_model_len; a whole prompt must also fit the budget."""
        config = self.scheduler_config
        if config.enable_chunked_prefill:
            return config.max_model_len
        return min(config.max_model_len, config.max_num_batched_tokens)

    def _schedule_running(
        self, budget: SchedulingBudget, out: SchedulerOutputs, enable_chunking: bool = False
    ) -> tuple[list[ScheduledSequenceGroup], list[ScheduledSequenceGroup]]:
        """Give each running group, in queue order, its next token or its
        next prompt chunk, preempting from the tail of `running` while the
        cache has no room for it. Scheduled groups leave `running` (the
        caller puts them back); with chunking, the groups the budget did not
        reach stay at its head.

        Returns (decodes, prefill chunks).
        """
        decodes, prefills = [], []
        while self.running:
            seq_group = self.running[0]
            req_id = seq_group.request_id
            num_new_tokens = self._get_num_new_tokens(
                seq_group, SequenceStatus.RUNNING, enable_chunking, budget
            )
            if num_new_tokens == 0:
                break  # the budget is spent
            self.running.popleft()
            while not self.block_manager.can_append_slots(seq_group):
                budget.subtract_num_batched_tokens(req_id, num_new_tokens)
                budget.subtract_num_seqs(req_id, seq_group.get_max_num_running_seqs())
                victim = self.running.pop() if self.running else seq_group
                if victim is seq_group and self._can_never_append(seq_group, decodes + prefills):
                    # vLLM would preempt it and readmit it, again and again.
                    self._ignore(
                        seq_group,
                        out,
                        "alone in the KV cache, it has no free block "
                        "for each running sequence's next token",
                    )
                    break
                self._preempt(victim, out)
                if victim is seq_group:
                    break
            else:
                for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                    out.blocks_to_copy += self.block_manager.append_slots(seq)
                if seq_group.is_prefill():
                    prefills.append(self._scheduled(seq_group, num_new_tokens))
                else:
                    decodes.append(self._scheduled(seq_group, 1))
                budget.add_num_batched_tokens(req_id, num_new_tokens)
                # A no-op after _schedule_default's reservation (same id).
                budget.add_num_seqs(req_id, seq_group.get_max_num_running_seqs())
        return decodes, prefills

    def _can_never_append(
        self, seq_group: SequenceGroup, scheduled: list[ScheduledSequenceGroup]
    ) -> bool:
        """Is the group short of free blocks for its next tokens while no
        other group holds any (nothing else scheduled, nothing left in
        `running`)? Then no preemption can ever make room for it."""
        if scheduled or self.running:
            return False
        free = self.block_manager.get_num_free_gpu_blocks()
        return free < seq_group.num_seqs(SequenceStatus.RUNNING)

    def _schedule_swapped(
        self, budget: SchedulingBudget, out: SchedulerOutputs, enable_chunking: bool = False
    ) -> tuple[list[ScheduledSequenceGroup], list[ScheduledSequenceGroup]]:
        """Bring swapped groups back from the head of `swapped` while they
        fit. A prefill swapped out mid-prompt comes back with the whole rest
        of its prompt, as in vLLM, unless that rest exceeds the whole token
        budget: then, with chunking, it comes back one chunk at a time.
        Returns (decodes, prefills)."""
        decodes, prefills = [], []
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(seq_group, out, "its KV cache no longer fits the device pool")
                continue
            num_new_seqs = seq_group.get_max_num_running_seqs()
            num_new_tokens = self._get_num_new_tokens(
                seq_group, SequenceStatus.SWAPPED, False, budget
            )
            if enable_chunking and num_new_tokens > budget.token_budget:
                # vLLM never chunks a swap-in, so a prompt rest longer than
                # the whole budget would never come back: chunk that one.
                num_new_tokens = self._get_num_new_tokens(
                    seq_group, SequenceStatus.SWAPPED, True, budget
                )
            if num_new_tokens == 0 or not budget.can_schedule(
                num_new_tokens=num_new_tokens, num_new_seqs=num_new_seqs
            ):
                break
            self.swapped.popleft()
            self._swap_in(seq_group, out.blocks_to_swap_in)
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                out.blocks_to_copy += self.block_manager.append_slots(seq)
            if seq_group.is_prefill():
                prefills.append(self._scheduled(seq_group, num_new_tokens))
            else:
                decodes.append(self._scheduled(seq_group, 1))
            budget.add_num_batched_tokens(seq_group.request_id, num_new_tokens)
            budget.add_num_seqs(seq_group.request_id, num_new_seqs)
        return decodes, prefills

    def _schedule_prefills(
        self, budget: SchedulingBudget, out: SchedulerOutputs, enable_chunking: bool = False
    ) -> list[ScheduledSequenceGroup]:
        """Admit waiting groups from the head of `waiting` while they fit;
        the first that does not fit stops admission (first come, first
        served). The admitted groups leave `waiting`; the caller puts them in
        `running`."""
        prefills = []
        while self.waiting:
            seq_group = self.waiting[0]
            num_new_tokens = self._get_num_new_tokens(
                seq_group, SequenceStatus.WAITING, enable_chunking, budget
            )
            if num_new_tokens > self._get_prompt_limit():
                self.waiting.popleft()
                self._ignore(
                    seq_group,
                    out,
                    f"its {num_new_tokens} tokens exceed the limit of {self._get_prompt_limit()}",
                )
                continue
            status = self.block_manager.can_allocate(seq_group)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                self._ignore(seq_group, out, self._too_big_for_cache(seq_group))
                continue
            num_new_seqs = seq_group.get_max_num_running_seqs()
            if num_new_tokens == 0 or not budget.can_schedule(
                num_new_tokens=num_new_tokens, num_new_seqs=num_new_seqs
            ):
                break
            self.waiting.popleft()
            self._allocate_and_set_running(seq_group)
            prefills.append(self._scheduled(seq_group, num_new_tokens))
            budget.add_num_batched_tokens(seq_group.request_id, num_new_tokens)
            budget.add_num_seqs(seq_group.request_id, num_new_seqs)
        return prefills

    def _allocate_and_set_running(self, seq_group: SequenceGroup) -> None:
        """Give the group blocks for all its tokens; with prefix caching, the
        tokens of the cached blocks it reuses count as computed already."""
        num_cached = self.block_manager.allocate(seq_group)
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
            seq.data.num_computed_tokens = num_cached

    def _too_big_for_cache(self, seq_group: SequenceGroup) -> str:
        seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
        bm = self.block_manager
        return (
            f"its {seq.get_len()} tokens need {seq.n_blocks} blocks of "
            f"{bm.block_size} but the KV cache has {bm.num_total_gpu_blocks} blocks "
            f"({bm.watermark_blocks} kept free as watermark)"
        )

    # -- preemption ----------------------------------------------------------

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """Take a running group off the device, to free its blocks: recorded
        in `out.preempted`; the step puts it back in line at its end
        (`_requeue_preempted`)."""
        mode = self._preemption_mode(seq_group)
        if mode is None:
            self._abort_unswappable(seq_group, out)
            return
        self.num_cumulative_preemption += 1
        if self.num_cumulative_preemption % 50 == 1:
            logger.warning(
                "Request %s is preempted by %s because the KV cache is out of blocks "
                "(total preemptions: %d). A larger cache (kv_cache_memory_bytes, "
                "num_gpu_blocks_override) or a smaller max_num_seqs avoids this.",
                seq_group.request_id,
                mode.name,
                self.num_cumulative_preemption,
            )
        if mode == PreemptionMode.RECOMPUTE:
            self._preempt_by_recompute(seq_group)
        else:
            self._preempt_by_swap(seq_group, out.blocks_to_swap_out)
        out.preempted.append((seq_group, mode))

    def _preempt_by_recompute(self, seq_group: SequenceGroup) -> None:
        """Drop its blocks: it waits again and is prefilled from scratch."""
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.WAITING
            self.free_seq(seq)
            seq.reset_state_for_recompute()

    def _preempt_by_swap(
        self, seq_group: SequenceGroup, blocks_to_swap_out: list[tuple[int, int]]
    ) -> None:
        self._swap_out(seq_group, blocks_to_swap_out)

    def _swap_in(self, seq_group: SequenceGroup, blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Its blocks back from the CPU pool (the copies the worker makes
        before the step's pass); its sequences run again."""
        blocks_to_swap_in += self.block_manager.swap_in(seq_group)
        for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING

    def _swap_out(
        self, seq_group: SequenceGroup, blocks_to_swap_out: list[tuple[int, int]]
    ) -> None:
        """Its blocks out to the CPU pool (`_preemption_mode` checked that
        they fit; vLLM raises here when they do not, row 2)."""
        blocks_to_swap_out += self.block_manager.swap_out(seq_group)
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED

    def _preemption_mode(self, seq_group: SequenceGroup) -> PreemptionMode | None:
        """How to preempt this group; None when it can be neither swapped
        out nor recomputed.

        vLLM's rule: the configured mode, or when there is none, RECOMPUTE
        for a group that can only ever run one sequence (recomputing is
        cheaper than a round trip of its blocks over PCIe) and SWAP for one
        that may run several (`get_max_num_running_seqs() > 1`), including
        an n > 1 prompt still prefilling: it comes back as a prefill.
        """
        mode = self.scheduler_config.preemption_mode
        if mode is None:
            single = seq_group.get_max_num_running_seqs() == 1
            mode = PreemptionMode.RECOMPUTE if single else PreemptionMode.SWAP
        recomputable = seq_group.num_seqs(SequenceStatus.RUNNING) == 1
        if not recomputable:
            # Sequences forked from one prompt hold different tokens in
            # shared blocks: a prefill cannot rebuild that (vLLM asserts on
            # preemption_mode="recompute" here), so they swap.
            mode = PreemptionMode.SWAP
        if mode == PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            # The CPU pool is full. vLLM raises here and the engine stops; a
            # single sequence loses nothing by being recomputed instead.
            return PreemptionMode.RECOMPUTE if recomputable else None
        return mode

    def _abort_unswappable(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
        """Finish a victim that can go nowhere, so the others can run.

        vLLM raises "Aborted due to the lack of CPU swap space" from inside
        the scheduler, which stops the whole engine; aborting only this
        request (what vLLM's own comment there asks for) keeps the rest
        serving. It keeps the tokens it had; its finish reason says "abort".
        """
        logger.warning(
            "Request %s is aborted: its %d sequences must be swapped out to free blocks, but "
            "the CPU swap pool has only %d free blocks. A larger swap_space avoids this.",
            seq_group.request_id,
            seq_group.num_seqs(SequenceStatus.RUNNING),
            self.block_manager.get_num_free_cpu_blocks(),
        )
        for seq in seq_group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.free_seq(seq)
        out.aborted_seq_groups.append(seq_group)

    def _ignore(self, seq_group: SequenceGroup, out: SchedulerOutputs, why: str) -> None:
        logger.warning("Request %s is ignored: %s.", seq_group.request_id, why)
        for seq in seq_group.get_unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_IGNORED
            self.free_seq(seq)
        out.ignored_seq_groups.append(seq_group)


class MixedBatchScheduler(Scheduler):
    """The course's simplified scheduler: decodes and whole prompts share a
    step even without chunked prefill.

    It is vLLM's chunked-prefill flow (`_schedule_chunked_prefill`) with
    prompts never split: running requests decode first, then swapped ones
    come back, then waiting prompts are admitted whole while the token
    budget lasts. A 1-token decode and a 50-token prompt thus share a
    64-token step, where vLLM's default (`_schedule_default`) would run the
    prompt alone and the decode a step later. vLLM v0 has no such mode; it
    shows continuous batching in its plainest form. Select it with
    `scheduler_cls="minivllm.core.scheduler.MixedBatchScheduler"`; with
    `enable_chunked_prefill=True` it is the usual chunked-prefill scheduler.
    """

    def _schedule(self) -> SchedulerOutputs:
        if self.scheduler_config.scheduling_policy == "priority":
            self._sort_by_priority()
        return self._schedule_mixed_batch(self.scheduler_config.enable_chunked_prefill)
