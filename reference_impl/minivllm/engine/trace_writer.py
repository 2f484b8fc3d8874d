"""`TraceWriter`: the engine's trace, one JSON object per line (JSON Lines).

A step observer (engine/step_observer.py) that writes a header line (the
engine's configuration), a line per request as it is added, and a line per
step: the queues before and after, the batch token by token (ids,
positions, slots), block tables, free blocks, preemptions, block moves,
sampled tokens, finished requests, prefix-cache counts and phase timings.
Each line is flushed as it is written, so a run that crashes or is killed
still leaves every step it finished. Lines are strict JSON: a float that is
not finite (JSON has no NaN or Infinity) is written as null.

Turn it on with `LLM(..., trace="run.jsonl")`, `engine.start_trace(path)`,
the environment variable `MINIVLLM_TRACE=run.jsonl`, or `minivllm-trace
run`. The format is one contract, `minivllm/tracer/trace_schema.json`,
explained field by field in `minivllm/tracer/SCHEMA.md`; the views
(`minivllm-trace show / render / timeline / summary`) live in minivllm/tracer/.
The writer lives here, in the engine package, so that any program can trace
without the repository's tools on its path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import TYPE_CHECKING, Any

from minivllm.config import EngineConfig
from minivllm.engine.step_observer import StepRecord, queue_request_ids
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import SequenceGroup

if TYPE_CHECKING:
    from minivllm.engine.llm_engine import LLMEngine

# The format's version, the one number in Python: the tracer
# (minivllm/tracer/schema.py) reads the version trace_schema.json names, and
# tests/test_tracer.py checks that it is this one. The V1 engine's writer
# (minivllm/v1/engine/trace_writer.py) writes the same version.
SCHEMA_VERSION = 3


class TraceWriter:
    """Writes the header when created, then one line per request and step.

    Steps are numbered from 0 by this writer; a request's `arrival_step` is
    the number of the first step that could schedule it. A trace started
    while requests are queued (`engine.start_trace` mid-run) begins with a
    request line for each, arriving at step 0, so every step it writes
    names only requests it has described.
    """

    def __init__(self, path: str, engine: LLMEngine) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8")
        self._num_steps = 0
        bm = engine.scheduler.block_manager
        # The block manager's prefix-cache counters are cumulative; a step
        # line holds the step's own queries and hits.
        self._prefix_counts = (bm.prefix_cache_queries, bm.prefix_cache_hits)
        self._write(
            header_line(
                engine.engine_config, "classic", engine.scheduler.block_manager.watermark_blocks
            )
        )
        scheduler = engine.scheduler
        queued = [*scheduler.waiting, *scheduler.running, *scheduler.swapped]
        for seq_group in sorted(queued, key=lambda sg: sg.arrival_time):
            self.on_add_request(engine, seq_group)

    def close(self) -> None:
        self._file.close()

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(_dumps(line) + "\n")
        self._file.flush()

    def on_add_request(self, engine: LLMEngine, seq_group: SequenceGroup) -> None:
        prompt_token_ids = list(seq_group.prompt_token_ids)
        prompt = seq_group.prompt
        if prompt is None:
            prompt = engine.tokenizer.decode(prompt_token_ids)
        self._write(
            request_line(
                seq_group.request_id,
                self._num_steps,
                prompt,
                prompt_token_ids,
                seq_group.sampling_params,
                seq_group.priority,
            )
        )

    def on_step(self, engine: LLMEngine, record: StepRecord) -> None:
        self._write(self._step_line(engine, record))
        self._num_steps += 1

    def _step_line(self, engine: LLMEngine, record: StepRecord) -> dict[str, Any]:
        out = record.scheduler_outputs
        bm = engine.scheduler.block_manager
        prefix_cache = None
        if bm.enable_caching:
            queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
            prefix_cache = {
                "queries": queries - self._prefix_counts[0],
                "hits": hits - self._prefix_counts[1],
            }
            self._prefix_counts = (queries, hits)
        sampled = _sampled(record)
        return {
            "type": "step",
            "step": self._num_steps,
            "queues_before": record.queues_before,
            "queues_after": queue_request_ids(engine.scheduler),
            "scheduled": _scheduled(record),
            "num_batched_tokens": out.num_batched_tokens,
            "seqs": _seqs(engine, record, sampled),
            "block_tables": {
                str(seq_id): [block.block_number for block in table]
                for seq_id, table in bm.block_tables.items()
            },
            "free_blocks": {
                "gpu": bm.get_num_free_gpu_blocks(),
                "cpu": bm.get_num_free_cpu_blocks(),
            },
            "preempted": [
                {"request_id": sg.request_id, "mode": mode.value} for sg, mode in out.preempted
            ],
            "ignored": [sg.request_id for sg in out.ignored_seq_groups],
            "swap_in": [list(pair) for pair in out.blocks_to_swap_in],
            "swap_out": [list(pair) for pair in out.blocks_to_swap_out],
            "copy": [list(pair) for pair in out.blocks_to_copy],
            "sampled": sampled,
            "finished": [
                {"request_id": ro.request_id, "finish_reason": ro.outputs[0].finish_reason}
                for ro in record.request_outputs
                if ro.finished
            ],
            "prefix_cache": prefix_cache,
            "timings": {
                "schedule_ms": record.schedule_ms,
                "execute_ms": record.execute_ms,
                "process_ms": record.process_ms,
            },
            "collectives": _collectives(record),
        }


def _collectives(record: StepRecord) -> dict[str, Any] | None:
    """The driver's collectives this step (several tensor-parallel workers only)."""
    stats = record.collectives
    if stats is None:
        return None
    return {"calls": stats.calls, "bytes": stats.bytes, "ms": stats.seconds * 1e3}


