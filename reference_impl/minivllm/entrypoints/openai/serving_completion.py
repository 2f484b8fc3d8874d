"""POST /v1/completions (vLLM's `OpenAIServingCompletion`).

Each prompt of the request is one engine request (`<id>-<i>`), all run
concurrently and merged; choice `index` is prompt * n + the output's index,
as OpenAI numbers them. The first output is awaited before anything is
answered, so a request the engine refuses is a plain 400, and a stream
starts only when the prefill is done. Then, with `stream`, every step's
new tokens go out as one server-sent event per choice (`data: {json}\n\n`);
without, the final outputs become one JSON body.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_uuid,
)
from minivllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceProgress,
    ClientDisconnected,
    OpenAIError,
    OpenAIServing,
    json_logprob,
    json_prompt_logprobs,
    logprob_token,
    merge_async_iterators,
    sampling_params_of,
    sse,
    sse_usage,
    until_disconnected,
    with_first,
)
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sequence import PositionLogprobs


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        params = sampling_params_of(request, self.max_logprobs)
        prompts = self._tokenize_prompts(request.prompt, params.max_tokens)
        await self.check_engine()  # a stopped engine: 503, before any stream
        request_id = f"cmpl-{random_uuid()}"
        created = int(time.time())
        merged = merge_async_iterators(
            *(
                self.engine.generate(
                    request.engine_prompt(text, ids), params, f"{request_id}-{i}"
                )
                for i, (text, ids) in enumerate(prompts)
            )
        )
        results = until_disconnected(merged, raw_request)
        try:
            first = await self.first_output(results, request, lambda item: item[1])
        except ClientDisconnected:
            return Response(status_code=499)
        if request.stream:
            stream = self._stream(request, first, results, request_id, created, prompts)
            return StreamingResponse(stream, media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        try:
            async for prompt_index, output in with_first(first, results):
                finals[prompt_index] = output
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            raise self.engine_error(e, request) from e
        return JSONResponse(self._full_response(request, finals, request_id, created, prompts))

    def _tokenize_prompts(self, prompt, max_tokens: int | None) -> list[tuple[str, list[int]]]:
        """(text, token ids) of each prompt, checked: a string is encoded as
        the engine encodes it (BOS first); token ids are decoded, for echo."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be an empty list", param="prompt")
        prompts = []
        for p in prompt:
            ids = self.encode(p, "prompt") if isinstance(p, str) else p
            self.check_prompt_tokens(ids, max_tokens)
            prompts.append((p if isinstance(p, str) else self.tokenizer.decode(ids), ids))
        return prompts

    def _full_response(self, request, finals, request_id, created, prompts) -> dict:
        choices = []
        num_generated = 0
        for prompt_index, output in sorted(finals.items()):
            for completion in output.outputs:
                text, token_ids, positions = self._answer(
                    request, prompts[prompt_index][0], output, completion, 0, completion.text
                )
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(token_ids, positions, 0, request.logprobs)
                choices.append(
                    CompletionResponseChoice(
                        index=prompt_index * (request.n or 1) + completion.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=json_prompt_logprobs(output.prompt_logprobs),
                    )
                )
                num_generated += len(completion.token_ids)
        num_prompt = sum(len(ids) for _, ids in prompts)
        last = finals[len(prompts) - 1]  # vLLM reports the last prompt's cached tokens
        usage = UsageInfo.of(num_prompt, num_generated, self.cached_tokens(last))
        response = CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )
        return response.model_dump()

    async def _stream(
        self,
        request: CompletionRequest,
        first: tuple[int, RequestOutput],
        results: AsyncGenerator[tuple[int, RequestOutput], None],
        request_id: str,
        created: int,
        prompts: list[tuple[str, list[int]]],
    ) -> AsyncGenerator[str, None]:
        n = request.n or 1
        progress: dict[int, ChoiceProgress] = {}
        last = first[1]
        try:
            async for prompt_index, output in with_first(first, results):
                last = output
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    state = progress.setdefault(index, ChoiceProgress())
                    completion = state.add(completion)
                    delta = state.advance(completion)
                    if delta is None:
                        continue
                    text, token_ids, positions = self._answer(
                        request, prompts[prompt_index][0], output, completion,
                        delta.first_token, delta.text,
                    )
                    logprobs = None
                    if request.logprobs is not None:
                        # Offsets count the echoed prompt's text too.
                        echoed = len(prompts[prompt_index][0]) if request.echo else 0
                        offset = delta.first_char + echoed if delta.first_token else 0
                        logprobs = self._logprobs(token_ids, positions, offset, request.logprobs)
                    choice = CompletionResponseStreamChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    chunk = CompletionStreamResponse(
                        id=request_id, created=created, model=self.model_name, choices=[choice]
                    )
                    yield sse(chunk, null_usage=True)
            if request.include_usage:
                num_prompt = sum(len(ids) for _, ids in prompts)
                num_generated = sum(state.num_tokens for state in progress.values())
                # The last output's cached tokens, as vLLM reports them.
                usage = UsageInfo.of(num_prompt, num_generated, self.cached_tokens(last))
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[], usage=usage
                )
                yield sse_usage(chunk)
        except ClientDisconnected:  # no one to tell: the request is aborted
            return
        except Exception as e:  # the engine failed mid-stream: tell the client
            yield self.sse_error(e, request)
        yield SSE_DONE

    @staticmethod
    def _answer(
        request: CompletionRequest, prompt_text: str, output: RequestOutput,
        completion: CompletionOutput, first_token: int, text: str,
    ) -> tuple[str, list[int], list[PositionLogprobs | None]]:
        """(text, token ids, their logprobs) a choice answers, given its new
        `text` and its tokens from `first_token` on, as vLLM builds them: with
        echo the prompt comes first, its logprobs too (prompt_logprobs); with
        max_tokens=0 the prompt alone."""
        token_ids = completion.token_ids[first_token:]
        positions = (completion.logprobs or [])[first_token:]
        prompt_positions = output.prompt_logprobs or []
        if request.echo_only:
            if first_token:
                return "", [], []
            return prompt_text, output.prompt_token_ids, prompt_positions
        if request.echo and first_token == 0:
            return (prompt_text + text, output.prompt_token_ids + token_ids,
                    prompt_positions + positions)
        return text, token_ids, positions

    def _logprobs(
        self,
        token_ids: list[int],
        positions: list[PositionLogprobs | None],
        text_offset: int,
        num_top: int,
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs of `token_ids`; a position without any
        (a prompt's first token) is null, as in vLLM. Each position lists at
        most `num_top` + 1 tokens, the request's `logprobs` and the chosen
        one, as vLLM's `_create_completion_logprobs` does: an echoed prompt
        scored with a larger `prompt_logprobs` shows that many in the
        response's `prompt_logprobs` only."""
        result = CompletionLogProbs()
        for token_id, position in zip(token_ids, positions, strict=True):
            if position is None:
                token = self.tokenizer.decode([token_id])
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                token = logprob_token(self.tokenizer, token_id, position)
                result.token_logprobs.append(json_logprob(position[token_id].logprob))
                result.top_logprobs.append(_top_logprobs(self.tokenizer, position, num_top + 1))
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result


def _top_logprobs(tokenizer, position: PositionLogprobs, limit: int) -> dict[str, float]:
    """The first `limit` entries of a position: the chosen token, then the
    most likely ones (the sampler's order)."""
    return {logprob_token(tokenizer, t, position): json_logprob(lp.logprob)
            for t, lp in itertools.islice(position.items(), limit)}
