"""The sampler: from logits to one token per sequence.

In vLLM's order: temperature, then top-k, then top-p, then a draw from the
remaining distribution (greedy rows take the argmax). Seeded requests draw
from their own `torch.Generator`, so their tokens do not depend on what else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingType
from minivllm.sequence import CompletionSequenceGroupOutput, SequenceOutput


@dataclass
class SamplerOutput:
    """One step's samples, one entry per scheduled sequence group."""

    outputs: list[CompletionSequenceGroupOutput]

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, index: int) -> CompletionSequenceGroupOutput:
        return self.outputs[index]


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor,  # [num_rows] int64; vocab_size = keep all
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = keep all
) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p mass.

    Same rules as Hugging Face's TopK/TopP warpers: ties with the k-th logit
    are kept, and top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p (always at least one).
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    # Top-k: the k-th largest is at ascending index vocab_size - k.
    kth = sorted_logits.gather(-1, (vocab_size - top_k).unsqueeze(-1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Top-p: drop the low tail whose total probability is <= 1 - top_p.
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum_probs <= (1 - top_p).unsqueeze(-1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


class Sampler(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        # Unseeded requests share one engine-wide stream, seeded by the
        # engine's `seed`, so that whole runs are reproducible.
        self.generator = torch.Generator().manual_seed(seed)

    def forward(
        self,
        logits: torch.Tensor,  # [num_sampled_rows, vocab_size]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        logits = logits.float()
        rows = [sg for sg in sampling_metadata.seq_groups for _ in sg.seq_ids]
        temperatures, top_ks, top_ps = [], [], []
        vocab_size = logits.shape[-1]
        for sg in rows:
            p = sg.sampling_params
            greedy = p.sampling_type == SamplingType.GREEDY
            temperatures.append(1.0 if greedy else p.temperature)
            top_ks.append(vocab_size if p.top_k == -1 else min(p.top_k, vocab_size))
            top_ps.append(p.top_p)
        device = logits.device
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(-1)
        logits = apply_top_k_top_p(
            logits, torch.tensor(top_ks, device=device), torch.tensor(top_ps, device=device)
        )
        logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab_size]
        probs = logprobs.exp()

        tokens = []
        for row, sg in enumerate(rows):
            if sg.sampling_params.sampling_type == SamplingType.GREEDY:
                tokens.append(int(logits[row].argmax()))
            else:
                tokens.append(self._draw(probs[row], sg.generator or self.generator))
        return self._build_output(sampling_metadata, tokens, logprobs)

    @staticmethod
    def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
        """One token ~ probs, by the exponential race: argmax(p_i / E_i) with
        E_i ~ Exp(1) picks i with probability p_i. The noise is drawn on the
        CPU so a seed gives the same tokens on every device."""
        noise = torch.empty(probs.shape[0]).exponential_(generator=generator)
        return int((probs.cpu() / noise).argmax())

    @staticmethod
    def _build_output(
        sampling_metadata: SamplingMetadata, tokens: list[int], logprobs: torch.Tensor
    ) -> SamplerOutput:
        outputs, row = [], 0
        for sg in sampling_metadata.seq_groups:
            samples = []
            for seq_id in sg.seq_ids:
                token = tokens[row]
                samples.append(SequenceOutput(seq_id, token, float(logprobs[row, token])))
                row += 1
            outputs.append(CompletionSequenceGroupOutput(samples))
        return SamplerOutput(outputs)
