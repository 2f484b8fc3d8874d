"""The scheduler: which requests run in the next forward pass.

Three queues hold every unfinished request, each in first-come-first-served
order: `waiting` (not yet prefilled, or preempted by RECOMPUTE), `running`
(KV cache on the device) and `swapped` (KV cache moved to the CPU pool).
`schedule()` builds one mixed batch per step:

1. every running request gets its next decode token; when the cache has no
   block for it, the last-arrived running request is preempted (RECOMPUTE
   or SWAP) until it fits;
2. if nothing was preempted, swapped requests that fit are swapped back in
   and decode too;
3. if nothing was preempted and none is left swapped, waiting requests are
   admitted for their prefill while `max_num_seqs` and
   `max_num_batched_tokens` allow.

Running before swapped before waiting is the priority order: a running
request arrived before any request it could preempt, and admitting new
prompts while swapped or just-preempted requests wait would starve them.

`scheduling_policy="priority"` forms batches the same way but orders every
queue by each request's priority (lower first), then arrival: admission,
swap-in and the choice of preemption victim (the queue's tail) follow it.

`scheduling_policy="prefill_first"` is vLLM v0's classic default instead:
while prompts wait (and nothing is swapped), a step is prefills only;
decodes run only in steps with no prefill, and swapped requests come back
only in steps with no preemption. Same tokens, different batches.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
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
    """A group in this step's batch; each of its running sequences computes
    `token_chunk_size` tokens (the whole uncomputed prompt, or 1 to decode)."""

    seq_group: SequenceGroup
    token_chunk_size: int


@dataclass
class SchedulerOutputs:
    """The scheduler's decisions for one step.

    scheduled_seq_groups: the batch, prefills first, then decodes.
    blocks_to_swap_in: (cpu block, gpu block) pairs to copy before the pass.
    blocks_to_swap_out: (gpu block, cpu block) pairs to copy before the pass.
    blocks_to_copy: (src, dst) gpu block pairs (copy-on-write).
    ignored_seq_groups: prompts that can never fit; finished as ignored.
    preempted: groups preempted this step, with how.
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


