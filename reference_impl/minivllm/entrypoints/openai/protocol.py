"""The OpenAI API's requests and responses, as pydantic models.

Field names and defaults are OpenAI's (and vLLM's extra sampling fields:
top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
...). Requests are checked in two layers, each naming the field it refuses:

- here, the JSON's shape: unknown fields, and values of the wrong type
  (strict: "5" is not an integer, 2.0 is not one either, true is not a
  count), as OpenAI refuses them;
- then `to_sampling_params`, where `SamplingParams` checks every value's
  range exactly as it does offline, so the server accepts what `LLM`
  accepts.

A sampling field sent as null takes its default, as in vLLM.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from minivllm.sampling_params import RequestOutputKind, SamplingParams


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    # OpenAI refuses fields it does not know, and so do we (vLLM 0.6 too).
    model_config = ConfigDict(extra="forbid", strict=True)


# -- errors -----------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body, {"error": {...}} (vLLM 0.6 sent the fields flat)."""

    error: ErrorInfo


# -- models -------------------------------------------------------------------


class ModelPermission(OpenAIBaseModel):
    """What a client may do with the model: the fields of OpenAI's old
    model object, which vLLM still sends (sampling and logprobs allowed,
    fine-tuning and the rest not)."""

    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    # With --enable-prompt-tokens-details: the prompt tokens found in the
    # prefix cache, when there were any (vLLM's rule; V1 reports them).
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens)
            if cached_tokens
            else None,
        )


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True  # vLLM's default, once stream_options is given


# -- the sampling fields both endpoints share -----------------------------------


class SamplingRequest(OpenAIBaseModel):
    """The fields both endpoints share: those that become `SamplingParams`
    (endpoint-specific ones in the subclasses; None means "the default",
    for every one of them), and `cache_salt`, which goes with the prompt."""

    model: str
    n: int | None = 1
    best_of: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: requests share cached prefix blocks only with requests of the
    # same salt, so one tenant cannot learn from timing whether another
    # sent a prompt. V1 only (the classic engine refuses it, as vLLM V0).
    cache_salt: str | None = None
    # vLLM's: the prompt tokens' logprobs (and this many top tokens at each
    # position) in the response's `prompt_logprobs`; not with stream.
    prompt_logprobs: int | None = None
    # OpenAI's: token id (as a string: JSON keys are) -> a bias added to its
    # logit, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, float] | None = None
    # vLLM's: only these tokens can be sampled.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output must not contain (SamplingParams.bad_words).
    bad_words: list[str] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # (vLLM refuses it only when it holds something: {} passes.)
        if self.stream_options is not None and self.stream_options.model_fields_set and not (
            self.stream
        ):
            raise ValueError("stream_options can only be given with stream=true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        # (vLLM refuses it only when it asks for something: 0 passes.)
        if self.stream and self.prompt_logprobs:
            raise ValueError("prompt_logprobs are not available with stream=true")
        return self

    @model_validator(mode="after")
    def _cache_salt_not_empty(self):
        if self.cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string if given")
        return self

    def engine_prompt(self, text: str, token_ids: list[int]) -> dict:
        """The prompt as the engine takes it, with the request's salt."""
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt

    def _sampling_kwargs(self) -> dict:
        names = (
            "n best_of temperature top_p top_k min_p presence_penalty frequency_penalty "
            "repetition_penalty seed stop stop_token_ids include_stop_str_in_output "
            "ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens "
            "prompt_logprobs allowed_token_ids bad_words"
        ).split()
        kwargs = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        if self.logit_bias is not None:
            kwargs["logit_bias"] = self._token_logit_bias()
        # vLLM's choice: a stream takes each step's news (DELTA), a plain
        # answer is built from the final output alone.
        kwargs["output_kind"] = (
            RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        )
        return kwargs

    def _token_logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers as strings), got {key!r}"
                ) from None
            if math.isnan(value):  # max(-100.0, nan) would make it a ban
                raise ValueError(f"logit_bias values must be numbers, got NaN for token {key!r}")
            bias[token_id] = min(100.0, max(-100.0, value))  # clipped, as vLLM does
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# -- /v1/completions -------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    # A string, strings, token ids, or lists of token ids (one prompt each).
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # The prompt in front of the answer; with logprobs, the prompt's too (the
    # first token's are null: nothing predicts it). With max_tokens=0, the
    # prompt alone: how a client scores a text (lm-evaluation-harness does).
    echo: bool | None = False

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the answer is the prompt, nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        """Raises ValueError naming the field, as `SamplingParams` does (and
        for logprobs above the engine's `max_logprobs`). As vLLM, echo_only
        runs one token (the engine must sample one), which is not returned,
        though usage counts it."""
        kwargs = self._sampling_kwargs()
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo:  # the echoed prompt's logprobs (unless asked for apart)
                kwargs.setdefault("prompt_logprobs", self.logprobs)
        max_tokens = 1 if self.echo_only else self.max_tokens
        params = SamplingParams(max_tokens=max_tokens, **kwargs)
        params.check_max_logprobs(max_logprobs)
        return params


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One candidate at a prompt position, as vLLM sends its `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first (nothing predicts it), then token id ->
# its logprob, for the prompt's token and the top ones (JSON keys are strings).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # Not OpenAI's: the stop string or token id that ended it (vLLM's).
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionResponseStreamChoice):
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions ------------------------------------------------------------


class ChatContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: its parts one per line, as vLLM's chat_utils
        joins them before the chat template sees them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    # vLLM v0.6's chat default (its completions keep OpenAI's 1.0).
    temperature: float | None = 0.7
    # max_completion_tokens is OpenAI's newer name for max_tokens. Neither:
    # up to the model's context length.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # vLLM's: the answer starts with the last message's content when that
    # message has the answer's role (a reply that continues it).
    echo: bool | None = False
    add_generation_prompt: bool = True
    # The chat template adds BOS itself (vLLM's default too).
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def to_sampling_params(self, max_logprobs: int) -> SamplingParams:
        kwargs = self._sampling_kwargs()
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        try:
            params = SamplingParams(max_tokens=max_tokens, **kwargs)
            params.check_max_logprobs(max_logprobs)
            return params
        except ValueError as e:  # named by SamplingParams; say it the request's way
            raise type(e)(self._request_names(str(e))) from e

    def _request_names(self, message: str) -> str:
        """SamplingParams' field name at the start of `message`, as this
        request spelled it (max_completion_tokens, top_logprobs)."""
        renames = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        first, _, rest = message.partition(" ")
        return f"{renames.get(first, first)} {rest}"


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, with prompt_logprobs


class DeltaMessage(OpenAIBaseModel):
    """What a chunk adds: the role in the first, then content (an absent
    field is left out, as OpenAI sends it, not sent as null)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    """A chunk's choice. `stop_reason` comes with the last chunk only (null
    there when no stop string or token ended it): vLLM sends chat chunks
    with `exclude_unset` and sets it only when the choice finishes."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @model_serializer(mode="wrap")
    def _stop_reason_when_finished(self, handler):
        fields = handler(self)
        if self.finish_reason is None:
            fields.pop("stop_reason", None)
        return fields


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- /tokenize, /detokenize ---------------------------------------------------------


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
