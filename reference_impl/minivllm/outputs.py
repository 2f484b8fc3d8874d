"""What the engine hands back: `RequestOutput` and its `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sequence import RequestMetrics, SequenceGroup


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason is None while generating, then "stop" (EOS or a stop
    token), "length" (max_tokens or max_model_len) or "abort".
    stop_reason is the stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of `generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> RequestOutput:
        seqs = sorted(seq_group.get_seqs(), key=lambda s: s.seq_id)
        outputs = [
            CompletionOutput(
                index=i,
                text=seq.output_text,
                token_ids=list(seq.get_output_token_ids()),
                cumulative_logprob=seq.get_cumulative_logprob(),
                logprobs=None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        return cls(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt,
            prompt_token_ids=list(seq_group.prompt_token_ids),
            outputs=outputs,
            finished=seq_group.is_finished(),
            metrics=seq_group.metrics,
        )
