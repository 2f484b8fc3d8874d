"""Sequences and sequence groups: the engine's record of every request.

A request becomes a `SequenceGroup` holding 1..n `Sequence`s that share a
prompt. Each `Sequence` owns its token ids (`SequenceData`) and a status;
its KV cache lives in blocks that the `BlockSpaceManager` maps by `seq_id`.
`SequenceGroupMetadata` is the slice of that state the scheduler hands the
worker for one step.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

import torch

from minivllm.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """A sequence's place in its lifecycle. Finished states come last."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status >= SequenceStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
            # An ignored prompt could not fit: vLLM reports it as "length".
            SequenceStatus.FINISHED_IGNORED: "length",
        }.get(status)


@dataclass
class Logprob:
    """One token's log-probability at one position.

    rank: 1 for the most likely token, counting tokens strictly more likely.
    decoded_token: the text the token adds after the tokens before it (set
        by the detokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# token_id -> Logprob at one position: the chosen token and the top-k ones.
PositionLogprobs = dict[int, Logprob]


class SequenceStage(enum.Enum):
    """PREFILL until every token so far has its KV in the cache, then DECODE."""

    PREFILL = enum.auto()
    DECODE = enum.auto()


@dataclass
class SequenceData:
    """Token ids of one sequence and how many of them have KV in the cache."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    stage: SequenceStage = SequenceStage.PREFILL

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_prompt_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    def get_output_token_ids(self) -> list[int]:
        return self.output_token_ids

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        if self.output_token_ids:
            return self.output_token_ids[-1]
        return self.prompt_token_ids[-1]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def update_num_computed_tokens(self, num_new_computed_tokens: int) -> None:
        self.num_computed_tokens += num_new_computed_tokens
        assert self.num_computed_tokens <= self.get_len()
        if self.get_num_uncomputed_tokens() == 0:
            self.stage = SequenceStage.DECODE

    def reset_state_for_recompute(self) -> None:
        """Forget the cache: prompt and outputs will be prefilled again."""
        self.num_computed_tokens = 0
        self.stage = SequenceStage.PREFILL


def num_samples_to_draw(params: SamplingParams, data: SequenceData) -> int:
    """How many tokens a sequence samples when its group samples: `best_of`
    at a prompt's first sample (the sequences the request forks into), one
    at every later step. Greedy requests have best_of 1 (SamplingParams
    refuses more), so they always draw one. The sampler and the dry-run
    worker follow this rule."""
    return 1 if data.output_token_ids else params.best_of


