"""Day 12's checkers (tools/labs/checks/day12.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions (tests never import
notebooks); each mistake is the solution with one thing changed. No test
compares a timing: the checkers compare groupings of given events, sums of
given numbers, and counts of operator calls.
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from minivllm.model_executor.sampling_metadata import SamplingMetadata
from minivllm.worker.model_runner import FlatBatch, ModelInput
from tools.labs.checks import day12


def _rejects(k: int, message: str):
    return pytest.raises(AssertionError, match=rf"Day 12, exercise {k}:(.|\n)*{re.escape(message)}")


# -- exercise 1: where one step's time goes ------------------------------------------------


def _time_by_part(*, total=False, outermost=False, ops_only=False, labelled_only=False,
                  matmul_anywhere=False, matmul_op_only=False, shares=False, ms=False,
                  wrong_key=False):
    def time_by_part(events):
        parts = dict.fromkeys(day12.PARTS, 0.0)
        for event in events:
            if ops_only and not event.name.startswith("aten::"):
                continue
            part, e, in_matmul = None, event, False
            while e is not None:
                if e.name in day12.MATMUL_OPS and (e is event or not matmul_op_only):
                    in_matmul = True
                if e.name in day12.LABELS:
                    if e.name == "step" and outermost:
                        break
                    part = {"attention": "attention", "sampler": "sampling",
                            "model": "matmul" if in_matmul else "model_other"}.get(
                                e.name, "bookkeeping")
                    if not outermost:
                        break
                e = e.cpu_parent
            if labelled_only and part in (None, "bookkeeping") and \
                    day12.innermost_label(event) in (None, "step"):
                continue
            if matmul_anywhere and event.name in day12.MATMUL_OPS:
                part = "matmul"
            time = event.cpu_time_total if total else event.self_cpu_time_total
            parts[part or "bookkeeping"] += time / 1000 if ms else time
        if shares:
            whole = sum(parts.values())
            parts = {k: v / whole for k, v in parts.items()}
        if wrong_key:
            parts["sampler"] = parts.pop("sampling")
        return parts

    return time_by_part


def _time_by_part_other(events):
    """Correct, written otherwise: from the roots down, each event's own
    time computed as its total minus its children's totals."""
    parts = defaultdict(float)

    def visit(event, part):
        if event.name == "attention":
            part = "attention"
        elif event.name == "sampler":
            part = "sampling"
        elif event.name == "model":
            part = "model_other"
        elif event.name in ("step", "schedule", "prepare_inputs", "process"):
            part = "bookkeeping"
        elif part == "model_other" and event.name in day12.MATMUL_OPS:
            part = "matmul"
        children = list(event.cpu_children)
        parts[part] += event.cpu_time_total - sum(c.cpu_time_total for c in children)
        for child in children:
            visit(child, part)

    for root in (e for e in events if e.cpu_parent is None):
        visit(root, "bookkeeping")
    return {part: parts[part] for part in ("matmul", "attention", "model_other", "sampling",
                                           "bookkeeping")}


@pytest.mark.parametrize("mistake, message", [
    ("total", "you added up TOTAL times"),
    ("outermost", "to its OUTERMOST label"),
    ("ops_only", "dropped the labels' own self time"),
    ("labelled_only", "you dropped the events under no label but `step`"),
    ("matmul_anywhere", "including the ones inside `attention` and `sampler`"),
    ("matmul_op_only", "not what they call"),
    ("shares", "you returned shares"),
    ("ms", "you returned milliseconds"),
    ("wrong_key", "it must return exactly ['matmul', 'attention'"),
])
def test_exercise_1_rejects(mistake, message):
    with _rejects(1, message):
        day12.exercise_1(_time_by_part(**{mistake: True}))


def test_exercise_1_rejects_none():
    with _rejects(1, "should return a dict from part name to microseconds"):
        day12.exercise_1(lambda events: None)


