"""`SamplingParams.output_kind`: what each `RequestOutput` holds (vLLM's
`RequestOutputKind`), in both engines.

The oracle is the same request run CUMULATIVE beside it, in the same engine
and the same steps: three copies of one request (same prompt, same seed)
step in lockstep, so at every step the DELTA copy's output must be exactly
what the CUMULATIVE copy's output gained since its previous one (text,
tokens and logprobs), and the FINAL_ONLY copy must say nothing until the
step the others finish, then say what the CUMULATIVE copy says. A stop
string cut from the middle of a first free run makes the text hold back its
last characters while the request runs, and end the run early.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm import LLM, SamplingParams
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import RequestOutputKind

PROMPT = "Hello, my name is"
KINDS = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA,
         "f": RequestOutputKind.FINAL_ONLY}


@pytest.fixture(scope="module", params=["classic", "v1"])
def llm(request, tiny_model_dir):
    return LLM(tiny_model_dir("llama"), block_size=8, use_v1=request.param == "v1")


def stop_string(llm: LLM) -> str:
    """Four characters from the middle of a free greedy run's text."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    text = out[0].outputs[0].text
    middle = len(text) // 2
    assert len(text) > 20, text
    return text[middle : middle + 4]


def run_lockstep(llm: LLM, prompt: str = PROMPT, **params) -> list[dict[str, list[RequestOutput]]]:
    """Each step's outputs of the three copies, by copy ("c", "d", "f"). (V1
    makes one output per child of an n > 1 request that moved.)"""
    engine = llm.llm_engine
    for rid, kind in KINDS.items():
        engine.add_request(rid, prompt, SamplingParams(output_kind=kind, **params))
    steps = []
    while engine.has_unfinished_requests():
        step: dict[str, list[RequestOutput]] = {}
        for output in engine.step():
            step.setdefault(output.request_id, []).append(output)
        steps.append(step)
    return steps


