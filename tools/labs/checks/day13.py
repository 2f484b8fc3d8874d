"""Checkers for day 13, serving (labs/day13_serving.ipynb).

Each runs the learner's code on real output (a real server's stream and
/metrics, or the real `AsyncLLMEngine` with the learner's piece plugged in)
and on small made-up inputs that make each common mistake visible, and
prints one line, or raises AssertionError saying what was expected, what
came back, and where to look.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import json

import httpx
import uvicorn
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import AsyncEngineArgs
from minivllm.engine.async_llm_engine import AsyncLLMEngine, RequestTracker
from minivllm.entrypoints.openai.api_server import init_app
from minivllm.entrypoints.openai.cli_args import make_arg_parser
from tools.labs.checks._common import (  # noqa: F401 - needs: for the notebook
    is_unfinished,
    needs,
    passed,
)
from tools.labs.checks._engine_runs import learner_code, passes_through, quiet_engine
from tools.labs.server import free_port

DAY = 13
MODEL = "minivllm-stories"
STALL_S = 20.0  # how long a stream may stay silent before the checker calls it stuck

def run_async(coroutine):
    """Run a coroutine to its end on a fresh event loop in a thread: a
    notebook's kernel already runs a loop, where `asyncio.run` is refused."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# -- exercise 1: SSE by hand ---------------------------------------------------------


def _event(index: int, text: str, finish_reason: str | None = None) -> str:
    chunk = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": MODEL,
             "choices": [{"index": index, "text": text, "logprobs": None,
                          "finish_reason": finish_reason, "stop_reason": None}]}
    return "data: " + json.dumps(chunk)


def _frame(*events: str) -> list[str]:
    """Lines as `httpx.Response.iter_lines()` gives them: a blank one after each event."""
    lines = []
    for e in events:
        lines += [e, ""]
    return lines


_WHERE1 = " Look at your `parse_completion_stream`."


def _parse(parse, lines, what):
    with learner_code(f"parse_completion_stream({what})", _hint_for_crash(parse)):
        return parse(list(lines))


def _hint_for_crash(parse) -> str:
    """Which common mistake makes `parse` raise: tried on the smallest streams."""
    one = _frame(_event(0, "Hi", "length"))
    try:
        parse(list(one))
    except Exception:  # noqa: BLE001
        return (" It fails even on a single event without `[DONE]`: each line starts with "
                "`data: ` (strip it before json.loads) and the lines between events are blank "
                "(skip them).")
    return (" It parses events but not the end of the stream: `data: [DONE]` is not JSON; "
            "stop reading there instead of decoding it.")


def _expect(got, want, why: str) -> None:
    if got != want:
        raise AssertionError(f"Day {DAY}, exercise 1: {why}\n  expected {want!r}\n  got      "
                             f"{got!r}.{_WHERE1}")


def exercise_1(parse_completion_stream, base_url: str) -> None:
    """`parse_completion_stream(lines) -> {index: (deltas, finish_reason)}`
    on made-up streams that show each mistake, then on a real n=2 stream
    against the same request not streamed."""
    p = parse_completion_stream
    simple = _frame(_event(0, "Once"), _event(0, " upon"), _event(0, "", "length"), "data: [DONE]")
    _expect(_parse(p, simple, "a one-choice stream"), {0: (["Once", " upon", ""], "length")},
            "a stream whose last chunk has empty text and finish_reason 'length': keep every "
            "delta in order, and the finish_reason of the chunk that carries it (the last chunk's "
            "text is empty, its finish_reason is not).")
    after = _frame(_event(0, "A", "stop"), "data: [DONE]", _event(0, "garbage"))
    _expect(_parse(p, after, "a stream with a line after [DONE]"), {0: (["A"], "stop")},
            "`data: [DONE]` ends the stream: stop reading there (nothing after it is an event).")
    two = _frame(_event(0, "The"), _event(1, "A"), _event(1, " dog", "length"), _event(0, " cat"),
                 _event(0, "", "stop"), "data: [DONE]")
    _expect(_parse(p, two, "an n=2 stream"),
            {0: (["The", " cat", ""], "stop"), 1: (["A", " dog"], "length")},
            "with n=2, the chunks of the two choices interleave; each chunk's "
            "`choices[i]['index']` says whose delta it is: keep one list and one finish_reason "
            "per index, never one concatenation.")
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                   seed=5, n=2)
    with httpx.stream("POST", base_url + "/v1/completions", json={**request, "stream": True},
                      timeout=120) as response:
        response.raise_for_status()
        lines = list(response.iter_lines())
    full = httpx.post(base_url + "/v1/completions", json=request, timeout=120).json()
    got = _parse(p, lines, "the server's real stream")
    want = {c["index"]: c for c in full["choices"]}
    _expect(sorted(got), sorted(want), "the real n=2 stream has choices 0 and 1.")
    for i, choice in want.items():
        deltas, reason = got[i]
        _expect("".join(deltas), choice["text"],
                f"choice {i}'s deltas, joined, must be the text the same request gets without "
                "streaming.")
        _expect(reason, choice["finish_reason"], f"choice {i}'s finish_reason")
    passed(DAY, 1)


