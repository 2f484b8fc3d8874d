"""POST /tokenize and /detokenize (vLLM's `OpenAIServingTokenization`):
the served model's tokenizer over HTTP, for a client that must count or
build tokens the way the server does."""

from __future__ import annotations

from minivllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from minivllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """A prompt's token ids, or a chat's as the chat endpoint builds them."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.apply_chat_template(request.messages, request.add_generation_prompt)
            field = "messages"
        else:
            text, field = request.prompt, "prompt"
        tokens = self.encode(text, field, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab = self.engine.get_model_config().hf_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