def merged(outputs: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """A stream's completions by index, its deltas added up by hand."""
    whole: dict[int, CompletionOutput] = {}
    for output in outputs:
        for c in output.outputs:
            if c.index not in whole:
                whole[c.index] = CompletionOutput(c.index, "", [], None, None if c.logprobs is None
                                                  else [])
            w = whole[c.index]
            w.text += c.text
            w.token_ids = w.token_ids + c.token_ids
            if c.logprobs is not None:
                w.logprobs = w.logprobs + c.logprobs
            w.cumulative_logprob, w.finish_reason = c.cumulative_logprob, c.finish_reason
            w.stop_reason = c.stop_reason
    return whole


def check_lockstep(steps: list[dict[str, list[RequestOutput]]]) -> None:
    previous: dict[int, CompletionOutput] = {}
    for step in steps:
        assert ("c" in step) == ("d" in step), "DELTA outputs come when CUMULATIVE ones do"
        if "c" not in step:
            assert "f" not in step
            continue
        cumulative = step["c"][-1]  # the newest holds every completion so far
        delta = merged(step["d"])  # the step's deltas, added up
        assert step["d"][-1].finished == cumulative.finished
        assert ("f" in step) == cumulative.finished, "FINAL_ONLY: only the last output"
        for c in cumulative.outputs:
            d = delta[c.index]
            before = previous.get(c.index, CompletionOutput(c.index, "", [], None, []))
            assert c.text.startswith(before.text) and d.text == c.text[len(before.text):]
            assert d.token_ids == c.token_ids[len(before.token_ids):]
            if c.logprobs is not None:
                assert d.logprobs == c.logprobs[len(before.token_ids):]
            assert (d.finish_reason, d.stop_reason) == (c.finish_reason, c.stop_reason)
            previous[c.index] = c
    last = steps[-1]
    assert last["f"] == last["f"][-1:], "one final output"
    assert last["f"][-1].outputs == last["c"][-1].outputs
    assert last["f"][-1].prompt_logprobs == last["c"][-1].prompt_logprobs
    whole = merged([o for s in steps for o in s.get("d", [])])
    assert [whole[c.index] for c in last["c"][-1].outputs] == last["c"][-1].outputs


def test_greedy_with_a_stop_string_and_logprobs(llm):
    stop = stop_string(llm)
    steps = run_lockstep(llm, temperature=0, max_tokens=30, stop=[stop], logprobs=2,
                         prompt_logprobs=1)
    final = steps[-1]["c"][-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    decode = llm.get_tokenizer().decode
    running = [o.outputs[0] for s in steps[:-1] for o in s.get("c", [])]
    assert any(len(c.text) < len(decode(c.token_ids)) for c in running), "no text held back"
    check_lockstep(steps)
    delta_prompts = [o.prompt_logprobs for s in steps for o in s.get("d", [])]
    assert sum(p is not None for p in delta_prompts) == 1, "DELTA: prompt logprobs once"


def test_two_seeded_samples_and_a_length_limit(llm):
    steps = run_lockstep(llm, n=2, temperature=0.9, seed=7, max_tokens=12, logprobs=1,
                         ignore_eos=True)
    final = steps[-1]["c"][-1]
    assert [c.finish_reason for c in final.outputs] == ["length", "length"]
    assert final.outputs[0].token_ids != final.outputs[1].token_ids
    check_lockstep(steps)


def test_children_that_finish_apart(llm):
    """n=2, one child stopped by a stop string steps before the other: the
    finished one's deltas stay empty (no logprobs sent twice), and the
    parent's last DELTA output holds both children with their reasons. In
    the classic engine only the first outputs carry the prompt."""
    steps = run_lockstep(llm, "Once upon a time", n=2, temperature=1, seed=5, stop=["e"],
                         logprobs=1, max_tokens=30)
    reasons = [[c.finish_reason for c in s["c"][-1].outputs] for s in steps if "c" in s]
    assert any(r.count(None) == 1 for r in reasons), f"the children finished together: {reasons}"
    check_lockstep(steps)
    last_delta = steps[-1]["d"][-1]
    assert sorted(c.index for c in last_delta.outputs) == [0, 1]
    assert None not in [c.finish_reason for c in last_delta.outputs]
    if not llm.llm_engine.__class__.__module__.startswith("minivllm.v1"):
        deltas = [o for s in steps for o in s.get("d", [])]
        with_prompt = [o.prompt_token_ids is not None for o in deltas]
        assert with_prompt[0] and not any(with_prompt[1:]), with_prompt


@pytest.mark.parametrize("setting", ["recompute", "swap", "chunked"])
def test_each_kind_alone_under_preemption_and_chunked_prefill(tiny_model_dir, setting):
    """The same workload in three engines, one output kind each, in a cache
    so small that requests are preempted (or with prompts prefilled in
    chunks of 8 tokens): every request's deltas add up to its cumulative
    output, and its one FINAL_ONLY output is that output."""
    use_v1 = setting == "chunked"  # V1 chunks by default; it preempts by recompute
    options = dict(block_size=8, max_model_len=96, use_v1=use_v1)
    if setting == "chunked":
        options.update(max_num_batched_tokens=16, max_num_seqs=2)
    else:
        options.update(num_gpu_blocks_override=10, preemption_mode=setting, swap_space=0.1)
    prompts = [{"prompt_token_ids": [(11 * i + 7 * j) % 300 + 2 for j in range(n)]}
               for i, n in enumerate([20, 9, 30, 14])]
    finals, preempted = {}, []
    for rid, kind in KINDS.items():
        engine = LLM(tiny_model_dir("llama"), **options).llm_engine
        if not use_v1:
            schedule = engine.scheduler.schedule

            def watched(schedule=schedule):
                metadata, outputs = schedule()
                preempted.extend(outputs.preempted)
                return metadata, outputs

            engine.scheduler.schedule = watched
        for i, prompt in enumerate(prompts):
            # (v0.6 preempts a group of several sequences by swapping only)
            params = SamplingParams(n=1 + i % 2, temperature=1, seed=i, max_tokens=24,
                                    ignore_eos=True, logprobs=1, output_kind=kind)
            engine.add_request(str(i), prompt, params)
        outputs: dict[str, list[RequestOutput]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
        finals[rid] = outputs
    if not use_v1:
        modes = {mode.value for _, mode in preempted}
        assert setting in modes, f"the cache should be tight enough to preempt: {modes}"
    for i in map(str, range(len(prompts))):
        cumulative = finals["c"][i][-1].outputs
        whole = merged(finals["d"][i])
        assert [whole[c.index] for c in cumulative] == cumulative
        assert len(finals["f"][i]) == 1 and finals["f"][i][0].outputs == cumulative


def test_generate_asks_for_final_outputs_only(llm):
    """`LLM.generate` builds no output before a request finishes (each step
    returns the finished ones only), leaves the caller's parameters as they
    were, and returns what a CUMULATIVE request ends with."""
    params = SamplingParams(temperature=0, max_tokens=8)
    seen: list[list[RequestOutput]] = []
    step = llm.llm_engine.step

    def watched_step():
        outputs = step()
        seen.append(outputs)
        return outputs

    llm.llm_engine.step = watched_step
    try:
        got = llm.generate([PROMPT, "Once upon"], params, use_tqdm=False)
    finally:
        del llm.llm_engine.step
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert all(o.finished for outputs in seen for o in outputs)
    assert sum(len(outputs) for outputs in seen) == 2
    engine = llm.llm_engine
    engine.add_request("x", PROMPT, params)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == "x"), last)
    assert got[0].outputs == last.outputs


def test_delta_needs_best_of_equal_to_n():
    with pytest.raises(ValueError, match="best_of must equal n to use output_kind=DELTA"):
        SamplingParams(n=1, best_of=2, temperature=1, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="DELTA")


def test_a_slow_readers_deltas_are_added_up():
    """RequestOutput.add, as V1's collector merges unread DELTA outputs."""
    first = RequestOutput("r", "p", [1], [None], [CompletionOutput(0, "ab", [5, 6], -1.0, None)],
                          False)
    held = first.outputs[0]
    first.add(RequestOutput("r", "p", [1], None, [CompletionOutput(0, "c", [7], -2.0, None),
                                                   CompletionOutput(1, "x", [9], -0.5, None)],
                            True), aggregate=True)
    assert first.finished
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob) for c in first.outputs] == [
        (0, "abc", [5, 6, 7], -2.0), (1, "x", [9], -0.5)]
    assert held.text == "ab", "the older completion object is left as it was"
    assert first.prompt_logprobs == [None], "a later delta without them keeps them"
    first.add(RequestOutput("r", "p", [1], None, [CompletionOutput(0, "z", [1], -3.0, None)],
                            True), aggregate=False)
    assert first.outputs[0].text == "z"