class Sequence:
    """One token stream: the prompt plus what has been generated so far."""

    def __init__(
        self,
        seq_id: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        block_size: int,
    ) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.data = SequenceData(list(prompt_token_ids))
        self.output_text = ""
        # One entry per output token: its logprob and the top-k alternatives.
        self.output_logprobs: list[PositionLogprobs] = []
        # Incremental detokenization (transformers_utils/detokenizer.py):
        # output tokens [prefix_offset, read_offset) are the context the next
        # tokens are decoded in; tokens from read_offset on are not in
        # output_text yet.
        self.prefix_offset = 0
        self.read_offset = 0
        self._status = SequenceStatus.WAITING  # a new sequence, not a transition
        self.stop_reason: int | str | None = None
        # How much of the output the request's outputs have carried so far
        # (output_kind=DELTA returns only what lies past these).
        self._last_output_token_ids_offset = 0
        self._last_output_text_offset = 0

    @property
    def status(self) -> SequenceStatus:
        return self._status

    @status.setter
    def status(self, status: SequenceStatus) -> None:
        self.set_status(status)

    def set_status(self, status: SequenceStatus) -> None:
        """Every change of status comes through here (`seq.status = ...`
        calls it), so one patch of `Sequence.set_status` watches them all."""
        self._status = status

    @property
    def n_blocks(self) -> int:
        """Logical blocks needed to hold every token so far."""
        return math.ceil(self.get_len() / self.block_size)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.data.prompt_token_ids

    @property
    def finish_reason(self) -> str | None:
        return SequenceStatus.get_finished_reason(self.status)

    def append_token_id(self, token_id: int, logprob: float) -> None:
        self.data.append_token_id(token_id, logprob)

    def get_len(self) -> int:
        return self.data.get_len()

    def get_prompt_len(self) -> int:
        return self.data.get_prompt_len()

    def get_output_len(self) -> int:
        return self.data.get_output_len()

    def get_prompt_token_ids(self) -> list[int]:
        return self.data.get_prompt_token_ids()

    def get_token_ids(self) -> list[int]:
        return self.data.get_token_ids()

    def get_last_token_id(self) -> int:
        return self.data.get_last_token_id()

    def get_output_token_ids(self) -> list[int]:
        return self.data.get_output_token_ids()

    def get_cumulative_logprob(self) -> float:
        return self.data.cumulative_logprob

    def get_output_text_to_return(self, buffer_length: int, delta: bool = False) -> str:
        """The output text that is safe to show now: while generating, all
        but its last `buffer_length` characters
        (`SamplingParams.output_text_buffer_length`), which could be the start
        of a stop string that would have to be taken back; once finished, all
        of it (vLLM v0.6's rule). With `delta`, only the part of it past what
        the previous call returned.
        """
        return output_text_to_return(self, buffer_length, self.is_finished(), delta)

    def get_output_token_ids_to_return(self, delta: bool = False) -> list[int]:
        """The output token ids so far; with `delta`, those past what the
        previous call returned."""
        if not delta:
            return self.data.output_token_ids
        start = self._last_output_token_ids_offset
        self._last_output_token_ids_offset = self.get_output_len()
        return self.data.output_token_ids[start:]

    def get_num_new_tokens(self) -> int:
        """Tokens this sequence feeds the model next step: all uncomputed ones."""
        return self.data.get_num_uncomputed_tokens()

    def is_prefill(self) -> bool:
        return self.data.stage == SequenceStage.PREFILL

    def is_finished(self) -> bool:
        return SequenceStatus.is_finished(self._status)

    def reset_state_for_recompute(self) -> None:
        self.data.reset_state_for_recompute()

    def fork(self, new_seq_id: int) -> Sequence:
        """A copy with its own id: same tokens, text and state so far. Its KV
        blocks are shared with this one by the block manager (`fork`)."""
        child = copy.deepcopy(self)
        child.seq_id = new_seq_id
        return child

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


def output_text_to_return(holder, buffer_length: int, finished: bool, delta: bool) -> str:
    """The text of `holder` (a classic `Sequence` or V1's detokenizer: its
    `output_text` and `_last_output_text_offset`) safe to show now: all of
    it once finished, else all but its last `buffer_length` characters;
    with `delta`, only what lies past the previous delta call's end."""
    length = len(holder.output_text)
    if buffer_length and not finished:
        length = max(length - buffer_length, 0)
    if not delta:
        return holder.output_text[:length]
    start = holder._last_output_text_offset
    holder._last_output_text_offset = max(start, length)
    return holder.output_text[start:length]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # moves with tokens only (v0.6: set at arrival)
    time_in_queue: float | None = None
    finished_time: float | None = None

    def record_token(self, now: float, ttfts: list[float], tpots: list[float]) -> None:
        """A step gave the request tokens at `now`: its first token's time
        since arrival goes to `ttfts`, a later step's gap since the
        request's previous token (a wait after a preemption included) to
        `tpots` (v0.6's TTFT and TPOT; the engines' stats carry them)."""
        if self.first_token_time is None:
            self.first_token_time = now
            ttfts.append(now - self.arrival_time)
        else:
            tpots.append(now - self.last_token_time)
        self.last_token_time = now