# -- exercise 2: routing a step's outputs to the streams ------------------------------

_WHERE2 = (" Look at your `process_request_output` / `abort_request` (the reference is "
           "`reference_impl/minivllm/engine/async_llm_engine.py::RequestTracker`).")


class _EngineWith(AsyncLLMEngine):
    """The real AsyncLLMEngine with another RequestTracker class."""

    tracker_cls: type = RequestTracker

    def start_background_loop(self) -> None:
        super().start_background_loop()
        self._request_tracker = self.tracker_cls()  # before the loop task first runs


# (prompt, max_tokens) of the requests that run to the end; two more run
# 200 tokens and leave after 2 outputs (one client disconnects, one is aborted).
_NORMAL = [("Once upon a time", 16), ("The little dog", 24), ("Tom and Sue went", 12),
           ("One day, a cat", 20), ("The sun was", 18), ("Lily had a red ball", 22)]
_LONG = 200


@functools.lru_cache(maxsize=1)
def _offline_tokens() -> tuple[tuple[int, ...], ...]:
    with quiet_engine():
        llm = LLM()
        outs = llm.generate([p for p, _ in _NORMAL],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                             for _, n in _NORMAL], use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


async def _read(engine, prompt, max_tokens, rid, log, leave_after=None, abort_after=None):
    """One client: returns its outputs and how its stream ended."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    log[rid] = outputs
    try:
        async for out in engine.generate(prompt, params, rid):
            outputs.append(out)
            if leave_after and len(outputs) == leave_after:
                return outputs, "left"  # closes the generator: the client disconnected
            if abort_after and len(outputs) == abort_after:
                await engine.abort(rid)
    except asyncio.CancelledError:
        return outputs, "cancelled"
    return outputs, "ended"


async def _abort_while_queued(engine, prompt, max_tokens, rid, log, after):
    """A client whose request is aborted before any step takes it: once request
    `after` has an output (the loop is stepping; or after 2 s), the request is
    queued (what `generate` does first) and aborted with nothing awaited in
    between, so the loop cannot have handed it to the engine. Returns as
    `_read` does."""
    for _ in range(400):
        if log.get(after):
            break
        await asyncio.sleep(0.005)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stream = engine.add_request(rid, prompt, params)
    await engine.abort(rid)  # the client went away at once
    outputs = []
    log[rid] = outputs
    try:
        async for out in stream.generator():
            outputs.append(out)
    except asyncio.CancelledError:
        return outputs, "cancelled"
    return outputs, "ended"


_QUEUED = ("A small fox", 24)  # the request aborted while still queued


async def _run_workload(tracker_cls):
    engine = _EngineWith.from_engine_args(AsyncEngineArgs(disable_log_stats=True,
                                                          disable_log_requests=True))
    engine.tracker_cls = tracker_cls
    added: list[str] = []  # the ids that reach LLMEngine.add_request
    aborted: set[str] = set()  # and LLMEngine.abort_request
    add_request, abort_request = engine.engine.add_request, engine.engine.abort_request

    def record_add(request_id, *args, **kwargs):
        added.append(request_id)
        return add_request(request_id, *args, **kwargs)

    def record_abort(request_id):
        aborted.update([request_id] if isinstance(request_id, str) else request_id)
        return abort_request(request_id)

    engine.engine.add_request, engine.engine.abort_request = record_add, record_abort
    log: dict[str, list] = {}
    tasks = [_read(engine, p, n, f"req-{i}", log) for i, (p, n) in enumerate(_NORMAL)]
    tasks.append(_read(engine, "A big bear", _LONG, "leaves", log, leave_after=2))
    tasks.append(_read(engine, "The old tree", _LONG, "aborted", log, abort_after=2))
    tasks.append(_abort_while_queued(engine, *_QUEUED, "queued", log, after="req-0"))
    tasks = [asyncio.ensure_future(t) for t in tasks]
    done, pending = await asyncio.wait(tasks, timeout=STALL_S)
    ids = [f"req-{i}" for i in range(len(_NORMAL))] + ["leaves", "aborted", "queued"]
    stuck = [rid for rid, t in zip(ids, tasks, strict=True) if t in pending]
    for t in pending:
        t.cancel()
    results = {rid: t.result() if t in done and not t.exception() else None
               for rid, t in zip(ids, tasks, strict=True)}
    errors = {rid: t.exception() for rid, t in zip(ids, tasks, strict=True)
              if t in done and t.exception()}
    state = dict(
        unfinished=engine.engine.has_unfinished_requests(),
        free=engine.engine.scheduler.block_manager.get_num_free_gpu_blocks(),
        total=engine.engine.cache_config.num_gpu_blocks,
        streams=sorted(engine._request_tracker._request_streams),
        queued=sorted(engine._request_tracker._new_requests),
        added=added,
        aborted=aborted,
        loop_error=engine.dead_error,
    )
    engine.shutdown_background_loop()
    await asyncio.sleep(0)
    return results, stuck, errors, log, state


@functools.lru_cache(maxsize=1)
def _offline_texts() -> tuple[str, ...]:
    with quiet_engine():
        outs = LLM().generate([p for p, _ in _NORMAL[:3]],
                              [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                               for _, n in _NORMAL[:3]], use_tqdm=False)
    return tuple(o.outputs[0].text for o in outs)


async def _stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                       leave_after: int | None = None) -> str:
    """One streamed /v1/completions; with `leave_after`, hang up after that
    many events, as a client that goes away does."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, events = "", 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[len("data: "):])["choices"][0]["text"]
            events += 1
            if leave_after and events == leave_after:
                break  # leaving the block closes the connection
    return text


