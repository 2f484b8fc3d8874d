"""What every OpenAI endpoint shares (vLLM's `OpenAIServing`): the served
model names, the error responses, the model check, the prompt's length
check, the chat template, and the pieces of a streamed answer.

The engine is an `EngineClient` (engine/protocol.py): the classic
`AsyncLLMEngine` or V1's `AsyncLLM`, the same code serving from either.

Errors are raised as `OpenAIError` anywhere in a handler and turned into
OpenAI's JSON body ({"error": {"message", "type", "param", "code"}}) by the
app's exception handler (api_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request
from jinja2 import TemplateError
from pydantic import BaseModel

from minivllm.engine.async_llm_engine import AsyncEngineDeadError
from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.openai.protocol import (
    ChatMessageParam,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
)
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs
from minivllm.utils import check_text

T = TypeVar("T")


class OpenAIError(Exception):
    """A request refused (or failed) with an HTTP status and OpenAI's error
    fields; `param` names the offending field when there is one."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message, type=error_type(self.status), param=self.param, code=self.code
            )
        )


def error_type(status: HTTPStatus) -> str:
    """OpenAI's error `type` for a status."""
    if status == HTTPStatus.UNAUTHORIZED:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def param_named_in(message: str, fields) -> str | None:
    """The request field a validation message starts with ("top_p must be
    in (0, 1], got 2" -> "top_p"; "best_of=3 is ..." -> "best_of";
    "bad_words[1] must ..." -> "bad_words"), if it is one of `fields`."""
    words = message.split()
    first = words[0].rstrip(":,").split("=")[0].split("[")[0] if words else ""
    return first if first in fields else None


@dataclass
class ServedModel:
    """The engine, the names it answers to, and the chat template to use."""

    engine: EngineClient
    served_model_names: list[str]
    root: str
    chat_template: str | None = None
    response_role: str = "assistant"
    enable_prompt_tokens_details: bool = False