@pytest.mark.parametrize("engine_kind", ["classic", "v1"])
def test_streams_of_each_kind_through_the_async_engines(tiny_model_dir, loop, engine_kind):
    """A DELTA stream read slowly (V1's collector then adds up the deltas the
    reader has not taken) adds up to the CUMULATIVE stream's last output;
    a FINAL_ONLY stream is that one output."""
    from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from minivllm.engine.async_llm_engine import AsyncLLMEngine
    from minivllm.v1.engine.async_llm import AsyncLLM

    model = tiny_model_dir("llama")
    if engine_kind == "v1":
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model, use_v1=True, block_size=8))
    else:
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, block_size=8))

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=20, ignore_eos=True,
                              logprobs=1, prompt_logprobs=1, output_kind=kind)

    async def run():
        streams = {}
        for rid, kind in KINDS.items():
            streams[rid] = []
            async for output in engine.generate(PROMPT, params(kind), rid):
                streams[rid].append(output)
                if kind == RequestOutputKind.DELTA:
                    await asyncio.sleep(0.01)
        return streams

    try:
        streams = loop.run_until_complete(run())
    finally:
        engine.shutdown()
    final = streams["c"][-1]
    assert final.finished and len(final.outputs) == 2 and final.prompt_logprobs
    whole = merged(streams["d"])
    assert [whole[c.index] for c in final.outputs] == final.outputs
    sent = [o.prompt_logprobs for o in streams["d"] if o.prompt_logprobs is not None]
    assert sent and sent[0] == final.prompt_logprobs, "the prompt logprobs reach a DELTA reader"
    assert len(streams["f"]) == 1 and streams["f"][0].outputs == final.outputs


