"""Scenario files: an engine configuration and a list of requests, played
step by step on the real engine (or its dry run) into a trace.

A scenario is YAML or JSON:

    description: what it shows, in a sentence or two
    shows: [admission_blocked]        # claims checked after the run (CLAIMS)
    engine:                           # EngineArgs by name (block_size, ...)
      block_size: 16
      num_gpu_blocks_override: 10
    prefixes:                         # optional: shared prompt starts, in tokens
      system: 48
    requests:
      - id: A                         # default: its index
        prompt_len: 100               # or prompt: "text", or prompt_token_ids: [...]
        prefix: system                # optional: the prompt starts with this prefix
        arrival_step: 0               # added before this step (default 0)
        max_tokens: 3                 # and any other SamplingParams field
        priority: 0                   # with scheduling_policy: priority

With `use_v1: true` among the engine options (or `-e use_v1=true`), the
scenario plays on the V1 engine (minivllm/v1/; no dry run) into a V1 trace.
Claims about what V1 never does (swaps, copy-on-write) are then not shown.

Prompts given by length are pseudo-random token ids (no special tokens),
the same on every run; a prefix is the same ids in every request using it.

A scenario, prompt or engine option that cannot be played raises
`ScenarioError` saying which and why (the CLI prints it in one line).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from minivllm import EngineArgs, LLMEngine, SamplingParams
from minivllm.tracer.errors import ScenarioError
from minivllm.tracer.trace import Trace

SCENARIO_DIR = Path(__file__).parent / "scenarios"


@dataclass
class Scenario:
    name: str
    description: str
    engine: dict[str, Any]
    requests: list[dict[str, Any]]
    prefixes: dict[str, int] = field(default_factory=dict)
    shows: list[str] = field(default_factory=list)


def _read_data(path: Path) -> Any:
    """The scenario file's contents, JSON or YAML by its suffix."""
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{path}: cannot be read ({e})") from None
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise ScenarioError(f"{path}: not {kind}: {' '.join(str(e).split())}") from None


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    data = _read_data(path)
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a mapping with a 'requests' list")
    unknown = sorted(set(data) - {"description", "shows", "engine", "prefixes", "requests"})
    if unknown:
        raise ScenarioError(f"{path}: unknown scenario keys {unknown}")
    requests = data.get("requests")
    if not requests or not isinstance(requests, list):
        raise ScenarioError(f"{path}: a scenario needs a non-empty 'requests' list")
    if not all(isinstance(r, dict) for r in requests):
        raise ScenarioError(f"{path}: each of 'requests' is a mapping (id, prompt_len, ...)")
    for key in ("engine", "prefixes"):
        if not isinstance(data.get(key) or {}, dict):
            raise ScenarioError(f"{path}: '{key}' is a mapping of names to values")
    shows = data.get("shows") or []
    bad = sorted(map(str, set(shows) - set(CLAIMS))) if isinstance(shows, list) else [shows]
    if bad:
        raise ScenarioError(f"{path}: unknown claims {bad} in 'shows'; known: {sorted(CLAIMS)}")
    return Scenario(
        name=path.stem,
        description=str(data.get("description") or "").strip(),
        engine=data.get("engine") or {},
        requests=requests,
        prefixes=data.get("prefixes") or {},
        shows=shows,
    )


def shipped_scenarios() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.yaml"))


_REQUEST_KEYS = {"id", "prompt", "prompt_len", "prompt_token_ids", "prefix", "arrival_step"}


def _token_ids(seed: str, n: int, vocab: list[int]) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(n)]


