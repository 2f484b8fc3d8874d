"""The sampler: from logits to one token per sequence, with logprobs.

Each row goes through vLLM's steps, in vLLM's order:

0. logit_bias, allowed_token_ids, then bad_words (vLLM v0 turns them into
   logits processors, which run before the sampler);
1. min_tokens: while a sequence has fewer outputs than `min_tokens`, every
   token that would end it (EOS, `stop_token_ids`) is set to -inf;
2. penalties: repetition (prompt and output tokens), then presence and
   frequency (output tokens only);
3. temperature, then top-k, then top-p, then min-p;
4. a draw from what remains; greedy rows take the argmax. Seeded requests
   draw from their own `torch.Generator`, so their tokens do not depend on
   what else is in the batch.

Logprobs are those of the processed distribution, the one the token was
drawn from, as in vLLM v0. Prompt logprobs are the model's own (raw)
distribution: the prompt was not sampled, and truncation would give most
prompt tokens -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.model_executor.sampling_metadata import SamplingMetadata, SequenceGroupToSample
from minivllm.sampling_params import SamplingParams, SamplingType
from minivllm.sequence import (
    CompletionSequenceGroupOutput,
    Logprob,
    PositionLogprobs,
    SequenceData,
    SequenceOutput,
    num_samples_to_draw,
)

if TYPE_CHECKING:
    from minivllm.worker.model_runner import FlatBatch


@dataclass
class SamplerOutput:
    """One step's samples, one entry per scheduled sequence group.

    batch: the `FlatBatch` the model ran on, the very object its input
    tensors were made from (the worker attaches it); None for a step that
    ran nothing, and in a dry run unless the engine asked for it.
    """

    outputs: list[CompletionSequenceGroupOutput]
    batch: FlatBatch | None = None

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, index: int) -> CompletionSequenceGroupOutput:
        return self.outputs[index]


def apply_min_tokens_penalty(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    banned_token_ids: list[list[int]],  # per row; empty = nothing banned
) -> torch.Tensor:
    """Set each row's banned tokens to -inf, so they cannot be sampled."""
    logits = logits.clone()
    for row, token_ids in enumerate(banned_token_ids):
        if token_ids:  # an empty index still costs a few operator calls
            logits[row, token_ids] = float("-inf")
    return logits


def apply_logit_bias(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    biases: list[dict[int, float] | None],  # per row; None = no bias
) -> torch.Tensor:
    """Add each row's bias to its tokens' logits."""
    logits = logits.clone()
    for row, bias in enumerate(biases):
        if bias:
            values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
            logits[row, list(bias)] += values
    return logits