async def _serve_with(tracker_cls) -> tuple[list[str] | None, dict]:
    """The real server (FastAPI app, uvicorn) in this process, its engine
    using the learner's tracker; three clients read to the end, one hangs up."""
    engine = _EngineWith.from_engine_args(AsyncEngineArgs(disable_log_stats=True,
                                                          disable_log_requests=True))
    engine.tracker_cls = tracker_cls
    aborted: list[str] = []  # what reaches LLMEngine.abort_request
    abort_request = engine.engine.abort_request

    def record_abort(request_id):
        aborted.extend([request_id] if isinstance(request_id, str) else request_id)
        abort_request(request_id)

    engine.engine.abort_request = record_abort
    app = init_app(engine, make_arg_parser(argparse.ArgumentParser()).parse_args([]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    texts = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=STALL_S) as client:
        with contextlib.suppress(httpx.TimeoutException):
            texts = await asyncio.gather(
                *(_stream_text(client, p, n) for p, n in _NORMAL[:3]),
                _stream_text(client, "A big bear", _LONG, leave_after=2),
            )
    for _ in range(int(STALL_S / 0.05)):  # an unaborted hang-up runs its 200 tokens
        if not engine.engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.05)
    state = dict(aborted=len(aborted),
                 free=engine.engine.scheduler.block_manager.get_num_free_gpu_blocks(),
                 total=engine.engine.cache_config.num_gpu_blocks)
    server.should_exit = True
    await serving
    engine.shutdown_background_loop()
    return texts, state


