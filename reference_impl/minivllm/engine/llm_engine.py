"""`LLMEngine`: the step loop that ties scheduler, worker and outputs together.

`add_request` turns a prompt into a `SequenceGroup` in the scheduler's
waiting queue. Each `step()` has three phases:

1. schedule: the scheduler picks the batch and the block moves;
2. execute: the worker moves blocks, runs the model and samples a token
   for every scheduled sequence;
3. process: new tokens are appended and detokenized (incrementally, by the
   `Detokenizer`), finished sequences are detected (`StopChecker`) and
   their blocks freed, and a `RequestOutput` is made for every request
   that took part.

Tools watch the steps through step observers (engine/step_observer.py);
the tracer (engine/trace_writer.py) is one. Unwatched, `step()` does
nothing more than the three phases.

A step is not transactional: the scheduler commits its decisions (block
moves, forks, prefix-cache entries) before the worker carries them out. An
exception inside the phases therefore leaves the queues and the KV cache
disagreeing, and the engine marks itself dead, as vLLM's does: the step
re-raises the error, and every later `step()` or `add_request()` raises
`EngineDeadError` naming it, instead of serving wrong tokens. Errors raised
by step observers come after the step is complete and leave it alive.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time

import minivllm
from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.core.scheduler import Scheduler, SchedulerOutputs
from minivllm.distributed import get_tp_group
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.metrics import StatLogger, Stats, build_stats
from minivllm.engine.step_observer import StepObserver, StepRecord, queue_request_ids
from minivllm.engine.stop_checker import StopChecker
from minivllm.engine.trace_writer import TraceWriter
from minivllm.executor import get_executor_class
from minivllm.inputs import InputPreprocessor, PromptType, get_eos_token_ids
from minivllm.model_executor.layers.sampler import SamplerOutput
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import (
    ExecuteModelRequest,
    PositionLogprobs,
    Sequence,
    SequenceGroup,
    SequenceGroupMetadata,
    SequenceOutput,
    SequenceStatus,
)
from minivllm.transformers_utils.detokenizer import Detokenizer
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.worker.model_runner import FlatBatch

logger = logging.getLogger(__name__)

_LOCAL_LOGGING_INTERVAL_SEC = 5.0  # vLLM's: one stats line every 5 s


class EngineDeadError(RuntimeError):
    """A step failed part-way, so the engine's state can no longer be
    trusted; it refuses all further work (vLLM has the same error)."""


def engine_dead_error(cause: BaseException) -> EngineDeadError:
    """What every call on an engine killed by `cause` raises (both engines)."""
    error = EngineDeadError(
        f"engine is dead: {type(cause).__name__}: {cause}. A step failed part-way, "
        "so its queues and KV cache can no longer be trusted; create a new engine."
    )
    error.__cause__ = cause
    return error


class LLMEngine:
    """`trace`: write every step to this JSON Lines file (see `start_trace`);
    the environment variable MINIVLLM_TRACE does the same for any program."""

    def __init__(
        self, engine_config: EngineConfig, log_stats: bool = False, trace: str | None = None
    ) -> None:
        logger.info(
            "Initializing an LLM engine (v%s) with config: %s", minivllm.__version__, engine_config
        )
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.tokenizer = get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.seq_counter = itertools.count()

        self.model_executor = get_executor_class(engine_config)(
            self.model_config, self.cache_config, engine_config.parallel_config,
            self.scheduler_config, engine_config.device_config,
        )
        num_gpu_blocks, num_cpu_blocks = self.model_executor.determine_num_available_blocks()
        self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)
        logger.info("# GPU blocks: %d, # CPU blocks: %d", num_gpu_blocks, num_cpu_blocks)
        # The worker in this process (the driver of several); Day 1 drives it by hand.
        self.worker = self.model_executor.driver_worker

        self.scheduler: Scheduler = self.scheduler_config.scheduler_cls(
            self.scheduler_config, self.cache_config
        )
        # The tokenizer's EOS and any the generation config adds.
        self.eos_token_ids = get_eos_token_ids(self.tokenizer, self.model_config.local_path)
        self.stop_checker = StopChecker(
            self.model_config.max_model_len, self.tokenizer.eos_token_id
        )
        self.input_preprocessor = InputPreprocessor(
            self.tokenizer, self.model_config, self.scheduler_config, self.eos_token_ids
        )
        # Requests aborted since the last step: their final outputs go out then.
        self._aborted: list[SequenceGroup] = []
        # Outputs of a step whose observer raised: the next step returns them.
        self._undelivered: list[RequestOutput] = []
        # The exception that killed the engine in a step (None: alive).
        self.dead_error: BaseException | None = None
        self._live_request_ids: set[str] = set()
        self.stat_logger = StatLogger(log_interval=_LOCAL_LOGGING_INTERVAL_SEC, enabled=log_stats)
        # The last step's Stats (forced logs, `do_log_stats`, leave it be).
        self._step_stats: Stats | None = None
        # The last processed step's (TTFTs, TPOTs): `_process_step` puts them in its Stats.
        self._token_latencies: tuple[list[float], list[float]] = ([], [])
        self.step_observers: list[StepObserver] = []
        self.trace_writer: TraceWriter | None = None
        trace = trace or envs.MINIVLLM_TRACE
        if trace:
            self.start_trace(trace)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, trace: str | None = None) -> LLMEngine:
        return cls(
            engine_args.create_engine_config(),
            log_stats=not engine_args.disable_log_stats,
            trace=trace,
        )

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. `prompt` is a string, or {"prompt_token_ids": [...]}
        (optionally with "prompt", its text), or {"prompt": text}. `priority`
        (lower first) needs scheduling_policy="priority".

        Everything is checked before anything is queued, as vLLM checks its
        inputs: a refused request (ValueError, or a TypeError for a wrong
        type) leaves the engine as it was, and an accepted one cannot fail
        inside a later step.
        """
        self._check_alive()
        prompt_text, prompt_token_ids = self._validate_request(
            request_id, prompt, params, arrival_time, priority
        )
        priority = int(priority)
        # The request's own copy, to which the engine adds its EOS ids and
        # its bad words' token ids.
        params = copy.deepcopy(params)
        params.update_from_generation_config(self.eos_token_ids, self.tokenizer.eos_token_id)
        params.update_from_tokenizer(self.tokenizer)
        # One sequence for the prompt; it forks into best_of after its prefill.
        seqs = [
            Sequence(
                next(self.seq_counter), prompt_text, prompt_token_ids, self.cache_config.block_size
            )
        ]
        arrival_time = time.time() if arrival_time is None else float(arrival_time)
        seq_group = SequenceGroup(request_id, seqs, params, arrival_time, priority)
        # Observers first: if one raises, the request is not queued.
        for observer in self.step_observers:
            observer.on_add_request(self, seq_group)
        self.scheduler.add_seq_group(seq_group)
        self._live_request_ids.add(request_id)

    def _validate_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None,
        priority: int,
    ) -> tuple[str | None, list[int]]:
        """The shared checks (inputs/preprocess.py), then the classic engine's own."""
        prompt_text, prompt_token_ids = self.input_preprocessor.validate_request(
            request_id, prompt, params, arrival_time, priority, self._live_request_ids
        )
        if self.input_preprocessor.cache_salt_of(prompt, request_id) is not None:
            raise ValueError(
                f"Request {request_id!r}: cache_salt is not supported by the classic engine "
                "(vLLM V0 had none); run the V1 engine (use_v1=True)"
            )
        max_num_seqs = self.scheduler_config.max_num_seqs
        if params.best_of > max_num_seqs:
            name = "best_of" if params.best_of > params.n else "n"  # the one that asked
            raise ValueError(
                f"Request {request_id!r}: {name}={params.best_of} sequences can never run "
                f"together under max_num_seqs={max_num_seqs}"
            )
        if params.prompt_logprobs is not None and self.cache_config.enable_prefix_caching:
            # A cached prefix is never run through the model: its logits,
            # and so its prompt logprobs, do not exist.
            raise ValueError(
                f"Request {request_id!r}: prompt_logprobs={params.prompt_logprobs} needs "
                "enable_prefix_caching=False"
            )
        return prompt_text, prompt_token_ids

    def abort_request(self, request_id: str | list[str]) -> None:
        """Finish requests as aborted now, freeing their blocks; their final
        outputs (finish_reason "abort") come out of the next `step()`.
        On a dead engine it does nothing: nothing will run again anyway, and
        a client cleaning up after the failure should not fail a second time."""
        if self.dead_error is not None:
            return
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            self._aborted += self.scheduler.abort_seq_group(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs() or bool(self._aborted or self._undelivered)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    # -- the step loop ----------------------------------------------------

    @property
    def errored(self) -> bool:
        """Whether a step failed part-way and the engine refuses all work."""
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise engine_dead_error(self.dead_error)

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        try:
            if self.step_observers:
                request_outputs, record = self._observed_step()
            else:
                request_outputs, record = self._plain_step(), None
        except BaseException as exc:  # KeyboardInterrupt half-way is no better
            self.dead_error = exc
            # A dead engine needs no workers: stop any in other processes
            # now, not when this object happens to be collected.
            self.model_executor.shutdown()
            raise
        request_outputs = self._undelivered + request_outputs
        self._undelivered = []
        if not self.has_unfinished_requests():
            # Nothing left: release the other workers from waiting for a step.
            self.model_executor.stop_remote_worker_execution_loop()
        if record is not None:
            self._notify_observers(record, request_outputs)
        return request_outputs

    def _plain_step(self) -> list[RequestOutput]:
        seq_group_metadata_list, scheduler_outputs = self.scheduler.schedule()
        output = self._execute_model(seq_group_metadata_list, scheduler_outputs)
        return self._process_step(output, scheduler_outputs, seq_group_metadata_list)

    def _execute_model(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        scheduler_outputs: SchedulerOutputs,
        with_batch: bool = False,
    ) -> SamplerOutput:
        if scheduler_outputs.is_empty():  # nothing to run or move: no call (vLLM's step)
            return SamplerOutput([])
        return self.model_executor.execute_model(
            ExecuteModelRequest(
                seq_group_metadata_list,
                scheduler_outputs.blocks_to_swap_in,
                scheduler_outputs.blocks_to_swap_out,
                scheduler_outputs.blocks_to_copy,
                with_batch=with_batch,
            )
        )

    def _process_step(
        self,
        output: SamplerOutput,
        scheduler_outputs: SchedulerOutputs,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        samples: list[tuple[int, int, int]] | None = None,
    ) -> list[RequestOutput]:
        request_outputs = self._process_model_outputs(output, scheduler_outputs, samples)
        self._step_stats = build_stats(self.scheduler, scheduler_outputs, seq_group_metadata_list)
        ttfts, tpots = self._token_latencies
        self._step_stats.time_to_first_tokens_iter = ttfts
        self._step_stats.time_per_output_tokens_iter = tpots
        self.stat_logger.log(self._step_stats)
        return request_outputs

    def _observed_step(self) -> tuple[list[RequestOutput], StepRecord]:
        """The same three phases, timed, and a `StepRecord` of them.

        The record's batch is the one the worker built and ran the model on
        (flattened before the outputs are processed, which append tokens to
        the very `SequenceData` it reads); its samples are who got which
        token, as `_assign_samples` paired them.
        """
        queues_before = queue_request_ids(self.scheduler)
        start = time.perf_counter()
        seq_group_metadata_list, scheduler_outputs = self.scheduler.schedule()
        scheduled = time.perf_counter()
        collectives = get_tp_group().stats
        before = dataclasses.replace(collectives)
        output = self._execute_model(seq_group_metadata_list, scheduler_outputs, with_batch=True)
        executed = time.perf_counter()
        samples: list[tuple[int, int, int]] = []
        request_outputs = self._process_step(
            output, scheduler_outputs, seq_group_metadata_list, samples
        )
        processed = time.perf_counter()
        batch: FlatBatch | None = output.batch
        if batch is None:  # nothing ran
            batch = FlatBatch.build([], self.cache_config.block_size)
        record = StepRecord(
            queues_before=queues_before,
            seq_group_metadata_list=seq_group_metadata_list,
            scheduler_outputs=scheduler_outputs,
            batch=batch,
            output=output,
            samples=samples,
            request_outputs=request_outputs,
            schedule_ms=(scheduled - start) * 1e3,
            execute_ms=(executed - scheduled) * 1e3,
            process_ms=(processed - executed) * 1e3,
            collectives=None if get_tp_group().world_size == 1 else collectives - before,
        )
        return request_outputs, record

    def _notify_observers(self, record: StepRecord, request_outputs: list[RequestOutput]) -> None:
        """Show each observer the finished step. If one raises, the step's
        outputs (final ones among them) are kept for the next `step()`."""
        try:
            for observer in self.step_observers:
                observer.on_step(self, record)
        except BaseException:
            self._undelivered = request_outputs
            raise

    # -- watching the steps -------------------------------------------------

    def add_step_observer(self, observer: StepObserver) -> None:
        self.step_observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.step_observers.remove(observer)

    def start_trace(self, path: str) -> TraceWriter:
        """Write this engine's trace to `path` (JSON Lines, one line per
        request and step; format: minivllm/tracer/SCHEMA.md), replacing any
        trace it was writing. View it with `minivllm-trace show PATH`."""
        self.stop_trace()
        self.trace_writer = TraceWriter(path, self)
        self.add_step_observer(self.trace_writer)
        return self.trace_writer

    def stop_trace(self) -> None:
        if self.trace_writer is not None:
            self.remove_step_observer(self.trace_writer)
            self.trace_writer.close()
            self.trace_writer = None

    def get_stats(self) -> Stats:
        """The last step's `Stats`; before the first step, the current state's."""
        if self._step_stats is None:
            return build_stats(self.scheduler)
        return self._step_stats

    def do_log_stats(self) -> Stats:
        """vLLM's forced log (its server calls it every 10 s): the state now,
        with no step, so every per-step count is 0 and only the gauges move;
        the log line prints if its interval is up, so an idle server still
        shows one. Returns those `Stats` for the server's stat loggers."""
        stats = build_stats(self.scheduler)
        self.stat_logger.log(stats)
        return stats

    def _process_model_outputs(
        self,
        output: SamplerOutput,
        scheduler_outputs: SchedulerOutputs,
        samples: list[tuple[int, int, int]] | None = None,
    ) -> list[RequestOutput]:
        """Add the sampled tokens, finish and free what is done, and make the
        step's `RequestOutput`s. `samples`, if given, gets one
        (seq_id, parent_seq_id, token) per sample: the sequence that received
        it (the parent itself, or a child just forked from it)."""
        now = time.time()
        ttfts: list[float] = []  # the step's token latencies, for its Stats
        tpots: list[float] = []
        self._token_latencies = (ttfts, tpots)
        scheduled = scheduler_outputs.scheduled_seq_groups
        for scheduled_group, group_output in zip(scheduled, output, strict=True):
            seq_group = scheduled_group.seq_group
            if group_output.prompt_logprobs is not None:
                self._append_prompt_logprobs(seq_group, group_output.prompt_logprobs)
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.data.update_num_computed_tokens(scheduled_group.token_chunk_size)
            for seq, sample in self._assign_samples(seq_group, group_output.samples):
                if samples is not None:
                    samples.append((seq.seq_id, sample.parent_seq_id, sample.output_token))
                self._process_sample(seq_group, seq, sample)
            if group_output.samples:
                seq_group.metrics.record_token(now, ttfts, tpots)
        self.scheduler.free_finished_seq_groups()

        finished_now = [s.seq_group for s in scheduled] + scheduler_outputs.ignored_seq_groups
        finished_now += scheduler_outputs.aborted_seq_groups
        finished_now += self._aborted
        self._aborted = []
        for seq_group in finished_now:
            if seq_group.is_finished() and seq_group.metrics.finished_time is None:
                seq_group.metrics.finished_time = now
                self._live_request_ids.discard(seq_group.request_id)
        outputs = (RequestOutput.from_seq_group(sg) for sg in finished_now)
        return [output for output in outputs if output is not None]  # None: FINAL_ONLY, running

    def _assign_samples(
        self, seq_group: SequenceGroup, samples: list[SequenceOutput]
    ) -> list[tuple[Sequence, SequenceOutput]]:
        """Pair each sample with the sequence it extends.

        A prompt's first step draws `best_of` samples from one sequence: it
        keeps the first and forks a child for each other one. Children share
        all the parent's blocks (nothing is copied until one writes into a
        shared, partly filled block). Forks happen before any token is added.
        """
        pairs = []
        for sample in samples:
            parent = seq_group.seqs_dict[sample.parent_seq_id]
            if any(seq is parent for seq, _ in pairs):
                child = parent.fork(next(self.seq_counter))
                self.scheduler.fork_seq(parent, child)
                seq_group.add(child)
                pairs.append((child, sample))
            else:
                pairs.append((parent, sample))
        return pairs

    def _process_sample(
        self, seq_group: SequenceGroup, seq: Sequence, sample: SequenceOutput
    ) -> None:
        """Append a sampled token, extend the text, and stop if it is done."""
        params = seq_group.sampling_params
        seq.append_token_id(sample.output_token, sample.logprobs[sample.output_token].logprob)
        seq.output_logprobs.append(sample.logprobs)
        new_char_count = self.detokenizer.decode_sequence_inplace(seq, params)
        self.stop_checker.maybe_stop_sequence(seq, new_char_count, params)
        if seq.is_finished():
            self.scheduler.free_seq(seq)

    def _append_prompt_logprobs(
        self, seq_group: SequenceGroup, prompt_logprobs: list[PositionLogprobs]
    ) -> None:
        """Record the prompt logprobs this step's prefill computed.

        They start at the prompt token after the last computed one. A prefill
        run again after a RECOMPUTE preemption computes them again: only
        those not yet recorded are kept.
        """
        # The prefilling sequence (a finished sibling's count is stale).
        first = seq_group.get_seqs(SequenceStatus.RUNNING)[0].data.num_computed_tokens + 1
        known = len(seq_group.prompt_logprobs)
        seq_group.prompt_logprobs += prompt_logprobs[known - first :]
        self.detokenizer.decode_prompt_logprobs_inplace(
            seq_group.prompt_token_ids, seq_group.prompt_logprobs, known, seq_group.sampling_params
        )