class OpenAIServing:
    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.engine = served.engine
        self.tokenizer = served.engine.get_tokenizer()
        model_config = served.engine.get_model_config()
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = model_config.max_logprobs

    @property
    def model_name(self) -> str:
        return self.served.served_model_names[0]

    def cached_tokens(self, output: RequestOutput) -> int | None:
        """The prompt tokens the prefix cache gave `output`'s request, for
        the usage's `prompt_tokens_details` (if the server reports them)."""
        return output.num_cached_tokens if self.served.enable_prompt_tokens_details else None

    def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.served.root, max_model_len=self.max_model_len)
                for name in self.served.served_model_names
            ]
        )

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve, as vLLM v0.6 and OpenAI
        answer (None, allowed by /tokenize and /detokenize: the served one)."""
        if model is not None and model not in self.served.served_model_names:
            raise OpenAIError(
                f"The model `{model}` does not exist. This server serves "
                f"{', '.join(map(repr, self.served.served_model_names))}.",
                HTTPStatus.NOT_FOUND,
                param="model",
                code="model_not_found",
            )

    async def check_engine(self) -> None:
        """A stopped engine refuses a new request at once with a 503, before
        any stream begins (vLLM's check at the top of each endpoint), on
        either engine: its `check_health` says why."""
        try:
            await self.engine.check_health()
        except Exception as e:
            raise OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE) from e

    def encode(self, text: str, param: str, **kwargs) -> list[int]:
        """`text`'s token ids; text that is not valid Unicode (JSON can carry
        a lone surrogate, "\\ud800", which no tokenizer takes) is a 400 naming
        the request's field, not an error inside the tokenizer."""
        try:
            check_text(param, text)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from None
        return self.tokenizer.encode(text, **kwargs)

    def check_prompt_tokens(
        self,
        prompt_token_ids: list[int],
        max_tokens: int | None,
        max_tokens_field: str = "max_tokens",
    ) -> None:
        """The prompt, with room for max_tokens, must fit the model's context
        (vLLM's check); every id must be in the vocabulary. `max_tokens_field`:
        the name the request gave max_tokens (chat's max_completion_tokens)."""
        num = len(prompt_token_ids)
        if num == 0:
            raise OpenAIError("The prompt is empty (0 tokens).", param="prompt")
        vocab = self.engine.get_model_config().hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                param="prompt",
            )
        if num + (max_tokens or 0) > self.max_model_len or num >= self.max_model_len:
            asked = f"{num} in the prompt" + (
                f" and {max_tokens} in the completion" if max_tokens else ""
            )
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num + (max_tokens or 0)} tokens ({asked}). Reduce the prompt "
                f"or {max_tokens_field}.",
                param=max_tokens_field if max_tokens and num < self.max_model_len else "prompt",
            )

    def apply_chat_template(
        self, messages: list[ChatMessageParam], add_generation_prompt: bool
    ) -> str:
        """The chat as prompt text, through the tokenizer's template (or the
        server's --chat-template)."""
        template = self.served.chat_template or self.tokenizer.chat_template
        if template is None:
            raise OpenAIError(
                "This model has no chat template, so /v1/chat/completions cannot build a "
                "prompt: use /v1/completions, or start the server with --chat-template FILE.",
                param="messages",
            )
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError as e:
            raise OpenAIError(
                f"The chat template refused the messages: {e}", param="messages"
            ) from e

    def engine_error(self, e: Exception, request: BaseModel) -> OpenAIError:
        """What the engine raised for a request, as the answer to send: a
        refusal when it was added (ValueError, the engine alive) a 400
        naming the field; a step that failed under it, or an engine that
        died under it, a 500; a dead engine for a new request a 503
        (`check_engine`, or the classic engine's AsyncEngineDeadError when
        it stopped just after that check)."""
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, ValueError) and not self.engine.errored:
            message = _REQUEST_PREFIX.sub("", str(e))
            return OpenAIError(message, param=param_named_in(message, type(request).model_fields))
        if isinstance(e, AsyncEngineDeadError):
            return OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
        return OpenAIError(f"{type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)

    async def first_output(
        self,
        results: AsyncGenerator[T, None],
        request: BaseModel,
        output_of: Callable[[T], RequestOutput] = lambda item: item,
    ) -> T:
        """The first output with a token (or the end), awaited before any
        answer is sent: the engine checks a request when it adds it, so a
        refusal can still be a 400, and a stream begins only once the
        prefill is done (a chunked prefill's partial steps have no token)."""
        try:
            while True:
                item = await anext(results)
                output = output_of(item)
                if output.finished or any(c.token_ids for c in output.outputs):
                    return item
        except ClientDisconnected:
            raise
        except Exception as e:
            await results.aclose()
            raise self.engine_error(e, request) from e

    def sse_error(self, e: Exception, request: BaseModel) -> str:
        """The event that ends a stream the engine failed in (vLLM's form)."""
        body = self.engine_error(e, request).to_response().model_dump()
        return f"data: {json.dumps(body)}\n\n"


# -- requests into the engine and outputs back ------------------------------------

# How the engine starts its refusals ("Request 'cmpl-...-0': the prompt ...").
_REQUEST_PREFIX = re.compile(r"^Request '[^']*': ")


def sampling_params_of(request: SamplingRequest, max_logprobs: int) -> SamplingParams:
    """The request's `SamplingParams`, within the engine's `max_logprobs`; a
    refused value is a 400 naming its field (as the request spelled it)."""
    if request.stream and request.best_of is not None and request.best_of > (request.n or 1):
        # The n best are only known at the end: nothing could be streamed.
        raise OpenAIError(
            f"best_of={request.best_of} > n={request.n or 1} cannot be streamed", param="best_of"
        )
    try:
        return request.to_sampling_params(max_logprobs)
    except ValueError as e:  # WrongTypeError is one too
        raise OpenAIError(str(e), param=param_named_in(str(e), type(request).model_fields)) from e


async def with_first(first: T, rest: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    yield first
    async for item in rest:
        yield item


@dataclass
class Delta:
    """One choice's news since its last chunk: text, and where it starts."""

    text: str
    first_token: int  # index of its first new token in the output
    first_char: int  # offset of its text in the output text


@dataclass
class ChoiceProgress:
    """One streamed choice: its output so far, gathered from the engine's
    DELTA outputs (a stream asks for them, as vLLM's does), and what of it
    has been sent."""

    num_chars: int = 0
    num_tokens: int = 0
    finished: bool = False
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None

    def add(self, delta: CompletionOutput) -> CompletionOutput:
        """The choice's whole output so far: `delta`'s text, tokens and
        logprobs appended to the ones before (each added once, where a
        cumulative output would copy them all at every step)."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        return replace(delta, text=self.text, token_ids=self.token_ids, logprobs=self.logprobs)

    def advance(self, completion: CompletionOutput) -> Delta | None:
        """The delta to send for the choice's latest output; None if it has
        no new token and has not just finished (a chunked prefill's step),
        or if its end was already sent."""
        if self.finished:
            return None
        finished = completion.finish_reason is not None
        if len(completion.token_ids) == self.num_tokens and not finished:
            return None
        delta = Delta(completion.text[self.num_chars :], self.num_tokens, self.num_chars)
        self.num_chars, self.num_tokens = len(completion.text), len(completion.token_ids)
        self.finished = finished
        return delta


def logprob_token(tokenizer, token_id: int, position: PositionLogprobs) -> str:
    """A token's text as the detokenizer decoded it in context."""
    decoded = position[token_id].decoded_token
    return decoded if decoded is not None else tokenizer.decode([token_id])


# The lowest logprob a response carries: JSON has no -inf, which the engine
# gives tokens that top_k, top_p or min_p removed. vLLM's servers clamp to
# the same value ("a JSON-serializable float that OpenAI uses").
MIN_JSON_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as a response carries it: at least MIN_JSON_LOGPROB."""
    return max(logprob, MIN_JSON_LOGPROB)


def json_prompt_logprobs(
    prompt_logprobs: list[PositionLogprobs | None] | None,
) -> PromptLogprobs | None:
    """An output's prompt logprobs as a response carries them (vLLM's
    `clamp_prompt_logprobs`: no -inf in JSON)."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            token_id: PromptLogprob(
                logprob=json_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def sse(chunk: BaseModel, null_usage: bool = False) -> str:
    """One server-sent event. `usage` appears only in chunks that have it,
    unless `null_usage`: vLLM's completions stream writes `"usage": null` in
    every other chunk (its chat stream leaves it out), as OpenAI's does."""
    exclude = {"usage"} if getattr(chunk, "usage", 0) is None and not null_usage else None
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_usage(chunk: BaseModel) -> str:
    """The stream's last chunk, its usage: vLLM's leaves out what is null
    there (`prompt_tokens_details` without cached tokens)."""
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client hung up before its answer was complete."""


# How often a handler waiting for the engine asks whether its client is still there.
DISCONNECT_CHECK_S = 1.0


async def until_disconnected(
    results: AsyncGenerator[T, None], raw_request: Request
) -> AsyncGenerator[T, None]:
    """`results` item by item, asking at most every DISCONNECT_CHECK_S
    whether the client is still there, also while it waits for the engine
    (vLLM's `iterate_with_cancellation`): a request still queued behind
    others is aborted when its client gives up, not when its turn comes.
    On a hang-up it raises ClientDisconnected; either way, whenever it stops
    early, the read in progress is cancelled and `results` closed, which
    aborts the request."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_CHECK_S
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(results))
            while True:
                await asyncio.wait({pending}, timeout=DISCONNECT_CHECK_S)
                if loop.time() >= next_check:
                    if await raw_request.is_disconnected():
                        raise ClientDisconnected
                    next_check = loop.time() + DISCONNECT_CHECK_S
                if pending.done():
                    break
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # the request's generator aborts it as it unwinds
            with contextlib.suppress(BaseException):
                await pending
        await results.aclose()


_DONE = object()


async def merge_async_iterators(
    *iterators: AsyncIterator[T],
) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the index
    of their iterator (vLLM's utility of the same name). Closing the merged
    generator cancels the ones still running, which aborts their requests."""
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:  # handed to the reader
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
