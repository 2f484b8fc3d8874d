"""V1's sampler: one token per row (vLLM's `vllm/v1/sample/sampler.py`).

The stages are the classic sampler's functions (model_executor/layers/
sampler.py), in V1's order, which differs in one place:

1. the logits processors that can change any row's argmax, greedy rows
   included: allowed_token_ids, bad_words, min_tokens (the stop tokens
   banned), logit_bias, then the penalties;
2. greedy rows take the argmax of that;
3. random rows: temperature, then min-p (an "argmax-invariant" logits
   processor in vLLM: it never drops the most likely token), then top-k and
   top-p, then a draw by the exponential race.

The classic chain runs min-p last, after top-k/top-p (vLLM v0 and Hugging
Face's order); with top-p and min-p both on, the two orders can keep
different tokens (Day 9, section 4).

Logprobs are not made here: V1 reports the raw ones, which the runner takes
from the logits before this sampler sees them.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.model_executor.layers.sampler import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens_penalty,
    apply_penalties,
    apply_top_k_top_p,
)
from minivllm.v1.sample.metadata import SamplingMetadata


class Sampler(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        # The rows without a seed draw from one engine-wide stream, seeded by
        # the engine's `seed` (vLLM: the device's global RNG).
        self.generator = torch.Generator().manual_seed(seed)

    def forward(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]
        metadata: SamplingMetadata,
    ) -> torch.Tensor:  # [num_rows] token ids
        logits = self.apply_logits_processors(logits.float(), metadata)
        return self.sample(logits, metadata)

    @staticmethod
    def apply_logits_processors(
        logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        if any(ids is not None for ids in metadata.allowed_token_ids):
            logits = apply_allowed_token_ids(logits, metadata.allowed_token_ids)
        if metadata.bad_words_token_ids:
            logits = apply_bad_words(
                logits, metadata.bad_words_token_ids, metadata.output_token_ids
            )
        if any(metadata.min_tokens_banned):
            logits = apply_min_tokens_penalty(logits, metadata.min_tokens_banned)
        if any(metadata.logit_bias):
            logits = apply_logit_bias(logits, metadata.logit_bias)
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_sampled = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_sampled
        logits = self.apply_temperature(logits, metadata)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        random_sampled = self.random_sample(logits.softmax(dim=-1), metadata.generators)
        if greedy_sampled is None:
            return random_sampled
        return torch.where(metadata.greedy, greedy_sampled, random_sampled.to(logits.device))

    @staticmethod
    def apply_temperature(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows divide by 1: their row is only there to keep the batch whole."""
        temperature = torch.where(metadata.greedy, 1.0, metadata.temperature)
        return logits / temperature.unsqueeze(-1)

    def random_sample(
        self,
        probs: torch.Tensor,  # [num_rows, vocab_size]
        generators: dict[int, torch.Generator],
    ) -> torch.Tensor:  # [num_rows], on the CPU
        """One token ~ probs per row by the exponential race, argmax(p / E)
        with E ~ Exp(1), as vLLM's `random_sample`: unless every row has its
        own generator, the whole batch's noise comes from the shared stream;
        then each seeded row's is drawn again from its own generator, so its
        tokens do not depend on the batch. The noise is drawn, and the race
        run, on the CPU: a seed gives the same tokens on every device."""
        noise = torch.empty(probs.shape, dtype=torch.float32)  # [num_rows, vocab_size]
        if len(generators) != probs.shape[0]:
            noise.exponential_(generator=self.generator)
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        return (probs.cpu() / noise).argmax(dim=-1)