class SequenceGroup:
    """One request: its sequences, sampling parameters and timing."""

    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # Under scheduling_policy="priority": lower values are served first.
        self.priority = priority
        self.seqs = seqs
        self.seqs_dict = {seq.seq_id: seq for seq in seqs}
        # vLLM v0.6's shortcut for the common case: a group of one sequence
        # answers "which of my sequences are RUNNING / unfinished?" from its
        # first sequence alone, without building a list. The scheduler asks
        # such questions about every running group several times a step, so
        # at batch 64 this is a good part of a step's host time. `add` keeps
        # the flag true to the group (a fork makes it False for good).
        self.first_seq = seqs[0]
        self.is_single_seq = len(seqs) == 1
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # With prompt_logprobs: one entry per prompt token, None for the first
        # (nothing predicts it), filled in as the prefill computes them.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # A seeded request draws from its own generator, so its tokens do
        # not depend on the other requests in the batch.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def prompt(self) -> str | None:
        return self.first_seq.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.first_seq.prompt_token_ids

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """The group's sequences (with `status`, if given). The list may be
        the group's own (`self.seqs`), as in vLLM: read it, never change it."""
        if status is None:
            return self.seqs
        if self.is_single_seq:
            return self.seqs if self.first_seq.status == status else []
        return [seq for seq in self.seqs if seq.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        if self.is_single_seq:
            return [] if self.first_seq.is_finished() else self.seqs
        return [seq for seq in self.seqs if not seq.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        if status is None:
            return len(self.seqs)
        return len(self.get_seqs(status))

    def get_max_num_running_seqs(self) -> int:
        """The most sequences this group can have running at once from now on.

        vLLM's rule: while the group holds fewer sequences than `best_of`
        (finished ones counted), it may still fork into `best_of`, so it
        counts as that many; once it has forked, its unfinished sequences
        count. The scheduler reserves this many `max_num_seqs` slots for the
        group and preempts by RECOMPUTE only when it is 1.
        """
        if self.sampling_params.best_of > len(self.seqs):
            return self.sampling_params.best_of
        return len(self.get_unfinished_seqs())

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)
        self.seqs_dict[seq.seq_id] = seq
        self.is_single_seq = False

    def is_prefill(self) -> bool:
        """Whether the group's next step is a prefill. Its unfinished
        sequences are always in the same stage; a finished one may not be
        (an n > 1 group whose first sequence stopped, then whose other was
        preempted by RECOMPUTE), so it is not asked."""
        unfinished = self.get_unfinished_seqs()
        return bool(unfinished) and unfinished[0].is_prefill()

    def is_finished(self) -> bool:
        if self.is_single_seq:
            return self.first_seq.is_finished()
        return all(seq.is_finished() for seq in self.seqs)

    def maybe_set_first_scheduled_time(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now
            self.metrics.time_in_queue = now - self.metrics.arrival_time

    def __repr__(self) -> str:
        """One short line, so that printing a scheduler queue (a deque of
        groups) at a breakpoint shows where each request stands."""
        seqs = self.get_unfinished_seqs() or self.seqs
        statuses = "/".join(dict.fromkeys(seq.status.name for seq in seqs))
        first = seqs[0].data
        return (
            f"SequenceGroup(request_id={self.request_id}, status={statuses}, "
            f"num_seqs={len(self.seqs)}, len={first.get_len()}, "
            f"computed={first.num_computed_tokens})"
        )


@dataclass
class SequenceGroupMetadata:
    """What the worker needs to run one group for one step.

    is_prompt: this group is prefilling (several tokens per sequence).
    seq_data: seq_id -> its SequenceData (token ids, num_computed_tokens).
    block_tables: seq_id -> physical block numbers, in logical order.
    token_chunk_size: tokens each sequence computes this step.
    do_sample: whether this step samples a token: false for the chunks of a
        chunked prefill that do not finish the prompt.
    """

    request_id: str
    is_prompt: bool
    seq_data: dict[int, SequenceData]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int
    do_sample: bool = True
    generator: torch.Generator | None = None


@dataclass
class SequenceOutput:
    """The token sampled for one sequence, with the logprobs at its position:
    the sampled token's always, and the top `logprobs` tokens' if asked."""

    parent_seq_id: int
    output_token: int
    logprobs: PositionLogprobs


@dataclass
class CompletionSequenceGroupOutput:
    """The samples of one sequence group in one step.

    prompt_logprobs: with prompt_logprobs, one entry for each prompt token
    this step's prefill predicted, in order.
    """

    samples: list[SequenceOutput]
    prompt_logprobs: list[PositionLogprobs] | None = None


@dataclass
class ExecuteModelRequest:
    """One step, as the engine hands it to the executor: the scheduled
    groups and the block moves to apply before the model runs (vLLM's class
    of the same name). `with_batch`: attach the flattened batch to the
    output even in a dry run (a step observer reads it)."""

    seq_group_metadata_list: list[SequenceGroupMetadata]
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    with_batch: bool = False