def build_prompt(scenario: Scenario, request: dict[str, Any], engine: LLMEngine) -> dict:
    """The engine prompt of one scenario request."""
    if "prompt" in request:
        return {"prompt": request["prompt"]}
    if "prompt_token_ids" in request:
        return {"prompt_token_ids": request["prompt_token_ids"]}
    if "prompt_len" not in request:
        raise ScenarioError(f"request {request['id']}: give prompt, prompt_len or prompt_token_ids")
    if not _is_count(request["prompt_len"]):
        raise ScenarioError(f"request {request['id']}: prompt_len is a number of tokens")
    special = set(engine.tokenizer.all_special_ids)
    vocab = [t for t in range(engine.model_config.hf_config.vocab_size) if t not in special]
    ids: list[int] = []
    if "prefix" in request:
        name = request["prefix"]
        if name not in scenario.prefixes or not _is_count(scenario.prefixes[name]):
            raise ScenarioError(f"request {request['id']}: no prefix {name!r} of some tokens")
        ids = _token_ids(f"prefix:{name}", scenario.prefixes[name], vocab)
    own = request["prompt_len"] - len(ids)
    if own < 0:
        raise ScenarioError(f"request {request['id']}: prompt_len is shorter than its prefix")
    return {"prompt_token_ids": ids + _token_ids(f"request:{request['id']}", own, vocab)}


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _engine(
    scenario: Scenario,
    trace_path: str | Path,
    model: str,
    dry_run: bool,
    overrides: dict[str, Any],
) -> LLMEngine:
    """The scenario's engine, tracing. The engine checks its options as it
    is made: one it refuses is the scenario's error (or -e's), not a bug."""
    kwargs = {**scenario.engine, **overrides}
    try:
        args = EngineArgs.from_kwargs("the engine options", model=model, dry_run=dry_run, **kwargs)
        if args.resolve_use_v1():  # use_v1: true (or MINIVLLM_USE_V1=1): V1, traced in-process
            from minivllm.v1.engine.llm_engine import LLMEngine as V1LLMEngine

            return V1LLMEngine.from_engine_args(
                args, trace=str(trace_path), multiprocess_mode=False
            )
        return LLMEngine.from_engine_args(args, trace=str(trace_path))
    except (TypeError, ValueError, OSError) as e:
        raise ScenarioError(f"{scenario.name}: {e}") from e


def _request(
    scenario: Scenario, index: int, request: dict[str, Any], engine: LLMEngine
) -> tuple[int, dict[str, Any], dict, SamplingParams]:
    """(arrival step, request, engine prompt, sampling params) of one request."""
    request = {"id": str(index), **request}
    request["id"] = str(request["id"])
    arrival = request.get("arrival_step", 0)
    if not _is_count(arrival) or type(request.get("priority", 0)) is not int:
        raise ScenarioError(f"request {request['id']}: arrival_step and priority are integers")
    params = {k: v for k, v in request.items() if k not in _REQUEST_KEYS | {"priority"}}
    try:
        sampling = SamplingParams(**params)
    except (TypeError, ValueError) as e:
        raise ScenarioError(f"request {request['id']}: {e}") from e
    return arrival, request, build_prompt(scenario, request, engine), sampling


def run_scenario(
    scenario: Scenario,
    trace_path: str | Path,
    model: str,
    dry_run: bool = False,
    engine_overrides: dict[str, Any] | None = None,
    max_steps: int = 100_000,
    observers: Iterable[Any] = (),
) -> int:
    """Play the scenario into a trace; returns the number of steps run.

    Step k first adds the requests whose arrival_step is k, then runs one
    engine step, even an empty one, so that trace step numbers are the
    scenario's. `observers` are attached to the engine (add_step_observer)
    before the first request is added.
    """
    engine = _engine(scenario, trace_path, model, dry_run, engine_overrides or {})
    for observer in observers:
        engine.add_step_observer(observer)
    step = 0
    try:
        pending = [_request(scenario, i, r, engine) for i, r in enumerate(scenario.requests)]
        pending.sort(key=lambda item: item[0])
        while pending or engine.has_unfinished_requests():
            if step == max_steps:
                raise ScenarioError(f"scenario {scenario.name} still running after {step} steps")
            while pending and pending[0][0] <= step:
                _, request, prompt, params = pending.pop(0)
                _add_request(engine, request, prompt, params)
            engine.step()
            step += 1
    finally:
        engine.stop_trace()
    return step


def _add_request(
    engine: LLMEngine, request: dict[str, Any], prompt: dict, params: SamplingParams
) -> None:
    """Add one request; a prompt the engine refuses (too long, ids outside the
    vocabulary, an id in use) names the request."""
    try:
        engine.add_request(request["id"], prompt, params, priority=request.get("priority", 0))
    except ValueError as e:
        raise ScenarioError(f"request {request['id']}: {e}") from e


# -- claims: what a scenario says it shows, checked on its trace --------------
#
# Each returns a sentence naming where the trace shows it, or None.


def _blocks_needed(trace: Trace, request_id: str) -> int:
    return math.ceil(len(trace.requests[request_id]["prompt_token_ids"]) / trace.block_size)