@dataclass
class SchedulingBudget:
    """What is left of this step's token and sequence limits."""

    token_budget: int
    max_num_seqs: int
    num_batched_tokens: int = 0
    num_curr_seqs: int = 0

    def can_schedule(self, num_new_tokens: int, num_new_seqs: int) -> bool:
        return (
            self.num_batched_tokens + num_new_tokens <= self.token_budget
            and self.num_curr_seqs + num_new_seqs <= self.max_num_seqs
        )

    def add(self, num_new_tokens: int, num_new_seqs: int) -> None:
        self.num_batched_tokens += num_new_tokens
        self.num_curr_seqs += num_new_seqs


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
        bisect.insort(self.waiting, seq_group, key=self._queue_key)

    def abort_seq_group(self, request_id: str) -> list[SequenceGroup]:
        """Finish a request as aborted, from whichever queue holds it, and
        free its blocks at once. Returns the aborted groups (0 or 1)."""
        aborted = []
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in [sg for sg in queue if sg.request_id == request_id]:
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
        self._sort_queues()
        now = time.time()
        seq_group_metadata_list = []
        for scheduled in scheduler_outputs.scheduled_seq_groups:
            seq_group = scheduled.seq_group
            seq_group.maybe_set_first_scheduled_time(now)
            running = seq_group.get_seqs(SequenceStatus.RUNNING)
            # Only the chunk that completes the sequence samples a token.
            completes = running[0].data.num_computed_tokens + scheduled.token_chunk_size
            seq_group_metadata_list.append(
                SequenceGroupMetadata(
                    request_id=seq_group.request_id,
                    is_prompt=seq_group.is_prefill(),
                    seq_data={seq.seq_id: seq.data for seq in running},
                    sampling_params=seq_group.sampling_params,
                    block_tables={
                        seq.seq_id: self.block_manager.get_block_table(seq) for seq in running
                    },
                    token_chunk_size=scheduled.token_chunk_size,
                    do_sample=completes == running[0].get_len(),
                    generator=seq_group.generator,
                )
            )
        return seq_group_metadata_list, scheduler_outputs

    def _sort_queues(self) -> None:
        """Put every queue in policy order: arrival, or priority then arrival.

        New requests are inserted in order; preempted, swapped-in and
        admitted ones join the queues in the order things happen in a step.
        Sorting at the end of the step restores the order that admission and
        the choice of victim (the tail) rely on; on a nearly sorted queue it
        costs about one pass.
        """
        self.waiting = deque(sorted(self.waiting, key=self._queue_key))
        self.running = deque(sorted(self.running, key=self._queue_key))
        self.swapped = deque(sorted(self.swapped, key=self._queue_key))

    def _queue_key(self, seq_group: SequenceGroup) -> tuple[int, float]:
        if self.scheduler_config.scheduling_policy == "priority":
            return seq_group.priority, seq_group.arrival_time
        return 0, seq_group.arrival_time

    def _schedule(self) -> SchedulerOutputs:
        if self.scheduler_config.scheduling_policy == "prefill_first":
            return self._schedule_prefill_first()
        budget, out = self._new_budget(), self._new_outputs()
        decodes, prefills = self._schedule_running(budget, out)
        if not out.preempted:
            decodes += self._schedule_swapped(budget, out)
        if not out.preempted and not self.swapped:
            prefills += self._schedule_prefills(budget, out)
        return self._finish(out, budget, prefills, decodes)

    def _schedule_prefill_first(self) -> SchedulerOutputs:
        """vLLM v0's classic policy: a step is all prefills or all decodes."""
        budget, out = self._new_budget(), self._new_outputs()
        if not self.swapped:
            # Running requests keep their places against max_num_seqs.
            budget.add(0, sum(sg.get_max_num_running_seqs() for sg in self.running))
            prefills = self._schedule_prefills(budget, out)
            if prefills:
                return self._finish(out, budget, prefills, [])
            budget = self._new_budget()
        decodes, _ = self._schedule_running(budget, out)
        if not out.preempted:
            decodes += self._schedule_swapped(budget, out)
        return self._finish(out, budget, [], decodes)

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
        """Record that each running sequence of the group computes `num_tokens`
        this step; with prefix caching, the blocks this fills become findable
        for the requests scheduled after it."""
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            computed = seq.data.num_computed_tokens + num_tokens
            self.block_manager.mark_blocks_as_computed(seq, computed)
        return ScheduledSequenceGroup(seq_group, token_chunk_size=num_tokens)

    def _chunk_size(self, num_uncomputed: int, budget: SchedulingBudget) -> int:
        """Tokens of a prefill to compute this step.

        Without chunked prefill: all of them. With it: as many as the token
        budget has left; with prefix caching too, a whole number of blocks
        (unless the chunk ends the prompt), so that every chunk ends on a
        block boundary and full blocks can be cached as they complete.
        """
        if not self.scheduler_config.enable_chunked_prefill:
            return num_uncomputed
        chunk = min(num_uncomputed, budget.token_budget - budget.num_batched_tokens)
        if self.cache_config.enable_prefix_caching and chunk < num_uncomputed:
            chunk -= chunk % self.cache_config.block_size
        return chunk

    def _schedule_running(
        self, budget: SchedulingBudget, out: SchedulerOutputs
    ) -> tuple[list[ScheduledSequenceGroup], list[ScheduledSequenceGroup]]:
        """Give each running request a slot for its next token, preempting
        the last-arrived requests when the cache runs out of blocks; then,
        with the tokens left, continue the chunked prefills under way.

        Returns (decodes, prefill chunks).
        """
        decodes, prefilling = [], []
        running, self.running = self.running, deque()
        while running:
            seq_group = running.popleft()
            if seq_group.is_prefill():
                # A chunked prefill under way: it holds blocks for its whole
                # prompt already, and waits until the decodes are served.
                prefilling.append(seq_group)
                self.running.append(seq_group)
                continue
            while not self.block_manager.can_append_slots(seq_group):
                # Preempt the lowest-priority request: the last to arrive.
                victim = running.pop() if running else seq_group
                self._preempt(victim, out)
                if victim is seq_group:
                    break
            else:
                for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                    out.blocks_to_copy += self.block_manager.append_slots(seq)
                num_seqs = seq_group.num_seqs(SequenceStatus.RUNNING)
                budget.add(num_seqs, num_seqs)
                decodes.append(self._scheduled(seq_group, 1))
                self.running.append(seq_group)

        chunks = []
        for seq_group in prefilling:
            seq = seq_group.get_seqs(SequenceStatus.RUNNING)[0]
            # It holds its running slots, scheduled or not.
            budget.add(0, seq_group.get_max_num_running_seqs())
            chunk = self._chunk_size(seq.get_num_new_tokens(), budget)
            if chunk:
                budget.add(chunk, 0)
                chunks.append(self._scheduled(seq_group, chunk))
        return decodes, chunks

    def _schedule_swapped(
        self, budget: SchedulingBudget, out: SchedulerOutputs
    ) -> list[ScheduledSequenceGroup]:
        """Bring swapped requests back, oldest first, while they fit."""
        decodes = []
        while self.swapped:
            seq_group = self.swapped[0]
            status = self.block_manager.can_swap_in(seq_group)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self.swapped.popleft()
                self._ignore(seq_group, out, "its KV cache no longer fits the device pool")
                continue
            num_seqs = seq_group.num_seqs(SequenceStatus.SWAPPED)
            if not budget.can_schedule(num_seqs, num_seqs):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.block_manager.swap_in(seq_group)
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
                out.blocks_to_copy += self.block_manager.append_slots(seq)
            budget.add(num_seqs, num_seqs)
            decodes.append(self._scheduled(seq_group, 1))
            self.running.append(seq_group)
        return decodes

    def _schedule_prefills(
        self, budget: SchedulingBudget, out: SchedulerOutputs
    ) -> list[ScheduledSequenceGroup]:
        """Admit waiting requests in arrival order while they fit."""
        prefills = []
        while self.waiting:
            seq_group = self.waiting[0]
            seq = seq_group.get_seqs(SequenceStatus.WAITING)[0]
            status = self.block_manager.can_allocate(seq_group)
            if status == AllocStatus.LATER:
                break
            if status == AllocStatus.NEVER:
                self.waiting.popleft()
                bm = self.block_manager
                self._ignore(
                    seq_group,
                    out,
                    f"its {seq.get_len()} tokens need {seq.n_blocks} blocks of "
                    f"{bm.block_size} but the KV cache has {bm.num_total_gpu_blocks} blocks "
                    f"({bm.watermark_blocks} kept free as watermark)",
                )
                continue
            num_new_seqs = seq_group.get_max_num_running_seqs()
            num_cached = self.block_manager.get_num_cached_tokens(seq)
            num_new_tokens = self._chunk_size(seq.get_len() - num_cached, budget)
            if num_new_tokens == 0 or not budget.can_schedule(num_new_tokens, num_new_seqs):
                break
            self.waiting.popleft()
            num_cached = self.block_manager.allocate(seq_group)
            for s in seq_group.get_seqs(SequenceStatus.WAITING):
                s.status = SequenceStatus.RUNNING
                s.data.num_computed_tokens = num_cached
            budget.add(num_new_tokens, num_new_seqs)
            prefills.append(self._scheduled(seq_group, num_new_tokens))
            self.running.append(seq_group)
        return prefills

    # -- preemption ----------------------------------------------------------

    def _preempt(self, seq_group: SequenceGroup, out: SchedulerOutputs) -> None:
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
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.WAITING
                self.free_seq(seq)
                seq.reset_state_for_recompute()
            self.waiting.append(seq_group)  # sorted into place at the end of the step
        else:
            out.blocks_to_swap_out += self.block_manager.swap_out(seq_group)
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)  # sorted into place at the end of the step
        out.preempted.append((seq_group, mode))

    def _preemption_mode(self, seq_group: SequenceGroup) -> PreemptionMode | None:
        """How to preempt this group; None when it can be neither swapped
        out nor recomputed."""
        mode = self.scheduler_config.preemption_mode
        recomputable = seq_group.num_seqs(SequenceStatus.RUNNING) == 1
        if seq_group.is_prefill():
            # A partly prefilled prompt has little to save, and swapping it
            # back in would resume it as a decode: recompute it.
            mode = PreemptionMode.RECOMPUTE
        elif not recomputable:
            # Sequences forked from one prompt hold different tokens in
            # shared blocks: a prefill cannot rebuild that, so they swap.
            mode = PreemptionMode.SWAP
        elif mode is None:
            # vLLM's default for one sequence: recomputing is cheaper than a
            # round trip of its blocks over PCIe.
            mode = PreemptionMode.RECOMPUTE
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
