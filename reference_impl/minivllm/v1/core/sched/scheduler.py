"""V1's `Scheduler` (vLLM's `vllm/v1/core/sched/scheduler.py`).

There is no prefill phase and no decode phase. Each request has
`num_computed_tokens` and `num_tokens`; each step the scheduler hands out
one token budget (`max_num_batched_tokens`) so that the first catches up
with the second:

1. RUNNING requests first, in order. Each gets what it is missing (one
   token for a decode, the rest of the prompt for a chunked prefill), cut to
   the budget left. If its K/V does not fit, the request at the *tail* of
   RUNNING is preempted (freed, back to the front of WAITING, its
   `num_computed_tokens` reset: recompute is the only kind of preemption),
   again and again until it fits or the request preempted is this one.
2. WAITING requests next, in queue order, but only if nothing was
   preempted this step (room just freed is for the preempted to come back
   to). A request's cached prefix is looked up first; it gets the rest of
   its tokens, cut to the budget left: a long prompt is simply chunked.
   The first that does not fit stops the loop. The prefix-cache stats
   count a request's lookup when it is admitted, not each time it is
   looked up while it waits.

Chunked prefill is therefore the default, not a mode: a prompt longer than
the budget left is split (unless `enable_chunked_prefill=False`, which makes
it wait for a step with room). After scheduling, every scheduled request's
`num_computed_tokens` is advanced at once, as if the step had run.

`update_from_output` takes the worker's sampled tokens back: it appends
them, checks the stop conditions it can see in token ids (EOS, stop token
ids, lengths; stop strings are the front end's) and frees finished requests.
Last, it publishes the KV-cache events of the step (blocks cached and
evicted while scheduling it; `distributed/kv_events.py`), as vLLM's does.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Iterable

from minivllm.config import CacheConfig, KVEventsConfig, SchedulerConfig
from minivllm.distributed.kv_events import KVEventBatch, create_event_publisher
from minivllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from minivllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from minivllm.v1.core.sched.utils import check_stop
from minivllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from minivllm.v1.metrics.stats import SchedulerStats
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_events_config: KVEventsConfig | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.policy = SchedulingPolicy(scheduler_config.scheduling_policy)
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker drops their state.
        self.finished_req_ids: set[str] = set()
        # Preempted since the last schedule(), in it or between two steps
        # (reset_prefix_cache): the next SchedulerOutput names them.
        self.reset_preempted_req_ids: set[str] = set()
        self.prev_step_scheduled_req_ids: set[str] = set()

        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=cache_config.num_gpu_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            log_stats=True,
            enable_kv_cache_events=bool(
                kv_events_config and kv_events_config.enable_kv_cache_events
            ),
        )
        self.kv_event_publisher = create_event_publisher(kv_events_config)
        # Closes the publisher once: at shutdown(), or when an engine dropped
        # without it is collected.
        self._close_publisher = weakref.finalize(self, self.kv_event_publisher.shutdown)

    # -- requests ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (an abort, a stop string the front
        end found): out of their queue, blocks freed."""
        assert RequestStatus.is_finished(finished_status)
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for req_id in ids:
            request = self.requests.get(req_id)
            if request is None:
                continue  # already finished
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """Work for a step: requests to run, or finished ones the worker
        must still be told about."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Empty the prefix cache; True if it was emptied.

        Blocks in use keep their hashes, so by default this is refused
        (False) while any request runs. `reset_running_requests=True`
        preempts every running request first, so no block is held and the
        reset cannot be refused (RuntimeError if it is all the same): they
        wait at the front of the queue and are recomputed, in their old
        order (what RL trainers want after loading new weights into vLLM:
        every K/V computed so far is stale).
        """
        if reset_running_requests:
            self._preempt_all_running(time.time())
        reset = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not reset:
            raise RuntimeError(
                "the prefix cache could not be reset even with every running "
                "request preempted: a block is still held"
            )
        return reset

    def _preempt_all_running(self, timestamp: float) -> None:
        """Preempt every running request, the last first: each goes to the
        front of WAITING, so the first ends up first again. The worker's
        copy of them is now stale: as if they had not run in the last step,
        the next schedule sends their whole token lists, and the runner
        drops their rows and adds them back with their new blocks."""
        while self.running:
            self._preempt_request(self.running.pop(), timestamp)
        self.prev_step_scheduled_req_ids.clear()

    # -- one step ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        scheduled_timestamp = time.time()  # one time for the step's events

        # 1. RUNNING requests.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            num_new_tokens = self._cap_long_prefill(num_new_tokens)
            num_new_tokens = min(num_new_tokens, token_budget)
            # (vLLM also caps this at max_model_len - 1 - num_computed_tokens,
            # for speculative tokens; without them num_tokens never passes
            # max_model_len: check_stop finishes a request that reaches it.)

            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # Out of blocks: preempt the lowest-priority request.
                if self.policy == SchedulingPolicy.PRIORITY:
                    preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        # Scheduled earlier in this loop: take it back.
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req.request_id)
                        req_to_new_blocks.pop(preempted_req.request_id)
                        req_index -= 1
                else:
                    preempted_req = self.running.pop()
                self._preempt_request(preempted_req, scheduled_timestamp)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break  # nothing left to preempt: it cannot run now
            if new_blocks is None:
                break

            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. WAITING requests, unless this step had to preempt.
        if not preempted_reqs:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting.peek_request()
                # A new or preempted request has nothing computed: look up its prefix.
                new_computed_blocks, num_new_local_computed_tokens = (
                    self.kv_cache_manager.get_computed_blocks(request)
                )
                num_computed_tokens = num_new_local_computed_tokens
                num_new_tokens = request.num_tokens - num_computed_tokens
                num_new_tokens = self._cap_long_prefill(num_new_tokens)
                if (
                    not self.scheduler_config.enable_chunked_prefill
                    and num_new_tokens > token_budget
                ):
                    break  # unchunked: wait for a step with room for all of it
                num_new_tokens = min(num_new_tokens, token_budget)
                # Room for the whole prompt, not only this chunk (vLLM's
                # scheduler_reserve_full_isl): a prompt admitted chunk by
                # chunk could otherwise run out of blocks halfway and preempt.
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_new_local_computed_tokens, new_computed_blocks,
                    full_sequence_must_fit=self.scheduler_config.scheduler_reserve_full_isl,
                )
                if new_blocks is None:
                    break

                # Recorded at admission, as vLLM does: a request looked up in
                # step after step while it waits for room counts once.
                self.kv_cache_manager.record_prefix_cache_stats(
                    request, num_new_local_computed_tokens
                )
                request = self.waiting.pop_request()
                self.running.append(request)
                request.record_event(EngineCoreEventType.SCHEDULED, scheduled_timestamp)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                else:
                    scheduled_resumed_reqs.append(request)
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                    request.request_id
                )
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed_tokens

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert len(self.running) <= self.max_num_running_reqs

        # The longest prefix all running requests share (for cascade attention).
        num_common_prefix_blocks = 0
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id
            )

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(r, req_to_new_blocks[r.request_id].get_block_ids())
                for r in scheduled_new_reqs
            ],
            scheduled_cached_reqs=self._make_cached_request_data(
                scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
        )
        self.reset_preempted_req_ids = set()
        self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _preempt_request(self, request: Request, timestamp: float | None = None) -> None:
        """Free a running request's blocks and put it back at the front of
        WAITING; it will be computed again, finding what it can in the
        prefix cache. (The caller has taken it out of RUNNING.) `timestamp`
        stamps its PREEMPTED event: the step's time, or now."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)

    def _cap_long_prefill(self, num_new_tokens: int) -> int:
        """At most `long_prefill_token_threshold` tokens of a prompt a step
        (0: no cap), so one long prompt cannot take a whole step's budget
        while shorter ones wait."""
        threshold = self.scheduler_config.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        req_to_new_blocks: dict[str, KVCacheBlocks],
    ) -> CachedRequestData:
        data = CachedRequestData()
        for req in itertools.chain(running_reqs, resumed_reqs):
            req_id = req.request_id
            data.req_ids.append(req_id)
            if req in resumed_reqs:
                data.resumed_req_ids.add(req_id)
            if req_id not in self.prev_step_scheduled_req_ids:
                # The worker did not see its last tokens come out.
                data.all_token_ids[req_id] = list(req.all_token_ids)
            data.new_block_ids.append(req_to_new_blocks[req_id].get_block_ids())
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(req.num_output_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance every scheduled request's `num_computed_tokens` now, so the
        output above still says where each step starts; and clear the
        finished ids, which the output now carries."""
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_scheduled
        self.finished_req_ids = set()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append each request's sampled tokens, stop and free those done,
        and say what each request gained."""
        outputs: list[EngineCoreOutput] = []
        stopped_running_reqs: set[Request] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished (aborted) while the step ran
            req_index = model_runner_output.req_id_to_index[req_id]
            new_token_ids = list(model_runner_output.sampled_token_ids[req_index])
            stopped = False
            if new_token_ids:
                new_token_ids, stopped = self._update_request_with_output(request, new_token_ids)
            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                self._free_request(request)
                stopped_running_reqs.add(request)
            new_logprobs = None
            if request.sampling_params.logprobs is not None and new_token_ids:
                new_logprobs = [model_runner_output.logprobs[req_index]]
            if new_token_ids or stopped:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=model_runner_output.prompt_logprobs_dict.get(req_id),
                        finish_reason=finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        events=request.take_events(),
                    )
                )
        if stopped_running_reqs:
            self.running = [r for r in self.running if r not in stopped_running_reqs]
        events = self.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(scheduler_output))

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        stopped = False
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            stopped = check_stop(request, self.max_model_len)
            if stopped:
                del new_token_ids[num_new:]
                break
        return new_token_ids, stopped

    def make_stats(self, scheduler_output: SchedulerOutput | None = None) -> SchedulerStats:
        return SchedulerStats(
            num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens
            if scheduler_output
            else 0,
            num_preempted_reqs=len(scheduler_output.preempted_req_ids) if scheduler_output else 0,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
        )

    def shutdown(self) -> None:
        """Close the KV-event publisher (its socket and thread)."""
        self._close_publisher()
