"""POST /v1/chat/completions (vLLM's `OpenAIServingChat`).

The messages become one prompt through the model's chat template
(`tokenizer.apply_chat_template`, or the server's --chat-template), encoded
without adding BOS again (the template writes it), then run as one engine
request with n choices. Streamed, the answer is OpenAI's sequence of
`chat.completion.chunk` events: first, once the prefill is done, one chunk
per choice with the role; then one per new token with the content delta,
the last of them carrying finish_reason; then the usage chunk if asked for
(stream_options.include_usage); then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_uuid,
)
from minivllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceProgress,
    ClientDisconnected,
    OpenAIServing,
    json_logprob,
    json_prompt_logprobs,
    logprob_token,
    sampling_params_of,
    sse,
    sse_usage,
    until_disconnected,
    with_first,
)
from minivllm.outputs import CompletionOutput, RequestOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        self.check_model(request.model)
        params = sampling_params_of(request, self.max_logprobs)
        prompt = self.apply_chat_template(request.messages, request.add_generation_prompt)
        prompt_ids = self.encode(
            prompt, "messages", add_special_tokens=request.add_special_tokens
        )
        max_tokens_field = (
            "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        )
        self.check_prompt_tokens(prompt_ids, params.max_tokens, max_tokens_field)
        await self.check_engine()  # a stopped engine: 503, before any stream
        request_id = f"chatcmpl-{random_uuid()}"
        created = int(time.time())
        results = until_disconnected(
            self.engine.generate(request.engine_prompt(prompt, prompt_ids), params, request_id),
            raw_request,
        )
        try:
            first = await self.first_output(results, request)
        except ClientDisconnected:
            return Response(status_code=499)
        if request.stream:
            stream = self._stream(request, first, results, request_id, created)
            return StreamingResponse(stream, media_type="text/event-stream")
        final = first
        try:
            async for output in with_first(first, results):
                final = output
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            raise self.engine_error(e, request) from e
        return JSONResponse(self._full_response(request, final, request_id, created))

    def get_chat_request_role(self, request: ChatCompletionRequest) -> str:
        """The answer's role (vLLM's method): --response-role after a
        generation prompt; without one the model continues the last message,
        so the answer has that message's role."""
        if request.add_generation_prompt:
            return self.served.response_role
        return request.messages[-1].role

    def _echoed(self, request: ChatCompletionRequest) -> str:
        """With echo, the last message's content if it has the answer's role."""
        last = request.messages[-1]
        same_role = last.role == self.get_chat_request_role(request)
        return last.text() if request.echo and same_role else ""

    def _full_response(
        self, request: ChatCompletionRequest, final: RequestOutput, request_id: str, created: int
    ) -> dict:
        echoed = self._echoed(request)
        choices = [
            ChatCompletionResponseChoice(
                index=completion.index,
                message=ChatMessage(
                    role=self.get_chat_request_role(request), content=echoed + completion.text
                ),
                logprobs=self._logprobs(request, completion, 0, len(completion.token_ids)),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in final.outputs
        ]
        num_generated = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo.of(
            len(final.prompt_token_ids), num_generated, self.cached_tokens(final)
        )
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=json_prompt_logprobs(final.prompt_logprobs),
        )
        return response.model_dump()

    async def _stream(
        self,
        request: ChatCompletionRequest,
        first: RequestOutput,
        results: AsyncGenerator[RequestOutput, None],
        request_id: str,
        created: int,
    ) -> AsyncGenerator[str, None]:
        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
            )

        n = request.n or 1
        progress = [ChoiceProgress() for _ in range(n)]
        try:
            echoed = self._echoed(request)
            # Every choice's role, then every choice's echo (vLLM's order).
            for index in range(n):
                role = DeltaMessage(role=self.get_chat_request_role(request), content="")
                yield chunk(ChatCompletionResponseStreamChoice(index=index, delta=role))
            for index in range(n if echoed else 0):
                echo = DeltaMessage(content=echoed)
                yield chunk(ChatCompletionResponseStreamChoice(index=index, delta=echo))
            async for output in with_first(first, results):
                for completion in output.outputs:
                    state = progress[completion.index]
                    completion = state.add(completion)
                    delta = state.advance(completion)
                    if delta is None:
                        continue
                    choice = ChatCompletionResponseStreamChoice(
                        index=completion.index,
                        delta=DeltaMessage(content=delta.text),
                        logprobs=self._logprobs(
                            request, completion, delta.first_token, state.num_tokens
                        ),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    yield chunk(choice)
            if request.include_usage:
                num_generated = sum(s.num_tokens for s in progress)
                usage = UsageInfo.of(
                    len(first.prompt_token_ids), num_generated, self.cached_tokens(first)
                )
                yield sse_usage(
                    ChatCompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.model_name,
                        choices=[],
                        usage=usage,
                    )
                )
        except ClientDisconnected:  # no one to tell: the request is aborted
            return
        except Exception as e:  # the engine failed mid-stream: tell the client
            yield self.sse_error(e, request)
        yield SSE_DONE

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput, start: int, end: int
    ) -> ChatCompletionLogProbs | None:
        """OpenAI's chat logprobs of tokens [start, end): each token's, and
        the top_logprobs most likely at its position."""
        if not request.logprobs:
            return None
        content = []
        for token_id, position in zip(
            completion.token_ids[start:end], completion.logprobs[start:end], strict=True
        ):
            ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
            top = [
                _chat_logprob(logprob_token(self.tokenizer, t, position), lp.logprob)
                for t, lp in ranked[: request.top_logprobs or 0]
            ]
            token = logprob_token(self.tokenizer, token_id, position)
            content.append(
                ChatCompletionLogProbsContent(
                    **_chat_logprob(token, position[token_id].logprob).model_dump(),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)


def _chat_logprob(token: str, logprob: float) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(token=token, logprob=json_logprob(logprob),
                                 bytes=list(token.encode()))