def _check_through_the_server(tracker_cls) -> None:
    with quiet_engine(), learner_code("The server with your tracker", _WHERE2):
        texts, state = run_async(_serve_with(tracker_cls))
    if texts is None:
        raise _fail2(f"behind the real server, a streamed request got no news for {STALL_S:.0f} s "
                     "with your tracker.")
    if tuple(texts[:3]) != _offline_texts():
        raise _fail2("behind the real server, the streamed texts differ from LLM.generate's: "
                     f"got {texts[:3]!r}, expected {list(_offline_texts())!r}.")
    if not state["aborted"]:
        raise _fail2("behind the real server, a client hung up mid-stream and its request ran "
                     "on to its end: the server closes the stream's generator, which calls your "
                     "`abort_request`; it must add the id to `self._aborted_requests` so that "
                     "the loop hands it to `LLMEngine.abort_request`.")
    if state["free"] != state["total"]:
        raise _fail2("behind the real server, every request is over but "
                     f"{state['total'] - state['free']} KV blocks are still in use.")


def _fail2(message: str) -> AssertionError:
    return AssertionError(f"Day {DAY}, exercise 2: {message}{_WHERE2}")


def _check_output_after_abort(tracker_cls, output) -> None:
    """A client leaves while a step runs: the step's output for its request
    comes back after the abort popped the stream. Made certain here, on the
    tracker alone (in the engine it happens only when timing allows)."""
    tracker = tracker_cls()
    tracker.add_request("left-during-step", prompt="Hi", params=SamplingParams())
    tracker.get_new_and_aborted_requests()
    tracker.abort_request("left-during-step")
    late = copy.copy(output)
    late.request_id = "left-during-step"
    try:
        tracker.process_request_output(late)
        late.finished = True
        tracker.process_request_output(late)
    except Exception as error:  # noqa: BLE001 - reported to the learner
        if passes_through(error):
            raise
        raise _fail2(f"an output came back for a request aborted while the step ran, and your "
                     f"`process_request_output` raised {type(error).__name__}: {error}. In the "
                     "engine that kills the loop for every client. Its stream is already gone: "
                     "use `.get` or `.pop(request_id, None)` and skip the output.") from error


