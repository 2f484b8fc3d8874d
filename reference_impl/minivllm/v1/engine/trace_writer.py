"""`V1TraceWriter`: V1's steps in the tracer's format (engine "v1").

The same file format as the classic engine's (engine/trace_writer.py: a
header, request lines, step lines, JSON Lines flushed line by line), with
step lines that say what V1 does (minivllm/tracer/SCHEMA.md, "V1 step"):
the batch as the model runner flattened it, each request's
`num_computed_tokens` catching up with its `num_tokens`, block tables by
request, the free queue in eviction order with the blocks that still hold
a cached hash, preemptions (always recompute), sampled tokens, finished
requests, the step's prefix-cache lookups in tokens, and phase timings.

A step observer of V1's `LLMEngine` (v1/engine/step_observer.py). Turn it
on with `LLM(..., use_v1=True, trace="run.jsonl")`, `engine.start_trace`,
or MINIVLLM_TRACE. It reads the engine core in this process, and names
requests as the engine core does: by the user's ids ("0_x", "1_x" for the
children of "x"), but for a request whose id another live request held,
which has a random suffix (`InputProcessor.assign_request_id`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minivllm.engine.trace_writer import _dumps, header_line, request_line
from minivllm.v1.engine.step_observer import V1StepRecord, queue_request_ids
from minivllm.v1.request import Request

if TYPE_CHECKING:
    from minivllm.v1.engine.llm_engine import LLMEngine


class V1TraceWriter:
    """Writes the header when created, then one line per request and step.

    Steps are numbered from 0 by this writer. A trace started while
    requests are queued opens with a request line for each (arriving at
    step 0). The writer keeps the `Request` objects it has described and not
    yet seen finish, so that a step can list those that finished in it
    (and those aborted since the step before) with their last state.
    """

    def __init__(self, path: str, engine: LLMEngine) -> None:
        self.path = path
        self._file = open(path, "w", encoding="utf-8")
        self._num_steps = 0
        self._live: dict[str, Request] = {}
        core = engine.engine_core.engine_core
        self._write(header_line(engine.engine_config, "v1", 0))
        queued = sorted(core.scheduler.requests.values(), key=lambda r: r.arrival_time)
        for request in queued:
            self.on_add_request(engine, request.request_id)

    def close(self) -> None:
        self._file.close()

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(_dumps(line) + "\n")
        self._file.flush()

    def on_add_request(self, engine: LLMEngine, request_id: str) -> None:
        request = engine.engine_core.engine_core.scheduler.requests[request_id]
        self._live[request_id] = request
        state = engine.output_processor.request_states.get(request_id)
        prompt = state.prompt if state is not None else None
        prompt_token_ids = list(request.prompt_token_ids)
        if prompt is None:
            prompt = engine.tokenizer.decode(prompt_token_ids)
        self._write(
            request_line(
                request_id,
                self._num_steps,
                prompt,
                prompt_token_ids,
                request.sampling_params,
                request.priority,
            )
        )

    def on_step(self, engine: LLMEngine, record: V1StepRecord) -> None:
        self._write(self._step_line(engine, record))
        self._num_steps += 1

    def _step_line(self, engine: LLMEngine, record: V1StepRecord) -> dict[str, Any]:
        scheduler = engine.engine_core.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        out = record.scheduler_output
        finished = self._finished(scheduler.requests, record)
        free_queue = pool.free_block_queue.get_all_free_blocks()
        return {
            "type": "step",
            "step": self._num_steps,
            "queues_before": record.queues_before,
            "queues_after": queue_request_ids(scheduler),
            "scheduled": _scheduled(record),
            "num_batched_tokens": 0 if out is None else out.total_num_scheduled_tokens,
            "requests": [
                _request_state(r)
                for r in [*scheduler.running, *scheduler.waiting, *(r for r, _ in finished)]
            ],
            "block_tables": {
                rid: [block.block_id for block in blocks]
                for rid, blocks in manager.req_to_blocks.items()
            },
            "free_blocks": {"gpu": pool.get_num_free_blocks()},
            "free_queue": {
                "block_ids": [block.block_id for block in free_queue],
                "cached": [block.block_id for block in free_queue if block.block_hash is not None],
            },
            "preempted": [
                {"request_id": r.request_id, "mode": "recompute"}
                for r in scheduler.waiting
                if out is not None and r.request_id in out.preempted_req_ids
            ],
            "sampled": _sampled(record),
            "finished": [
                {"request_id": r.request_id, "finish_reason": reason} for r, reason in finished
            ],
            "prefix_cache": _prefix_cache(manager.enable_caching, record),
            "timings": {
                "schedule_ms": record.schedule_ms,
                "execute_ms": record.execute_ms,
                "update_ms": record.update_ms,
                "process_ms": record.process_ms,
            },
        }

    def _finished(
        self, unfinished: dict[str, Request], record: V1StepRecord
    ) -> list[tuple[Request, str]]:
        """The requests described and gone from the scheduler since the last
        step line, in arrival order, each with its finish reason: the engine
        core's, "stop" for a stop string the front end found (the engine core
        saw an abort), else "abort" (aborted since the step before)."""
        reasons = {o.request_id: str(o.finish_reason) for o in record.outputs.outputs if o.finished}
        reasons.update((rid, "stop") for rid in record.stopped_by_string)
        gone = [r for rid, r in self._live.items() if rid not in unfinished]
        for request in gone:
            del self._live[request.request_id]
        return [(r, reasons.get(r.request_id, "abort")) for r in gone]


def _request_state(request: Request) -> dict[str, Any]:
    return {
        "request_id": request.request_id,
        "status": request.status.name.lower(),
        "num_tokens": request.num_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_preemptions": request.num_preemptions,
    }


def _scheduled(record: V1StepRecord) -> list[dict[str, Any]]:
    """The batch, row by row, each with its slice of the model's input."""
    inputs, entries, start = record.inputs, [], 0
    if inputs is None:
        return entries
    input_ids, positions = inputs.input_ids.tolist(), inputs.positions.tolist()
    slots = inputs.slot_mapping.tolist()
    for row, req_id in enumerate(inputs.req_ids):
        num_tokens = int(inputs.num_scheduled_tokens[row])
        end = start + num_tokens
        entries.append(
            {
                "request_id": req_id,
                "num_computed_tokens": int(inputs.num_computed_tokens[row]),
                "num_tokens": num_tokens,
                "token_ids": input_ids[start:end],
                "positions": positions[start:end],
                "slot_mapping": slots[start:end],
            }
        )
        start = end
    return entries


def _sampled(record: V1StepRecord) -> dict[str, int]:
    """request id -> the token the model sampled for it this step."""
    output = record.model_output
    if output is None:
        return {}
    return {
        req_id: tokens[0]
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True)
        if tokens
    }


def _prefix_cache(enable_caching: bool, record: V1StepRecord) -> dict[str, int] | None:
    """The step's prefix-cache lookups, in tokens, from the scheduler's stats."""
    if not enable_caching:
        return None
    stats = record.outputs.scheduler_stats
    counts = None if stats is None else stats.prefix_cache_stats
    if counts is None:  # no step ran: no lookups
        return {"queries": 0, "hits": 0, "preempted_queries": 0, "preempted_hits": 0}
    return {
        "queries": counts.queries,
        "hits": counts.hits,
        "preempted_queries": counts.preempted_queries,
        "preempted_hits": counts.preempted_hits,
    }