@pytest.mark.parametrize("answer", [_time_by_part(), _time_by_part_other],
                         ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day12.exercise_1(answer)
    assert capsys.readouterr().out == "Day 12, exercise 1: passed\n"


def test_made_up_profile_adds_up():
    events = day12.made_up_profile()
    (root,) = [e for e in events if e.cpu_parent is None]
    parts = day12.reference_time_by_part(events)
    assert sum(parts.values()) == root.cpu_time_total
    assert all(parts[k] > 0 for k in day12.PARTS)


# -- exercise 2: decode throughput ----------------------------------------------------------


def _throughput(*, steps_per_s=False, mean_of_rates=False, ms=False, execute=False,
                requests=False, with_mixed=False, with_empty=False):
    def decode_throughput(steps):
        tokens, seconds, rates = defaultdict(int), defaultdict(float), defaultdict(list)
        for step in steps:
            entries = step["scheduled"]
            prefill = any(e["is_prefill"] for e in entries)
            if (prefill and not with_mixed) or (not entries and not with_empty):
                continue
            batch = len({e["request_id"] for e in entries}) if requests else len(entries)
            time = step["timings"]["execute_ms"] if execute else sum(step["timings"].values())
            time = time if ms else time / 1000
            made = 1 if steps_per_s else step["num_batched_tokens"]
            tokens[batch] += made
            seconds[batch] += time
            if time:
                rates[batch].append(made / time)
        if mean_of_rates:
            return {b: sum(r) / len(r) for b, r in rates.items()}
        return {b: tokens[b] / seconds[b] if seconds[b] else float("inf") for b in tokens}

    return decode_throughput


def _throughput_other(steps):
    """Correct, written otherwise: filter first, then group with setdefault."""
    decodes = [s for s in steps if s["scheduled"] and
               all(not e["is_prefill"] for e in s["scheduled"])]
    groups = {}
    for s in decodes:
        groups.setdefault(s["num_batched_tokens"], []).append(s)
    return {b: sum(s["num_batched_tokens"] for s in g)
            / (sum(sum(s["timings"].values()) for s in g) / 1e3) for b, g in groups.items()}


@pytest.mark.parametrize("mistake, message", [
    ("steps_per_s", "you computed steps per second"),
    ("mean_of_rates", "you averaged the per-step rates"),
    ("ms", "the trace's timings are milliseconds"),
    ("execute", "you counted only execute_ms"),
    ("requests", "you took the batch size as the number of requests"),
    ("with_mixed", "you kept the steps that also prefill a prompt"),
    ("with_empty", "a step that scheduled nothing"),
])
def test_exercise_2_rejects(mistake, message):
    with _rejects(2, message):
        day12.exercise_2(_throughput(**{mistake: True}))


def test_exercise_2_rejects_a_list():
    with _rejects(2, "should return a dict from batch size to tokens per second"):
        day12.exercise_2(lambda steps: [1.0, 2.0])


@pytest.mark.parametrize("answer", [_throughput(), _throughput_other], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day12.exercise_2(answer)
    assert capsys.readouterr().out == "Day 12, exercise 2: passed\n"


# -- exercise 3: CUDA-graph padding and the step-time model ---------------------------------


def _graph_batch_size(*, pow2=False, round_down=False, no_four=False, no_cap=False,
                      ignore_max_num_seqs=False):
    def pad(n):
        if n <= 2 or (no_four and n < 8 and not pow2):
            return n
        if pow2:
            return 1 << (n - 1).bit_length()
        if n <= 4:
            return 4
        return n // 8 * 8 if round_down else (n + 7) // 8 * 8

    def graph_batch_size(batch, max_num_seqs=256):
        largest = 256 if ignore_max_num_seqs else min(pad(max_num_seqs), 256)
        if no_cap or batch <= largest:
            return pad(batch)
        return None

    return graph_batch_size


def _graph_batch_size_other(batch, max_num_seqs=256):
    """Correct, written otherwise: search vLLM's list of captured sizes."""
    sizes = [1, 2, 4] + list(range(8, 257, 8))
    limit = next(s for s in sizes + [256] if s >= min(max_num_seqs, 256))
    return next((s for s in sizes if s >= batch and s <= limit), None) if batch <= limit else None


def _decode_step_us(*, additive=False, weights_per_seq=False, launch_per_seq=False,
                    graph_always=False, graph_still_launches=False, no_context=False):
    def decode_step_us(batch, context_len, cost, cuda_graphs, max_num_seqs=256):
        weights = cost.weight_bytes * (batch if weights_per_seq else 1)
        kv = batch * (1 if no_context else context_len) * cost.kv_bytes_per_token
        gpu = (weights + kv) / cost.bandwidth_bytes_per_us
        graph = cuda_graphs and (graph_always or
                                 day12.reference_graph_batch_size(batch, max_num_seqs) is not None)
        launches = cost.num_kernels * cost.launch_us * (batch if launch_per_seq else 1)
        if graph:
            cpu = cost.graph_launch_us + (launches if graph_still_launches else 0)
        else:
            cpu = launches
        return cpu + gpu if additive else max(cpu, gpu)

    return decode_step_us


def _decode_step_us_other(batch, context_len, cost, cuda_graphs, max_num_seqs=256):
    """Correct, written otherwise: in seconds, then back to µs."""
    bandwidth = cost.bandwidth_bytes_per_us * 1e6
    memory_s = cost.weight_bytes / bandwidth + batch * context_len * cost.kv_bytes_per_token \
        / bandwidth
    graph = _graph_batch_size_other(batch, max_num_seqs)
    launch_s = (cost.graph_launch_us if cuda_graphs and graph else
                cost.launch_us * cost.num_kernels) / 1e6
    return 1e6 * (memory_s if memory_s > launch_s else launch_s)


@pytest.mark.parametrize("mistake, message", [
    ("pow2", "not powers of two"),
    ("round_down", "pad UP to the next captured size"),
    ("no_four", "graphs exist only for 1, 2, 4 and multiples of 8"),
    ("no_cap", "no graph is captured for 257 sequences"),
    ("ignore_max_num_seqs", "up to 8 (max_num_seqs=6 padded"),
])
def test_exercise_3_rejects_padding(mistake, message):
    with _rejects(3, message):
        day12.exercise_3(_graph_batch_size(**{mistake: True}), _decode_step_us())


@pytest.mark.parametrize("mistake, message", [
    ("additive", "you added the CPU's launch time to the GPU's time"),
    ("weights_per_seq", "you read the weights once per sequence"),
    ("launch_per_seq", "you launched the kernels once per sequence"),
    ("graph_always", "you used a graph for every batch"),
    ("graph_still_launches", "the CPU launches ONE graph"),
    ("no_context", "each sequence reads the K/V of its whole context"),
])
def test_exercise_3_rejects_step_time(mistake, message):
    with _rejects(3, message):
        day12.exercise_3(_graph_batch_size(), _decode_step_us(**{mistake: True}))


@pytest.mark.parametrize("answers", [(_graph_batch_size(), _decode_step_us()),
                                     (_graph_batch_size_other, _decode_step_us_other)],
                         ids=["solution", "other"])
def test_exercise_3_passes(answers, capsys):
    day12.exercise_3(*answers)
    assert capsys.readouterr().out == "Day 12, exercise 3: passed\n"


def test_graphs_pay_at_small_batch_only():
    cost = day12.H100_1B
    small = [day12.reference_decode_step_us(1, 1000, cost, g) for g in (False, True)]
    large = [day12.reference_decode_step_us(256, 1000, cost, g) for g in (False, True)]
    assert small[0] > 1.5 * small[1] and large[0] == large[1]


# -- exercise 4: the planted slowdown ------------------------------------------------------


def _prepare(*, keep_table_loop=False, keep_slot_loop=False, pad_minus_one=False,
             slots_are_positions=False, int32=False, no_padding=False, per_row_tensors=False,
             fixed_width=False, no_batch=False):
    def prepare_model_input(self, seq_group_metadata_list):
        batch = FlatBatch.build(seq_group_metadata_list, self.block_size)
        max_blocks = max(len(t) for t in batch.block_tables)
        dtype = torch.int32 if int32 else torch.long

        def as_tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=self.device)

        width = 128 // self.block_size if fixed_width else max_blocks
        pad = -1 if pad_minus_one else 0
        if keep_table_loop:
            block_tables = torch.zeros(len(batch.block_tables), width, dtype=torch.long)
            for row, table in enumerate(batch.block_tables):
                block_tables[row, :len(table)] = as_tensor(table)
        elif per_row_tensors:
            block_tables = pad_sequence([as_tensor(t) for t in batch.block_tables],
                                        batch_first=True)
        elif no_padding:
            block_tables = as_tensor(batch.block_tables)
        else:
            block_tables = as_tensor([t + [pad] * (width - len(t)) for t in batch.block_tables],
                                     dtype)
        if keep_slot_loop:
            slot_mapping = torch.empty(len(batch.positions), dtype=torch.long)
            token = 0
            for row, (start, end) in enumerate(zip(batch.context_lens, batch.seq_lens,
                                                   strict=True)):
                for p in range(start, end):
                    slot_mapping[token] = (block_tables[row, p // self.block_size]
                                           * self.block_size + p % self.block_size)
                    token += 1
        elif slots_are_positions:
            slot_mapping = as_tensor(batch.positions)
        else:
            slot_mapping = as_tensor(batch.slot_mapping, dtype)
        attn_metadata = self.attn_backend.get_metadata_cls()(
            num_prefills=batch.num_prefills,
            num_prefill_tokens=batch.num_prefill_tokens,
            num_decode_tokens=len(batch.input_ids) - batch.num_prefill_tokens,
            slot_mapping=slot_mapping,
            seq_lens=batch.seq_lens,
            context_lens=batch.context_lens,
            query_start_loc=batch.query_start_loc,
            block_tables=block_tables,
            seq_lens_tensor=as_tensor(batch.seq_lens),
        )
        sampling_metadata = SamplingMetadata.prepare(
            seq_group_metadata_list, batch.seq_lens, batch.context_lens, self.device)
        return ModelInput(
            input_ids=as_tensor(batch.input_ids),
            positions=as_tensor(batch.positions),
            attn_metadata=attn_metadata,
            selected_token_indices=sampling_metadata.selected_token_indices,
            batch=None if no_batch else batch,
            sampling_metadata=sampling_metadata,
        )

    return prepare_model_input


def _prepare_other(self, seq_group_metadata_list):
    """Correct, written otherwise: vectorised tensor code whose number of
    calls does not depend on the batch (one scatter for the tables, the
    slots gathered from them)."""
    batch = FlatBatch.build(seq_group_metadata_list, self.block_size)
    lengths = [len(t) for t in batch.block_tables]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    cols = torch.arange(sum(lengths)) - torch.repeat_interleave(starts, torch.tensor(lengths))
    block_tables = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    block_tables[rows, cols] = torch.tensor([b for t in batch.block_tables for b in t])
    counts = torch.tensor(batch.seq_lens) - torch.tensor(batch.context_lens)
    token_rows = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    positions = torch.tensor(batch.positions)
    slot_mapping = (block_tables[token_rows, positions // self.block_size] * self.block_size
                    + positions % self.block_size)
    sampling_metadata = SamplingMetadata.prepare(
        seq_group_metadata_list, batch.seq_lens, batch.context_lens, self.device)
    attn_metadata = self.attn_backend.get_metadata_cls()(
        num_prefills=batch.num_prefills, num_prefill_tokens=batch.num_prefill_tokens,
        num_decode_tokens=len(batch.input_ids) - batch.num_prefill_tokens,
        slot_mapping=slot_mapping, seq_lens=batch.seq_lens, context_lens=batch.context_lens,
        query_start_loc=batch.query_start_loc, block_tables=block_tables,
        seq_lens_tensor=torch.tensor(batch.seq_lens))
    return ModelInput(torch.tensor(batch.input_ids), positions, attn_metadata,
                      sampling_metadata.selected_token_indices, batch, sampling_metadata)


@pytest.mark.parametrize("mistake, message", [
    ("keep_table_loop", "still making torch calls per SEQUENCE"),
    ("keep_slot_loop", "still making torch calls per TOKEN"),
    ("per_row_tensors", "still making torch calls per SEQUENCE"),
    ("pad_minus_one", "pad with block 0"),
    ("slots_are_positions", "slot_mapping differs from the engine's"),
    ("int32", "has dtype torch.int32"),
    ("no_padding", "torch.tensor needs rows of one length"),
    ("fixed_width", "pads each table to the LONGEST table"),
    ("no_batch", "is not the FlatBatch"),
])
def test_exercise_4_rejects(mistake, message):
    with _rejects(4, message):
        day12.exercise_4(_prepare(**{mistake: True}))


def test_exercise_4_rejects_the_slow_copy_itself():
    with _rejects(4, "still making torch calls per TOKEN"):
        day12.exercise_4(day12.slow_prepare_model_input)


def test_exercise_4_keeps_the_engine_alive_after_a_wrong_answer(capsys):
    with pytest.raises(AssertionError):
        day12.exercise_4(_prepare(int32=True))
    llm = day12.shared_llm()
    assert not llm.llm_engine.errored
    assert "prepare_model_input" not in vars(llm.llm_engine.worker.model_runner)
    day12.exercise_4(_prepare())
    assert capsys.readouterr().out == "Day 12, exercise 4: passed\n"


def test_exercise_4_passes_another_correct_answer(capsys):
    day12.exercise_4(_prepare_other)
    assert capsys.readouterr().out == "Day 12, exercise 4: passed\n"


def test_exercise_4_an_unfinished_answer_says_so():
    def unfinished(self, seq_group_metadata_list):
        raise NotImplementedError("Day 12, exercise 4")

    with pytest.raises(NotImplementedError):
        day12.exercise_4(unfinished)
    assert not day12.shared_llm().llm_engine.errored


def test_the_engines_own_prepare_calls_torch_a_fixed_number_of_times():
    counts = day12.one_thread(day12.count_prepare_calls)(day12.shared_llm())
    assert set(counts.decode.values()) == set(counts.prefill.values()) == {24}