def exercise_2(tracker_cls) -> None:
    """Nine concurrent requests through the real AsyncLLMEngine with the
    learner's tracker: six run to the end (compared with LLM.generate), one
    client disconnects after 2 outputs, one is aborted by `engine.abort`, and
    one is aborted while still queued (the engine must never see it). Then
    the same tracker behind the real server (uvicorn, in this process): three
    streams compared with LLM.generate, and a client that hangs up."""
    if not (isinstance(tracker_cls, type) and issubclass(tracker_cls, RequestTracker)):
        raise AssertionError(f"Day {DAY}, exercise 2: pass your RequestTracker subclass (the "
                             f"class), got {tracker_cls!r}.")
    want = _offline_tokens()
    with quiet_engine(), learner_code("The engine loop with your tracker", _WHERE2):
        results, stuck, errors, log, state = run_async(_run_workload(tracker_cls))
    if state["loop_error"] is not None or errors:
        error = state["loop_error"] or next(iter(errors.values()))
        if is_unfinished(error):
            raise error
        if state["loop_error"] is None:  # raised in a client's call: the abort
            raise _fail2(f"a client's abort failed inside your code: {type(error).__name__}: "
                         f"{error}. `abort_request` gets any id: one in the engine, one still "
                         "queued in `self._new_requests`, or one already over (do nothing). Use "
                         "`.pop(request_id, None)`.")
        raise _fail2(f"the engine loop failed inside your code: {type(error).__name__}: {error}. "
                     "An output can come back for a request aborted while the step ran, whose "
                     "stream is already gone: use `.get` or `.pop(request_id, None)` and skip "
                     "the output.")
    for i, (prompt, _) in enumerate(_NORMAL):
        rid = f"req-{i}"
        outs = log.get(rid, [])
        if rid in stuck:
            if outs and outs[-1].finished:
                raise _fail2(f"request {rid!r} got its last output (finished=True) but its stream "
                             f"never ended ({STALL_S:.0f} s without news): call `stream.finish()` "
                             "after putting a finished output.")
            raise _fail2(f"request {rid!r} got {len(outs)} output(s), none finished, then "
                         f"nothing for {STALL_S:.0f} s: every output must reach its stream while "
                         "the request runs (`.get` the stream; pop it only when the output is "
                         "finished).")
        if not outs or not outs[-1].finished:
            raise _fail2(f"request {rid!r}'s stream ended after {len(outs)} output(s) without the "
                         "one with finished=True: put the last output into the stream before "
                         "finishing it (pop the stream, put, then finish).")
        got = tuple(outs[-1].outputs[0].token_ids)
        if got != want[i]:
            raise _fail2(f"request {rid!r} ({prompt!r}) ended with tokens {list(got)}, "
                         f"LLM.generate gives {list(want[i])}: each output must go to the stream "
                         "of its own `request_id`.")
    if "aborted" in stuck:
        raise _fail2("after `engine.abort('aborted')` its reader waited "
                     f"{STALL_S:.0f} s: `abort_request` must finish the stream (with "
                     "asyncio.CancelledError) so the reader stops, not leave it open.")
    _, how = results["aborted"]
    if how != "cancelled":
        raise _fail2("after `engine.abort('aborted')` its reader should get "
                     f"asyncio.CancelledError at once; instead its stream {how} (a step later, "
                     "through the engine's own final output): `abort_request` must finish the "
                     "stream itself, with the exception, and pop it from `_request_streams`.")
    in_use = f"{state['total'] - state['free']} of {state['total']} KV blocks in use"
    who = {"leaves": "the client that left", "aborted": "the request aborted by `engine.abort`"}
    missing = [who[rid] for rid in who if rid not in state["aborted"]]
    if missing:
        raise _fail2(f"the other requests are done, yet {' and '.join(missing)} never reached "
                     f"`LLMEngine.abort_request` ({in_use}): "
                     "`abort_request` must add the id to "
                     "`self._aborted_requests`, which the loop hands to the engine before the "
                     "next step.")
    _check_aborted_while_queued(results["queued"], "queued" in stuck, log, state)
    if state["unfinished"] or state["free"] != state["total"]:
        raise _fail2(f"every client is done, yet the engine still runs a request ({in_use}).")
    _check_output_after_abort(tracker_cls, log["req-0"][0])
    _check_through_the_server(tracker_cls)
    if state["streams"]:
        raise _fail2(f"when all is over the tracker still holds the streams of {state['streams']}: "
                     "a finished or aborted request's stream must leave `_request_streams` (pop "
                     "it), or the id can never be used again and the dict grows for ever.")
    if state["queued"]:
        raise _fail2(f"when all is over the tracker still queues {state['queued']} in "
                     "`_new_requests`: an aborted request must leave the queue.")
    passed(DAY, 2)


_QUEUED_CASE = (" A request still in `self._new_requests` (request id -> (stream, add_request "
                "kwargs)) is not in the engine: there is nothing there to abort, and the loop "
                "would only hold it back one step, then add it. So `abort_request` must first "
                "look there: pop it, finish its stream with the exception (else "
                "asyncio.CancelledError), and return.")