def apply_allowed_token_ids(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    allowed: list[list[int] | None],  # per row; None = every token
) -> torch.Tensor:
    """Set to -inf every token a row does not allow."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row, token_ids in enumerate(allowed):
        if token_ids is not None:
            keep[row] = False
            keep[row, token_ids] = True
    return logits.masked_fill(~keep, float("-inf"))


def apply_bad_words(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    bad_words_token_ids: dict[int, list[list[int]]],  # row -> its bad words' token ids
    output_token_ids: list[list[int]],  # per row: the tokens generated so far
) -> torch.Tensor:
    """Ban each bad word's last token wherever the row's output ends with
    the word's other tokens: a one-token word always, a longer one only
    right after its beginning (vLLM's `apply_bad_words`; only generated
    tokens are looked at, not the prompt).

    Unlike vLLM, a row whose bans would leave no token to sample (its
    allowed tokens all banned at this step) keeps its logits: a draw from
    nothing would give token 0 whatever the row allows. The engine refuses
    the requests for which that could happen at every step."""
    logits = logits.clone()
    for row, words in bad_words_token_ids.items():
        past = output_token_ids[row]
        banned = [
            word[-1]
            for word in words
            if len(word) - 1 <= len(past) and past[len(past) - len(word) + 1 :] == word[:-1]
        ]
        if banned:
            kept = logits[row].clone()
            kept[banned] = float("-inf")
            if torch.isfinite(kept).any():
                logits[row] = kept
    return logits


def penalizes(params: SamplingParams) -> bool:
    """Whether any of the request's penalties is on (each at its neutral
    value is a no-op, so a batch without one skips the token counts)."""
    return bool(
        params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1
    )


def apply_request_logits_processors(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    params: list[SamplingParams],
    output_token_ids: list[list[int]],  # per row
) -> torch.Tensor:
    """Stage 0 of the module docstring, for the rows that ask for it: what
    vLLM v0 ran as each request's logits processors
    (`LogitsProcessor._apply_logits_processors`)."""
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])
    if any(p.allowed_token_ids is not None for p in params):
        logits = apply_allowed_token_ids(logits, [p.allowed_token_ids for p in params])
    bad_words = {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
    if bad_words:
        logits = apply_bad_words(logits, bad_words, output_token_ids)
    return logits


def get_token_bin_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab_size]: how often each token id occurs in each row's list."""
    longest = max((len(ids) for ids in token_ids), default=0)
    # Pad with an extra id, vocab_size, whose column is dropped at the end.
    padded = torch.tensor(
        [ids + [vocab_size] * (longest - len(ids)) for ids in token_ids],
        dtype=torch.long,
        device=device,
    ).reshape(len(token_ids), longest)  # [num_rows, longest]
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor,  # [num_rows]; 0 = off
    frequency_penalties: torch.Tensor,  # [num_rows]; 0 = off
    repetition_penalties: torch.Tensor,  # [num_rows]; 1 = off
) -> torch.Tensor:
    """Discourage tokens already seen.

    Repetition penalty (Hugging Face's, from the CTRL paper) covers prompt
    and output tokens: a positive logit is divided by it, a negative one
    multiplied, so the token always becomes less likely. Presence and
    frequency penalties (OpenAI's) cover output tokens only:
    logit -= frequency * count + presence * (count > 0).
    """
    vocab_size = logits.shape[-1]
    output_counts = get_token_bin_counts(output_token_ids, vocab_size, logits.device)
    prompt_counts = get_token_bin_counts(prompt_token_ids, vocab_size, logits.device)
    seen = (prompt_counts > 0) | (output_counts > 0)  # [num_rows, vocab_size]
    repetition = repetition_penalties.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalties.unsqueeze(-1) * output_counts
    return logits - presence_penalties.unsqueeze(-1) * (output_counts > 0)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    top_k: torch.Tensor | None,  # [num_rows] int64; vocab_size = keep all; None: no top-k
    top_p: torch.Tensor | None,  # [num_rows] float; 1.0 = keep all; None: no top-p
) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p mass.

    Same rules as Hugging Face's TopK/TopP warpers: ties with the k-th logit
    are kept, and top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p (always at least one).
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:  # the k-th largest is at ascending index vocab_size - k
        kth = sorted_logits.gather(-1, (vocab_size - top_k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:  # drop the low tail whose total probability is <= 1 - top_p
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum_probs <= (1 - top_p).unsqueeze(-1)
        # A row that keeps all (top_p = 1) drops nothing. Else its tokens
        # whose float32 probability is 0 (cum_probs <= 0) would turn -inf,
        # and its logprobs change, only when another row of the batch
        # truncates (vLLM v0.6's mask does that).
        drop &= (top_p < 1).unsqueeze(-1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_min_p(
    logits: torch.Tensor,  # [num_rows, vocab_size]
    min_p: torch.Tensor,  # [num_rows]; 0 = keep all
) -> torch.Tensor:
    """Set to -inf every token less likely than min_p times the most likely
    one: the cut scales with how confident the model is."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def get_position_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab_size]
    token_ids: list[int],  # per row: the token that came next
    num_top: list[int],  # per row: how many most likely tokens to add
    rank_after_ties: bool = False,
) -> list[PositionLogprobs]:
    """Per row: the given token's logprob and rank, plus the `num_top` most
    likely tokens, ranked 1, 2, ... in order.

    The two engines rank a token tied with others differently, as their vLLMs
    do: v0.6's sampler ranks it 1 + the tokens strictly more likely (ahead of
    its ties); V1 (`rank_after_ties`) counts every token at least as likely,
    itself included (`batched_count_greater_than`), so it ranks after them.
    And a given token that is also among the top ones: v0.6 keeps its own
    entry; V1 builds the dict from [given, top...], so the top entry, ranked
    by its place, replaces it (the two ranks differ only on ties).
    """
    chosen = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen_logprobs = logprobs.gather(-1, chosen.unsqueeze(-1))  # [num_rows, 1]
    if rank_after_ties:
        ranks = (logprobs >= chosen_logprobs).sum(dim=-1)  # [num_rows]
    else:
        ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # [num_rows]
    top_logprobs, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)  # [num_rows, k]
    chosen_logprobs, ranks = chosen_logprobs.squeeze(-1).tolist(), ranks.tolist()
    top_logprobs, top_ids = top_logprobs.tolist(), top_ids.tolist()
    result = []
    for row, token_id in enumerate(token_ids):
        entry = {token_id: Logprob(chosen_logprobs[row], ranks[row])}
        for rank in range(num_top[row]):
            top = Logprob(top_logprobs[row][rank], rank + 1)
            if rank_after_ties:
                entry[top_ids[row][rank]] = top
            else:
                entry.setdefault(top_ids[row][rank], top)
        result.append(entry)
    return result


class Sampler(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        # Unseeded requests share one engine-wide stream, seeded by the
        # engine's `seed`, so that whole runs are reproducible.
        self.generator = torch.Generator().manual_seed(seed)

    def forward(
        self,
        logits: torch.Tensor,  # [num_selected_rows, vocab_size]
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        logits = logits.float()
        seq_groups = sampling_metadata.seq_groups
        # One row per sampling sequence, in group order, processed together.
        rows = [(sg, seq_id) for sg in seq_groups if sg.sample_indices for seq_id in sg.seq_ids]
        sample_indices = [index for sg in seq_groups for index in sg.sample_indices]
        processed = self._process_logits(logits[sample_indices], rows)  # [num_rows, vocab_size]
        logprobs = torch.log_softmax(processed, dim=-1)
        probs = logprobs.exp()

        tokens = self._sample(processed, probs, rows)  # per row, num_samples_to_draw of them

        outputs: list[CompletionSequenceGroupOutput] = []
        drawn: list[tuple[int, SequenceOutput]] = []  # (row, sample), in draw order
        row = 0
        for sg in seq_groups:
            samples: list[SequenceOutput] = []
            for seq_id in sg.seq_ids if sg.sample_indices else ():
                for token in tokens[row]:
                    sample = SequenceOutput(seq_id, token, {})  # logprobs: below, all at once
                    samples.append(sample)
                    drawn.append((row, sample))
                row += 1
            outputs.append(
                CompletionSequenceGroupOutput(samples, self._prompt_logprobs(logits, sg))
            )

        draw_rows = [r for r, _ in drawn]
        sample_logprobs = get_position_logprobs(
            logprobs[draw_rows],
            [sample.output_token for _, sample in drawn],
            [rows[r][0].sampling_params.logprobs or 0 for r in draw_rows],
        )
        for (_, sample), entry in zip(drawn, sample_logprobs, strict=True):
            sample.logprobs = entry
        return SamplerOutput(outputs)

    def _sample(
        self,
        processed: torch.Tensor,  # [num_rows, vocab_size]
        probs: torch.Tensor,  # [num_rows, vocab_size]
        rows: list[tuple[SequenceGroupToSample, int]],
    ) -> list[list[int]]:
        """Every row's tokens, `num_samples_to_draw` of them, as vLLM's
        `_sample_with_torch`: greedy rows (which draw one) by one `argmax` over
        all of them, the other rows by one race over all their draws. One
        `.tolist()` each: on a GPU a read back is a sync, so never one per row."""
        greedy: list[int] = []
        draw_rows: list[int] = []  # one entry per draw
        noise: list[torch.Tensor] = []  # [vocab_size] per draw, on the CPU
        for row, (sg, seq_id) in enumerate(rows):
            if sg.sampling_params.sampling_type == SamplingType.GREEDY:
                greedy.append(row)
                continue
            # Each draw's noise comes from its row's generator, in row order,
            # so a seeded row's tokens do not depend on the batch (Day 9).
            generator = sg.generator or self.generator
            for _ in range(num_samples_to_draw(sg.sampling_params, sg.seq_data[seq_id])):
                draw_rows.append(row)
                noise.append(torch.empty(probs.shape[-1]).exponential_(generator=generator))
        tokens: list[list[int]] = [[] for _ in rows]
        if greedy:
            for row, token in zip(greedy, processed[greedy].argmax(dim=-1).tolist(), strict=True):
                tokens[row].append(token)
        if draw_rows:
            drawn = self._draw(probs[draw_rows], torch.stack(noise))
            for row, token in zip(draw_rows, drawn, strict=True):
                tokens[row].append(token)
        return tokens

    @staticmethod
    def _process_logits(
        logits: torch.Tensor,  # [num_rows, vocab_size]
        rows: list[tuple[SequenceGroupToSample, int]],
    ) -> torch.Tensor:
        """Steps 1-3 of the module docstring, each row with its own parameters."""
        params = [sg.sampling_params for sg, _ in rows]
        seq_data: list[SequenceData] = [sg.seq_data[seq_id] for sg, seq_id in rows]
        device, vocab_size = logits.device, logits.shape[-1]

        def per_row(values: list, dtype: torch.dtype = torch.float) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        logits = apply_request_logits_processors(
            logits, params, [d.output_token_ids for d in seq_data]
        )
        banned = [
            sorted(p.all_stop_token_ids) if len(d.output_token_ids) < p.min_tokens else []
            for p, d in zip(params, seq_data, strict=True)
        ]
        logits = apply_min_tokens_penalty(logits, banned)
        # The token counts cost O(num_rows * vocab_size): skip them when no
        # row is penalized (every penalty at its neutral value is a no-op).
        if any(penalizes(p) for p in params):
            logits = apply_penalties(
                logits,
                [d.prompt_token_ids for d in seq_data],
                [d.output_token_ids for d in seq_data],
                per_row([p.presence_penalty for p in params]),
                per_row([p.frequency_penalty for p in params]),
                per_row([p.repetition_penalty for p in params]),
            )
        # Greedy rows use temperature 1: their argmax does not depend on it,
        # and their logprobs stay those of the (penalized) model.
        temperatures = [
            1.0 if p.sampling_type == SamplingType.GREEDY else p.temperature for p in params
        ]
        logits = logits / per_row(temperatures).unsqueeze(-1)
        # As vLLM's `do_top_p_top_k` and `do_min_p`: a batch in which no row
        # truncates (all greedy, say) skips the sort of the whole vocabulary.
        if any(p.top_k != -1 or p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(
                logits,
                per_row(
                    [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
                    torch.long,
                ),
                per_row([p.top_p for p in params]),
            )
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, per_row([p.min_p for p in params]))
        return logits

    @staticmethod
    def _prompt_logprobs(
        logits: torch.Tensor,  # [num_selected_rows, vocab_size]
        sg: SequenceGroupToSample,
    ) -> list[PositionLogprobs] | None:
        """Logprobs of the prompt tokens this step predicts, raw distribution."""
        if not sg.prompt_logprob_indices:
            return None
        data = sg.seq_data[sg.seq_ids[0]]
        # Row i is the logits at position num_computed_tokens + i, which
        # predict the prompt token after it.
        first = data.num_computed_tokens + 1
        next_tokens = data.prompt_token_ids[first : first + len(sg.prompt_logprob_indices)]
        logprobs = torch.log_softmax(logits[sg.prompt_logprob_indices], dim=-1)
        num_top = [sg.sampling_params.prompt_logprobs] * len(next_tokens)
        return get_position_logprobs(logprobs, next_tokens, num_top)

    @staticmethod
    def _draw(
        probs: torch.Tensor,  # [num_draws, vocab_size]
        noise: torch.Tensor,  # [num_draws, vocab_size] on the CPU, each ~ Exp(1)
    ) -> list[int]:
        """One token ~ probs per draw, by the exponential race: argmax(p_i / E_i)
        with E_i ~ Exp(1) picks i with probability p_i. The noise is drawn on
        the CPU, and the race run there, so a seed gives the same tokens on
        every device."""
        return (probs.cpu() / noise).argmax(dim=-1).tolist()