def _dumps(line: dict[str, Any]) -> str:
    """The line as strict JSON. json.dumps writes NaN, Infinity and -Infinity
    by default, which are not JSON and which strict readers refuse; such a
    float (none is written today; a logprob of -inf could be) is written as null,
    as JavaScript's JSON.stringify does. Lines without one, nearly all,
    are written in a single pass."""
    try:
        return json.dumps(line, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(line), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with every float that is not finite replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def header_line(engine_config: EngineConfig, engine: str, watermark_blocks: int) -> dict[str, Any]:
    """The header: which engine ("classic" or "v1") and its configuration.
    V1 has no CPU swap pool and no watermark: it writes 0 for both."""
    model, cache = engine_config.model_config, engine_config.cache_config
    sched, parallel = engine_config.scheduler_config, engine_config.parallel_config
    mode = sched.preemption_mode
    return {
        "type": "header",
        "schema_version": SCHEMA_VERSION,
        "engine": engine,
        "model": model.model,
        "dry_run": model.dry_run,
        "device": engine_config.device_config.device,
        "max_model_len": model.max_model_len,
        "vocab_size": model.hf_config.vocab_size,
        "cache_config": {
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks,
            "num_cpu_blocks": cache.num_cpu_blocks if engine == "classic" else 0,
            "watermark_blocks": watermark_blocks,
            "enable_prefix_caching": cache.enable_prefix_caching,
        },
        "scheduler_config": {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "preemption_mode": None if mode is None else mode.value,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "scheduling_policy": sched.scheduling_policy,
        },
        "parallel_config": {
            "tensor_parallel_size": parallel.tensor_parallel_size,
            "distributed_executor_backend": parallel.distributed_executor_backend,
        },
    }


def request_line(
    request_id: str,
    arrival_step: int,
    prompt: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    priority: int,
) -> dict[str, Any]:
    """A request line (the same for both engines)."""
    return {
        "type": "request",
        "request_id": request_id,
        "arrival_step": arrival_step,
        "prompt": prompt,
        "prompt_token_ids": prompt_token_ids,
        "sampling_params": {
            f.name: _plain(getattr(params, f.name)) for f in dataclasses.fields(params) if f.init
        },
        "priority": priority,
    }


def _plain(value: Any) -> Any:
    """A field's value as JSON holds it: an enum (output_kind) by its name."""
    return value.name if isinstance(value, enum.Enum) else value


def _scheduled(record: StepRecord) -> list[dict[str, Any]]:
    """The batch, sequence by sequence, each with its slice of the model input."""
    batch, entries = record.batch, []
    index = start = 0  # the sequence's index in the batch, its first token's
    for meta in record.seq_group_metadata_list:
        for seq_id in meta.seq_data:
            end = start + batch.seq_lens[index] - batch.context_lens[index]
            entries.append(
                {
                    "request_id": meta.request_id,
                    "seq_id": seq_id,
                    "is_prefill": meta.is_prompt,
                    "num_tokens": end - start,
                    "token_ids": batch.input_ids[start:end],
                    "positions": batch.positions[start:end],
                    "slot_mapping": batch.slot_mapping[start:end],
                }
            )
            index, start = index + 1, end
    return entries


def _sampled(record: StepRecord) -> dict[str, int]:
    """seq id -> the token it got this step, as the engine paired samples
    with sequences (a prompt's first sample also names the children it
    forked into)."""
    return {str(seq_id): token for seq_id, _, token in record.samples}


def _seqs(
    engine: LLMEngine, record: StepRecord, sampled: dict[str, int]
) -> dict[str, dict[str, Any]]:
    """Every unfinished sequence, and those that finished this step: each
    one's request, status and lengths."""
    scheduler = engine.scheduler
    groups = [*scheduler.waiting, *scheduler.running, *scheduler.swapped]
    groups += [s.seq_group for s in record.scheduler_outputs.scheduled_seq_groups]
    seqs = {}
    for seq_group in groups:
        for seq in seq_group.seqs:
            finished = seq.is_finished()
            if finished and str(seq.seq_id) not in sampled:
                continue  # finished in an earlier step
            seqs[str(seq.seq_id)] = {
                "request_id": seq_group.request_id,
                "status": "finished" if finished else seq.status.name.lower(),
                "num_tokens": seq.get_len(),
                "num_computed_tokens": seq.data.num_computed_tokens,
            }
    return seqs
