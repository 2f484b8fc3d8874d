"""`InputBatch`: the persistent batch (vLLM's `vllm/v1/worker/gpu_input_batch.py`).

The classic model runner rebuilt every input from the scheduler's
`SequenceGroupMetadata` each step. V1's keeps the running requests in rows
of preallocated arrays (token ids, lengths, block table) and applies only
what changed: a new request fills a row, a finished or unscheduled one
frees its row, a decode appends one token to its row. A step's inputs are
then gathered from the arrays with a few vectorised operations.

Rows are kept contiguous (`condense` moves the last rows into holes), and
the runner may reorder them (`swap_states`) for its attention layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.sampling_params import SamplingParams
from minivllm.sequence import PositionLogprobs
from minivllm.v1.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the worker remembers of a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # random requests with a seed draw from their own
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]
    # With prompt_logprobs: per prompt position from the second, its logprobs
    # as chunks compute them (None until then). On the request, not its row,
    # so a request preempted mid-prompt keeps them (vLLM PR #41411).
    in_progress_prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, block_size: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self._req_ids: list[str | None] = []  # row -> request id (None: a hole)
        self.req_id_to_index: dict[str, int] = {}
        self.req_states: list[CachedRequestState | None] = []
        # [max_num_reqs, max_model_len]: each row's prompt then outputs.
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, max_num_blocks_per_req, block_size)
        # Bumped whenever a row changes hands (a request added, removed,
        # moved or swapped): what the runner's per-batch caches key on.
        self.version = 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids in row order (call after `condense`)."""
        return self._req_ids[: self.num_reqs]

    def add_request(self, request: CachedRequestState) -> int:
        """Put a request in the first free row; returns the row."""
        holes = [i for i, rid in enumerate(self._req_ids) if rid is None]
        if holes:
            row = holes[0]
        else:
            row = len(self._req_ids)
            if row == self.max_num_reqs:
                raise RuntimeError(f"the batch is full ({self.max_num_reqs} requests)")
            self._req_ids.append(None)
            self.req_states.append(None)
        self.version += 1
        self._req_ids[row] = request.req_id
        self.req_states[row] = request
        self.req_id_to_index[request.req_id] = row
        num_prompt = len(request.prompt_token_ids)
        self.token_ids_cpu[row, :num_prompt] = request.prompt_token_ids
        self.token_ids_cpu[row, num_prompt : request.num_tokens] = request.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = request.num_tokens
        self.num_computed_tokens_cpu[row] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, row)
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row (a hole until `condense`); None if absent."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.version += 1
            self._req_ids[row] = None
            self.req_states[row] = None
        return row

    def condense(self) -> None:
        """Fill the holes with the last rows, so rows 0..num_reqs-1 are used."""
        while self._req_ids and self._req_ids[-1] is None:
            self._req_ids.pop()
            self.req_states.pop()
        for hole in range(self.num_reqs):
            if self._req_ids[hole] is not None:
                continue
            last = len(self._req_ids) - 1
            self._move_row(last, hole)
            self._req_ids.pop()
            self.req_states.pop()
            while self._req_ids and self._req_ids[-1] is None:
                self._req_ids.pop()
                self.req_states.pop()

    def _move_row(self, src: int, tgt: int) -> None:
        self.version += 1
        req_id = self._req_ids[src]
        self._req_ids[tgt], self.req_states[tgt] = req_id, self.req_states[src]
        self.req_id_to_index[req_id] = tgt
        num_tokens = self.num_tokens[src]
        self.token_ids_cpu[tgt, :num_tokens] = self.token_ids_cpu[src, :num_tokens]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            array[tgt] = array[src]
        self.block_table.move_row(src, tgt)

    def swap_states(self, i: int, j: int) -> None:
        """Exchange two rows (the runner's reordering)."""
        self.version += 1
        ids, states = self._req_ids, self.req_states
        ids[i], ids[j] = ids[j], ids[i]
        states[i], states[j] = states[j], states[i]
        self.req_id_to_index[ids[i]], self.req_id_to_index[ids[j]] = i, j
        self.token_ids_cpu[[i, j]] = self.token_ids_cpu[[j, i]]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            array[[i, j]] = array[[j, i]]
        self.block_table.swap_row(i, j)

    def append_token(self, row: int, token_id: int) -> None:
        """A sampled token joins its row (and the request's state)."""
        self.token_ids_cpu[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
        self.req_states[row].output_token_ids.append(token_id)