def _check_aborted_while_queued(result, stuck: bool, log, state) -> None:
    """The client whose request was aborted before any step took it."""
    outs = log.get("queued", [])
    how = result[1] if result else None
    what = ("a client's request was aborted while still queued (`generate` had queued it; no "
            "step had taken it yet)")
    if "queued" in state["added"]:
        reader = ("its reader did get asyncio.CancelledError, but the request stayed in "
                  "`self._new_requests`" if how == "cancelled" else
                  f"its reader, instead of asyncio.CancelledError at once, got {len(outs)} "
                  f"output(s) and its stream {'never ended' if stuck else how}")
        raise _fail2(f"{what}, yet the loop handed it to `LLMEngine.add_request` a step later "
                     "and it ran, holding KV blocks and a seat in every batch, for a client "
                     f"that had gone; {reader}.{_QUEUED_CASE}")
    if stuck:
        raise _fail2(f"{what}: it never reached the engine, good, but its reader waited "
                     f"{STALL_S:.0f} s for news: the stream of a request you take out of "
                     f"`self._new_requests` must be finished too.{_QUEUED_CASE}")
    if how != "cancelled":
        raise _fail2(f"{what}: its stream ended without asyncio.CancelledError, as if the answer "
                     f"were complete: finish it with the exception, as for a request in the "
                     f"engine.{_QUEUED_CASE}")


# -- exercise 3: reading /metrics ---------------------------------------------------


def _made_up_metrics() -> tuple[str, float]:
    """A /metrics text with a TTFT histogram of known mean, beside others."""
    registry = CollectorRegistry()
    labels = ["model_name"]
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=registry,
                     buckets=[0.1, 0.5, 1.0, 5.0])
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", labels, registry=registry,
                    buckets=[1.0, 5.0])
    tpot = Histogram("vllm:time_per_output_token_seconds", "tpot", labels, registry=registry,
                     buckets=[0.01, 0.1])
    for v in (0.05, 0.3, 0.4, 2.05):
        ttft.labels(MODEL).observe(v)
    for v in (3.0, 4.0, 9.0):
        e2e.labels(MODEL).observe(v)
    for v in (0.02, 0.03):
        tpot.labels(MODEL).observe(v)
    return generate_latest(registry).decode(), (0.05 + 0.3 + 0.4 + 2.05) / 4


def reference_mean_ttft(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        if family.name == "vllm:time_to_first_token_seconds":
            values = {s.name: s.value for s in family.samples}
            return values[family.name + "_sum"] / values[family.name + "_count"]
    raise KeyError("no TTFT histogram")


def exercise_3(mean_ttft, base_url: str) -> None:
    """`mean_ttft(metrics_text)` on a made-up histogram of known mean, then on
    the real server's /metrics after the notebook's load run."""
    where = (" Look at your `mean_ttft`: the histogram `vllm:time_to_first_token_seconds` has "
             "samples `..._sum` (seconds, all requests) and `..._count` (requests); its "
             "`..._bucket` samples are cumulative counts, not times.")
    text, want = _made_up_metrics()
    with learner_code("mean_ttft(made-up /metrics)", where):
        got = mean_ttft(text)
    if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
        hint = ""
        if isinstance(got, (int, float)):
            if abs(got - want * 4) < 1e-9:
                hint = " That is the _sum alone: divide by _count."
            elif abs(got - 16 / 3) < 1e-6:
                hint = " That is the end-to-end latency's mean, not the time to first token."
            elif abs(got - 0.025) < 1e-9:
                hint = " That is the time per output token's mean, not the time to first token."
        raise AssertionError(f"Day {DAY}, exercise 3: four requests with TTFTs 0.05, 0.3, 0.4 and "
                             f"2.05 s: expected a mean of {want:.4f} s, got {got!r}.{hint}{where}")
    real = httpx.get(base_url + "/metrics", timeout=30).text
    want = reference_mean_ttft(real)
    with learner_code("mean_ttft(the server's /metrics)", where):
        got = mean_ttft(real)
    if not isinstance(got, (int, float)) or abs(got - want) > 1e-9 * max(1.0, want):
        raise AssertionError(f"Day {DAY}, exercise 3: on the server's /metrics, expected "
                             f"{want:.6f} s, got {got!r}.{where}")
    passed(DAY, 3)