@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_token_latencies_do_not_depend_on_the_output_kind(tiny_model_dir, use_v1):
    """The engines time tokens as they add them (Stats' TTFT and TPOT lists,
    which the server's Prometheus logger observes), not from the outputs:
    one TTFT and max_tokens - 1 TPOTs per request, whichever kind it asked
    for, though FINAL_ONLY has one output and DELTA's hold one token each."""
    llm = LLM(tiny_model_dir("llama"), block_size=8, use_v1=use_v1, disable_log_stats=False)
    engine = llm.llm_engine
    for rid, kind in KINDS.items():
        engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=7,
                                                       ignore_eos=True, output_kind=kind))
    ttfts, tpots = [], []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stat_loggers.last_stats if use_v1 else engine.get_stats()
        ttfts += stats.time_to_first_tokens_iter
        tpots += stats.time_per_output_tokens_iter
    assert len(ttfts) == 3 and len(tpots) == 3 * 6
    assert all(t >= 0 for t in ttfts + tpots)


def test_the_server_asks_for_deltas_when_it_streams():
    """As vLLM's server: a stream takes DELTA outputs (ChoiceProgress adds
    them up), a plain answer the final output only."""
    from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for stream, kind in ((True, RequestOutputKind.DELTA), (False, RequestOutputKind.FINAL_ONLY)):
        completion = CompletionRequest(model="m", prompt="x", stream=stream)
        chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                     stream=stream)
        assert completion.to_sampling_params(20).output_kind == kind
        assert chat.to_sampling_params(20).output_kind == kind


def test_v1_abort_under_delta_sends_the_held_back_text_and_nothing_twice(tiny_model_dir):
    """AsyncLLM's last output for an aborted DELTA request (the front end
    alone makes it): the text the stop-string hold-back kept, no token, and
    no logprob sent again (vLLM's [-num_new:] slice would send them all)."""
    from minivllm.sequence import Logprob
    from minivllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from minivllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    tokenizer = LLM(tiny_model_dir("llama"), use_v1=True).get_tokenizer()
    params = SamplingParams(logprobs=1, stop=["zzzz"], output_kind=RequestOutputKind.DELTA)
    prompt_ids = tokenizer.encode(PROMPT)
    request = EngineCoreRequest("a", prompt_ids, params, None, 0.0, external_req_id="a")
    processor = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(params.output_kind, "a")
    processor.add_request(request, PROMPT, queue=queue)
    tokens = tokenizer.encode(" once upon a time", add_special_tokens=False)[:4]
    logprobs = [{t: Logprob(-1.0)} for t in tokens]
    processor.process_outputs([EngineCoreOutput("a", tokens, logprobs)])
    running = queue.get_nowait().outputs[0]
    assert running.token_ids == tokens and len(running.logprobs) == 4
    processor.abort_requests(["a"])
    final = queue.get_nowait().outputs[0]
    assert final.finish_reason == "abort" and final.token_ids == [] and final.logprobs == []
    assert running.text + final.text == tokenizer.decode(tokens)
    assert final.text, "the hold-back kept the last characters until the end"
