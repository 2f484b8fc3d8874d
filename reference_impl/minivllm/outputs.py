"""What the engine hands back: `RequestOutput` and its `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sampling_params import RequestOutputKind
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
    prompt, prompt_token_ids, prompt_logprobs: None in the classic engine's
    DELTA outputs after the first that carries a token (v0.6's rule).
    num_cached_tokens: prompt tokens found in the prefix cache when the
    request was first scheduled (V1 reports it; None from the classic engine).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge the request's next output into this one (vLLM's method; V1's
        `RequestOutputCollector` merges the outputs a slow reader has not
        taken). Completions are matched by `index`: with `aggregate` (DELTA
        outputs) their text, tokens and logprobs are appended, else the
        newer replaces the older. Unlike vLLM's, new completion objects are
        made, never changed in place (the older ones may be held elsewhere:
        a V1 parent keeps its children's), and the newer output's metrics
        and cached-token count are taken too."""
        self.finished = next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {completion.index: i for i, completion in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
                continue
            if aggregate:
                old = self.outputs[i]
                new = CompletionOutput(
                    index=new.index,
                    text=old.text + new.text,
                    token_ids=old.token_ids + new.token_ids,
                    cumulative_logprob=new.cumulative_logprob,
                    logprobs=None if new.logprobs is None else (old.logprobs or []) + new.logprobs,
                    finish_reason=new.finish_reason,
                    stop_reason=new.stop_reason,
                )
            self.outputs[i] = new

    @classmethod
    def from_seq_group(cls, seq_group: SequenceGroup) -> RequestOutput | None:
        """vLLM v0.6's choice of outputs: of several sequences, the n with the
        highest cumulative logprob so far, most likely first. Each keeps its
        place in the group as `index`, so a stream's choices stay apart while
        their order changes; with best_of > n the index is the rank among
        those returned instead (vLLM's place in the group could exceed n - 1).
        cumulative_logprob only with logprobs, as in v0.6.

        By `output_kind`: None for an unfinished FINAL_ONLY request; for
        DELTA each completion holds only the text, tokens and logprobs new
        since the previous output, and the prompt comes with the outputs up
        to the first that holds a token (v0.6's rule: a prompt prefilled in
        chunks sends its prompt logprobs so far with each chunk's output)."""
        params = seq_group.sampling_params
        finished = seq_group.is_finished()
        if params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = params.output_kind == RequestOutputKind.DELTA
        seqs = sorted(seq_group.get_seqs(), key=lambda s: s.seq_id)
        top = seqs
        if len(seqs) > 1:
            top = sorted(seqs, key=lambda s: s.get_cumulative_logprob(), reverse=True)[: params.n]
        with_logprobs = params.logprobs is not None
        include_prompt = True
        outputs = []
        for rank, seq in enumerate(top):
            token_ids = list(seq.get_output_token_ids_to_return(delta))
            logprobs = None
            if with_logprobs:
                logprobs = seq.output_logprobs[seq.get_output_len() - len(token_ids) :]
            if delta and seq.get_output_len() > len(token_ids):
                include_prompt = False  # an earlier output carried a token, and the prompt
            outputs.append(
                CompletionOutput(
                    index=rank if params.best_of > params.n else seqs.index(seq),
                    text=seq.get_output_text_to_return(params.output_text_buffer_length, delta),
                    token_ids=token_ids,
                    cumulative_logprob=seq.get_cumulative_logprob() if with_logprobs else None,
                    logprobs=logprobs,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        prompt_logprobs = seq_group.prompt_logprobs if include_prompt else None
        return cls(
            request_id=seq_group.request_id,
            prompt=seq_group.prompt if include_prompt else None,
            prompt_token_ids=list(seq_group.prompt_token_ids) if include_prompt else None,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            outputs=outputs,
            finished=finished,
            metrics=seq_group.metrics,
        )
