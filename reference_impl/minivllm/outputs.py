"""What the engine hands back: `RequestOutput` and its `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sequence import PositionLogprobs, RequestMetrics, SequenceGroup


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason is None while generating, then "stop" (EOS, a stop token
    or a stop string), "length" (max_tokens or max_model_len) or "abort".
    stop_reason is the stop token id or stop string that ended it, if any.
    logprobs: with SamplingParams.logprobs, one token_id -> Logprob dict per
    generated token; otherwise None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of `generate`).

    prompt_logprobs: with SamplingParams.prompt_logprobs, one entry per
    prompt token: None for the first, then a token_id -> Logprob dict.
    num_cached_tokens: prompt tokens found in the prefix cache when the
    request was first scheduled (V1 reports it; None from the classic engine).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> RequestOutput:
        """vLLM v0.6's choice of outputs: of several sequences, the n with the
        highest cumulative logprob so far, most likely first. Each keeps its
        place in the group as `index`, so a stream's choices stay apart while
        their order changes; with best_of > n the index is the rank among
        those returned instead (vLLM's place in the group could exceed n - 1).
        cumulative_logprob only with logprobs, as in v0.6."""
        params = seq_group.sampling_params
        seqs = sorted(seq_group.get_seqs(), key=lambda s: s.seq_id)
        top = seqs
        if len(seqs) > 1:
            top = sorted(seqs, key=lambda s: s.get_cumulative_logprob(), reverse=True)[: params.n]
        with_logprobs = params.logprobs is not None
        prompt_logprobs = seq_group.prompt_logprobs
        outputs = [
            CompletionOutput(
                index=rank if params.best_of > params.n else seqs.index(seq),
                text=seq.get_output_text_to_return(params.output_text_buffer_length),
                token_ids=list(seq.get_output_token_ids()),
                cumulative_logprob=seq.get_cumulative_logprob() if with_logprobs else None,
                logprobs=list(seq.output_logprobs) if with_logprobs else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for rank, seq in enumerate(top)
        ]
        return cls(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt,
            prompt_token_ids=list(seq_group.prompt_token_ids),
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            outputs=outputs,
            finished=seq_group.is_finished(),
            metrics=seq_group.metrics,
        )
