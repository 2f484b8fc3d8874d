"""`GPUModelRunner`: V1's model runner (vLLM's `vllm/v1/worker/gpu_model_runner.py`;
the name is vLLM's, and it runs on a CPU as well).

Each step it

1. `_update_states`: applies the scheduler's diff to the persistent batch
   (drop finished and unscheduled requests, add new and resumed ones,
   extend the block rows and computed counts of the others);
2. `_prepare_inputs`: gathers the step's flattened inputs from the batch's
   arrays: per token its id, position and cache slot; per request its query
   start, lengths and block row;
3. runs the model, computes logits for the last token of every request
   that reaches the end of its known tokens, samples, and appends the
   sampled tokens to the batch itself (the scheduler does not send them
   back); for a request that asked for `prompt_logprobs`, also the logits
   of its prompt positions, chunk by chunk.

It shares the classic engine's models and attention backends; its sampler
is V1's (v1/sample/sampler.py), built of the classic sampler's stages.

On a GPU, unless `enforce_eager`, `capture_model` records the forward of
each size in `cudagraph_batch_sizes` (current vLLM's default sizes, up to
`max_num_seqs`) as a CUDA graph, as the classic runner does
(worker/cuda_graph_runner.py), and a step whose every request computes one
token ("uniform decode") is padded to the next captured size and replayed:
vLLM V1's `FULL_DECODE_ONLY` mode. vLLM's default, `FULL_AND_PIECEWISE`,
also replays the rest of every mixed step around attention from graphs
captured piece by piece by its compiler; ours runs mixed steps eagerly.

Our attention contract (attention/backends/abstract.py) wants requests with
several new tokens (prefills, prompt chunks) before those with one (decodes);
vLLM's backends that care want decodes first. Either way the runner swaps
rows of the persistent batch to match, as vLLM's `reorder_batch` does.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.attention.kv_cache import PAD_SLOT_ID
from minivllm.attention.layer import attention_layers
from minivllm.attention.selector import get_attn_backend
from minivllm.compilation import model_forward, set_forward_context
from minivllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from minivllm.model_executor.layers.sampler import get_position_logprobs, penalizes
from minivllm.model_executor.layers.utils import packed_gemm_layers
from minivllm.model_executor.model_loader import get_model
from minivllm.sampling_params import SamplingType
from minivllm.sequence import PositionLogprobs
from minivllm.utils import cdiv
from minivllm.v1.core.sched.output import SchedulerOutput
from minivllm.v1.outputs import ModelRunnerOutput
from minivllm.v1.sample.metadata import SamplingMetadata
from minivllm.v1.sample.sampler import Sampler
from minivllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from minivllm.worker.cuda_graph_runner import CUDAGraphRunner, capture_decode_graphs


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM V1's default sizes, in tokens, to capture graphs at (its
    `cudagraph_capture_sizes`): 1, 2, 4, the multiples of 8 below 256, then
    of 16, up to `max_cudagraph_capture_size` = twice `max_num_seqs`, at most
    512 and at most `max_num_batched_tokens`. (Twice: headroom for the
    token counts of mixed steps, which vLLM's piecewise graphs replay.)"""
    largest = min(max_num_seqs * 2, 512, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [size for size in sizes if size <= largest]


@dataclass
class StepInputs:
    """The step's flattened model input, as `_prepare_inputs` built it (the
    very arrays the model's tensors were made from; the tracer records them).

    req_ids: the batch's rows in order; rows with several tokens come first.
    num_scheduled_tokens, num_computed_tokens: per row, the tokens computed
        this step and those with K/V in the cache before it.
    input_ids, positions, slot_mapping: per token, rows' tokens in row order.
    """

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    num_computed_tokens: np.ndarray  # [num_reqs]
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slot_mapping: np.ndarray  # [num_tokens]


class GPUModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
    ) -> None:
        self.model_config = model_config
        self.device = device_config.torch_device
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.attn_backend = get_attn_backend(
            model_config.attention_backend,
            device_config.device,
            model_config.dtype,
            model_config.get_head_size(),
            cache_config.block_size,
        )
        self.sampler = Sampler(seed=model_config.seed)
        # The last step's sampling metadata and the (batch version, sampling
        # rows) it was built for: reused while those stay the same.
        self._cached_sampling: tuple[tuple[int, bytes], SamplingMetadata] | None = None
        self.requests: dict[str, CachedRequestState] = {}
        # Requests that want prompt logprobs and have not finished their
        # prompt: request id -> how many top tokens per position.
        self.num_prompt_logprobs: dict[str, int] = {}
        self.input_batch = InputBatch(
            max_num_reqs=scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_blocks_per_req=cdiv(self.max_model_len, self.block_size),
            block_size=self.block_size,
        )
        self.model: torch.nn.Module | None = None
        # What runs the forward: the model itself, or its compiled form
        # (compilation_level, as the classic runner), and what its opaque
        # ops find in the forward context.
        self.model_forward: Callable | None = None
        self.attn_layers: list = []
        self.packed_layers: list = []
        self.kv_caches: list[torch.Tensor] = []
        # CUDA graphs: the sizes captured (ascending), the longest context a
        # graph covers, and the graphs by size (none until capture_model).
        # A full graph of a uniform-decode step holds one token per request,
        # so vLLM's FULL_DECODE_ONLY captures the sizes up to max_num_seqs:
        # a step of more requests than the largest of them runs eagerly.
        max_num_seqs = scheduler_config.max_num_seqs
        self.cudagraph_batch_sizes = [
            size
            for size in cudagraph_capture_sizes(
                max_num_seqs, scheduler_config.max_num_batched_tokens
            )
            if size <= max_num_seqs
        ]
        self.max_seq_len_to_capture = model_config.max_seq_len_to_capture
        self.graph_runners: dict[int, CUDAGraphRunner] = {}
        # The last step's model input (None: the model did not run), kept as
        # the classic worker keeps its FlatBatch: references, not copies.
        self.last_inputs: StepInputs | None = None

    def load_model(self) -> None:
        self.model = get_model(self.model_config, self.device, self.attn_backend)
        self.attn_layers = attention_layers(self.model)
        self.packed_layers = packed_gemm_layers(self.model)
        self.model_forward = model_forward(self.model, self.model_config.compilation_level)

    def initialize_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    @torch.inference_mode()
    def capture_model(self) -> None:
        """One CUDA graph per size of `cudagraph_batch_sizes`, over the KV
        cache (vLLM V1's `capture_model`; the worker calls it on a GPU only)."""
        self.graph_runners = capture_decode_graphs(
            self.model_forward,
            self.attn_backend,
            self.cudagraph_batch_sizes,
            self.max_seq_len_to_capture,
            self.block_size,
            self.kv_caches,
            (self.attn_layers, self.packed_layers),
        )

    def _cudagraph_batch_size(self, num_scheduled: np.ndarray, seq_lens: np.ndarray) -> int | None:
        """The captured size this step is padded to and replayed at, or None
        to run it eagerly: a graph covers a uniform decode step (one token per
        request) of no more requests than the largest size and, as in the
        classic runner, no context past `max_seq_len_to_capture` (vLLM V1's
        attention backends need no such cap)."""
        sizes = self.cudagraph_batch_sizes
        if (
            not self.graph_runners
            or (num_scheduled != 1).any()
            or len(num_scheduled) > sizes[-1]
            or seq_lens.max() > self.max_seq_len_to_capture
        ):
            return None
        return sizes[bisect.bisect_left(sizes, len(num_scheduled))]

    # -- 1. the persistent batch ------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        # Running but not scheduled this step (out of budget, or preempted):
        # out of the batch, state kept for when it comes back. A resumed
        # request is usually out already; one that `reset_prefix_cache`
        # preempted between two steps still has its row, with its old
        # blocks: out too, so it comes back below with its new ones.
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in [
            r for r in batch.req_id_to_index if r not in scheduled or r in cached.resumed_req_ids
        ]:
            batch.remove_request(req_id)

        reqs_to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None  # a random request with a seed draws from its own
            if params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator().manual_seed(params.seed)
            self.requests[new.req_id] = state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            if params.prompt_logprobs is not None:
                self.num_prompt_logprobs[new.req_id] = params.prompt_logprobs
            reqs_to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:  # back from preemption: a new set of blocks
                state.block_ids = list(new_block_ids)
            else:
                state.block_ids.extend(new_block_ids)
            if req_id in cached.all_token_ids:
                state.output_token_ids = cached.all_token_ids[req_id][len(state.prompt_token_ids) :]
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                reqs_to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
            batch.block_table.append_row(new_block_ids, row)

        for state in reqs_to_add:
            batch.add_request(state)
        batch.condense()
        self._reorder_batch(scheduled)

    def _reorder_batch(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Rows with several new tokens first, rows with one after."""
        batch = self.input_batch
        front, back = 0, batch.num_reqs - 1
        while front < back:
            if num_scheduled_tokens[batch.req_ids[front]] > 1:
                front += 1
            elif num_scheduled_tokens[batch.req_ids[back]] == 1:
                back -= 1
            else:
                batch.swap_states(front, back)

    # -- 2. the step's inputs -----------------------------------------------

    def _prepare_inputs(self, scheduler_output: SchedulerOutput):
        """(input_ids, positions, attn_metadata, logits_indices, sample_rows,
        graph_size): the model's tensors padded to `graph_size` rows when a
        CUDA graph runs the step (`_cudagraph_batch_size`; else None)."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # [num_reqs] tokens scheduled per row
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int64
        )
        cu_num_tokens = np.cumsum(num_scheduled)  # [num_reqs] end of each row's tokens
        # [num_tokens]: each token's row, and its offset within the row's new tokens
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(cu_num_tokens[-1]) - np.repeat(
            cu_num_tokens - num_scheduled, num_scheduled
        )
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = computed[req_indices] + offsets  # [num_tokens]
        input_ids = batch.token_ids_cpu[req_indices, positions]  # [num_tokens]
        slot_mapping = batch.block_table.compute_slot_mapping(req_indices, positions)

        seq_lens = computed + num_scheduled  # [num_reqs] tokens with K/V after the step
        self.last_inputs = StepInputs(
            list(batch.req_ids),
            num_scheduled,
            computed,
            input_ids,
            positions,
            slot_mapping,
        )
        num_prefills = int((num_scheduled > 1).sum())  # rows with several tokens come first
        # A row samples when the step reaches the end of its known tokens;
        # a prompt chunk that does not is computed, not sampled. (vLLM
        # samples every row and throws those tokens away.)
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        logits_indices = cu_num_tokens[sample_rows] - 1
        block_tables = batch.block_table.get_device_tensor(num_reqs, self.device)

        graph_size = self._cudagraph_batch_size(num_scheduled, seq_lens)
        if graph_size is not None:
            # Dummy requests after the real ones, as the classic runner's
            # `FlatBatch.padded_to`: token 0 at position 0, its K/V written
            # nowhere (PAD_SLOT_ID), a context of 1 token in the null block.
            pad = graph_size - num_reqs
            input_ids, positions = _pad(input_ids, pad, 0), _pad(positions, pad, 0)
            slot_mapping = _pad(slot_mapping, pad, PAD_SLOT_ID)
            seq_lens, computed = _pad(seq_lens, pad, 1), _pad(computed, pad, 0)
            block_tables = F.pad(block_tables, (0, 0, 0, pad))  # rows of block 0
            num_reqs = graph_size

        def as_tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(self.device)

        attn_metadata = self.attn_backend.get_metadata_cls()(
            num_prefills=num_prefills,
            num_prefill_tokens=int(num_scheduled[:num_prefills].sum()),
            num_decode_tokens=int(num_reqs - num_prefills),
            slot_mapping=as_tensor(slot_mapping),
            seq_lens=seq_lens.tolist(),
            context_lens=computed.tolist(),
            query_start_loc=[0, *cu_num_tokens[:num_prefills].tolist()],
            block_tables=block_tables,
            seq_lens_tensor=as_tensor(seq_lens),
            use_cuda_graph=graph_size is not None,
        )
        return (
            as_tensor(input_ids),
            as_tensor(positions),
            attn_metadata,
            logits_indices,
            sample_rows,
            graph_size,
        )

    # -- 3. run, sample, keep the tokens --------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last_inputs = None
        self._update_states(scheduler_output)
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        req_id_to_index = {req_id: i for i, req_id in enumerate(req_ids)}
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list = [None] * len(req_ids)
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(req_ids, req_id_to_index, sampled, logprobs)

        input_ids, positions, attn_metadata, logits_indices, sample_rows, graph_size = (
            self._prepare_inputs(scheduler_output)
        )
        forward = self.model_forward if graph_size is None else self.graph_runners[graph_size]
        with set_forward_context(
            attn_metadata, self.kv_caches, self.attn_layers, self.packed_layers
        ):
            # [num_tokens (padded), hidden_size]; a graph's output is its
            # buffer, valid until the next replay: read it within this step.
            hidden_states = forward(input_ids, positions, self.kv_caches, attn_metadata)
        # [num_sample_rows, vocab_size]
        logits = self.model.compute_logits(hidden_states[torch.from_numpy(logits_indices)])
        if len(sample_rows):
            tokens = self._sample(logits, sample_rows)
            self._add_logprobs(logits, sample_rows, tokens, logprobs)
            for row, token in zip(sample_rows.tolist(), tokens, strict=True):
                batch.append_token(row, token)
                sampled[row] = [token]
        prompt_logprobs_dict = self._get_prompt_logprobs_dict(
            hidden_states, scheduler_output.num_scheduled_tokens
        )
        return ModelRunnerOutput(
            req_ids, req_id_to_index, sampled, logprobs, prompt_logprobs_dict
        )

    def _sample(self, logits: torch.Tensor, sample_rows: np.ndarray) -> list[int]:
        """One token per sampling row, by V1's sampler."""
        metadata = self._step_sampling_metadata(sample_rows, logits.shape[-1])
        return self.sampler(logits, metadata).tolist()

    def _step_sampling_metadata(
        self, sample_rows: np.ndarray, vocab_size: int
    ) -> SamplingMetadata:
        """This step's sampling metadata: the last step's while the same
        requests sample from the same rows, as vLLM keeps its batch's
        sampling tensors until the batch changes (`InputBatch.refresh_metadata`).
        Only the min_tokens bans move with the outputs: renewed while any
        is in force (a ban, once lifted, stays lifted: the outputs only
        grow). The output lists it holds are the requests' own, which grow
        as tokens are appended (a request whose list is replaced, one back
        from preemption, comes back through `InputBatch.add_request`, which
        moves the version)."""
        key = (self.input_batch.version, sample_rows.tobytes())
        cached = self._cached_sampling
        if cached is None or cached[0] != key:
            metadata = self._sampling_metadata(sample_rows, vocab_size)
        elif any(cached[1].min_tokens_banned):
            metadata = replace(cached[1], min_tokens_banned=self._min_tokens_banned(sample_rows))
        else:
            return cached[1]
        self._cached_sampling = key, metadata
        return metadata

    def _min_tokens_banned(self, sample_rows: np.ndarray) -> list[list[int]]:
        """Per sampling row, the tokens that would end it before its min_tokens."""
        states = [self.input_batch.req_states[row] for row in sample_rows.tolist()]
        return [
            sorted(s.sampling_params.all_stop_token_ids)
            if len(s.output_token_ids) < s.sampling_params.min_tokens
            else []
            for s in states
        ]

    def _sampling_metadata(self, sample_rows: np.ndarray, vocab_size: int) -> SamplingMetadata:
        """The sampling rows' parameters, gathered from their requests (vLLM
        keeps them as tensors in the persistent batch). A stage no row uses
        is None."""
        states = [self.input_batch.req_states[row] for row in sample_rows.tolist()]
        params = [state.sampling_params for state in states]

        def per_row(values: list, dtype: torch.dtype = torch.float) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        def column(name: str) -> torch.Tensor:
            return per_row([getattr(p, name) for p in params])

        def stage(name: str, neutral: float) -> torch.Tensor | None:
            return column(name) if any(getattr(p, name) != neutral for p in params) else None

        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        penalized = any(penalizes(p) for p in params)
        return SamplingMetadata(
            temperature=per_row(temperature),
            greedy=per_row(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=per_row(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=stage("top_p", 1.0),
            min_p=stage("min_p", 0.0),
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            min_tokens_banned=self._min_tokens_banned(sample_rows),
            allowed_token_ids=[p.allowed_token_ids for p in params],
            logit_bias=[p.logit_bias for p in params],
            bad_words_token_ids={
                i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids
            },
            presence_penalties=column("presence_penalty") if penalized else None,
            frequency_penalties=column("frequency_penalty") if penalized else None,
            repetition_penalties=column("repetition_penalty") if penalized else None,
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
        )

    def _add_logprobs(
        self, logits: torch.Tensor, sample_rows: np.ndarray, tokens: list[int], logprobs: list
    ) -> None:
        """Logprobs for the rows that ask, from the model's raw logits (vLLM
        V1's default `logprobs_mode="raw_logprobs"`; the classic engine gives
        those of the processed distribution the token was drawn from)."""
        states = self.input_batch.req_states
        wanted = [
            i
            for i, row in enumerate(sample_rows.tolist())
            if states[row].sampling_params.logprobs is not None
        ]
        if not wanted:
            return
        raw = torch.log_softmax(logits[wanted].float(), dim=-1)
        entries = get_position_logprobs(
            raw,
            [tokens[i] for i in wanted],
            [states[sample_rows[i]].sampling_params.logprobs for i in wanted],
            rank_after_ties=True,
        )
        for i, entry in zip(wanted, entries, strict=True):
            logprobs[sample_rows[i]] = entry

    def _get_prompt_logprobs_dict(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        num_scheduled_tokens: dict[str, int],
    ) -> dict[str, list[PositionLogprobs]]:
        """The prompt logprobs of each request whose prompt this step
        finished (vLLM's method of the same name), from the raw logits as
        the sampled tokens' (`_add_logprobs`).

        Position p's logits predict prompt token p + 1. A chunk of positions
        [start, start + n) fills the entries of tokens start + 1 .. start + n,
        which the request keeps until its prompt is done; the chunk with the
        prompt's last token stops one position short, since that position
        predicts the first output token. A request preempted in its prompt
        starts again from position 0 and fills the same entries again.
        """
        completed: dict[str, list[PositionLogprobs]] = {}
        if not self.num_prompt_logprobs:
            return completed
        inputs = self.last_inputs
        query_starts = np.cumsum(inputs.num_scheduled_tokens) - inputs.num_scheduled_tokens
        query_start = dict(zip(inputs.req_ids, query_starts.tolist(), strict=True))
        for req_id, num_top in list(self.num_prompt_logprobs.items()):
            num_tokens = num_scheduled_tokens.get(req_id)
            if num_tokens is None:
                continue  # not scheduled this step (preempted, or out of budget)
            state = self.requests[req_id]
            prompt = state.prompt_token_ids
            if state.in_progress_prompt_logprobs is None:
                state.in_progress_prompt_logprobs = [None] * (len(prompt) - 1)
            start = state.num_computed_tokens
            num_remaining = len(prompt) - 1 - start  # positions still to fill
            num_logits = min(num_tokens, num_remaining)
            if num_logits > 0:
                offset = query_start[req_id]
                # [num_logits, vocab_size]
                logits = self.model.compute_logits(hidden_states[offset : offset + num_logits])
                entries = get_position_logprobs(
                    torch.log_softmax(logits.float(), dim=-1),
                    prompt[start + 1 : start + 1 + num_logits],
                    [num_top] * num_logits,
                    rank_after_ties=True,
                )
                state.in_progress_prompt_logprobs[start : start + num_logits] = entries
            if num_tokens > num_remaining:  # this chunk holds the prompt's last token
                completed[req_id] = state.in_progress_prompt_logprobs
                state.in_progress_prompt_logprobs = None
                del self.num_prompt_logprobs[req_id]
        return completed


def _pad(values: np.ndarray, pad: int, fill: int) -> np.ndarray:
    """`values` with `pad` entries of `fill` appended."""
    return np.concatenate([values, np.full(pad, fill, dtype=values.dtype)])