def _admission_blocked(trace: Trace) -> str | None:
    """A prompt stays waiting with room in the batch, for lack of free blocks."""
    free_before = trace.num_gpu_blocks
    watermark = trace.header["cache_config"]["watermark_blocks"]
    budget = trace.header["scheduler_config"]["max_num_batched_tokens"]
    for step in trace.steps:
        waiting = step["queues_after"]["waiting"]
        # Blocks are only taken while scheduling and given back afterwards:
        # with nothing finished, the free blocks after the step are those
        # the waiting prompt was refused with; else at most those before.
        free = free_before if step["finished"] else step["free_blocks"]["gpu"]
        if waiting and not step["preempted"]:
            head = waiting[0]
            prompt_len = len(trace.requests[head]["prompt_token_ids"])
            need = _blocks_needed(trace, head)
            if step["num_batched_tokens"] + prompt_len <= budget and need > free - watermark:
                return f"step {step['step']}: {head} waits, needing {need} blocks with {free} free"
        free_before = step["free_blocks"]["gpu"]
    return None


def _token_budget_split(trace: Trace) -> str | None:
    """Prompts that arrived together are admitted over several steps because
    of max_num_batched_tokens, though blocks were free for the next one."""
    budget = trace.header["scheduler_config"]["max_num_batched_tokens"]
    for step in trace.steps:
        admitted = [e for e in step["scheduled"] if trace.is_prefill(e)]
        waiting = step["queues_after"]["waiting"]
        # (With nothing finished, the free blocks after the step are those
        # the scheduler saw last.)
        if admitted and waiting and not step["preempted"] and not step["finished"]:
            head = waiting[0]
            prompt_len = len(trace.requests[head]["prompt_token_ids"])
            fits_blocks = _blocks_needed(trace, head) <= step["free_blocks"]["gpu"]
            if fits_blocks and step["num_batched_tokens"] + prompt_len > budget:
                return (
                    f"step {step['step']}: {step['num_batched_tokens']} tokens batched, "
                    f"{head}'s {prompt_len} would pass the budget of {budget}"
                )
    return None


def _preempted(mode: str) -> Callable[[Trace], str | None]:
    def check(trace: Trace) -> str | None:
        for step in trace.steps:
            for p in step["preempted"]:
                if p["mode"] == mode:
                    return f"step {step['step']}: {p['request_id']} preempted by {mode}"
        return None

    check.__doc__ = f"A request is preempted by {mode.upper()}."
    return check


def _swapped_back(trace: Trace) -> str | None:
    """Blocks go out to the CPU pool and come back."""
    out = next((s["step"] for s in trace.steps if s.get("swap_out")), None)  # none in V1
    back = next((s["step"] for s in trace.steps if s.get("swap_in")), None)
    if out is not None and back is not None and out < back:
        return f"swapped out in step {out}, back in step {back}"
    return None


def _copy_on_write(trace: Trace) -> str | None:
    """A shared block is copied before a sequence writes into it."""
    for step in trace.steps:
        if step.get("copy"):  # V1 never copies
            return f"step {step['step']}: copy-on-write of blocks {step['copy']}"
    return None


def _prefix_cache_hit(trace: Trace) -> str | None:
    """A prompt's first blocks are found in the prefix cache."""
    for step in trace.steps:
        if step["prefix_cache"] and step["prefix_cache"]["hits"]:
            unit = "tokens" if trace.is_v1 else "blocks"
            return f"step {step['step']}: {step['prefix_cache']['hits']} cached {unit} reused"
    return None


def _chunked_prefill(trace: Trace) -> str | None:
    """A prompt is prefilled in chunks, beside other requests' decodes."""
    for step in trace.steps:
        for e in step["scheduled"]:
            prompt_len = len(trace.requests[e["request_id"]]["prompt_token_ids"])
            partial = trace.is_prefill(e) and e["positions"][-1] + 1 < prompt_len
            beside_decode = any(not trace.is_prefill(d) for d in step["scheduled"])
            if partial and beside_decode:
                return (
                    f"step {step['step']}: {e['request_id']} prefills positions "
                    f"{e['positions'][0]}-{e['positions'][-1]} of {prompt_len} beside decodes"
                )
    return None


CLAIMS: dict[str, Callable[[Trace], str | None]] = {
    "admission_blocked": _admission_blocked,
    "token_budget_split": _token_budget_split,
    "preempted_recompute": _preempted("recompute"),
    "preempted_swap": _preempted("swap"),
    "swapped_back": _swapped_back,
    "copy_on_write": _copy_on_write,
    "prefix_cache_hit": _prefix_cache_hit,
    "chunked_prefill": _chunked_prefill,
}


def check_claims(scenario: Scenario, trace: Trace) -> dict[str, str | None]:
    """claim -> where the trace shows it, or None where it does not."""
    return {claim: CLAIMS[claim](trace) for claim in scenario.shows}
