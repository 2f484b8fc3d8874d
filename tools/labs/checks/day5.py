"""Checkers for day 5, the block manager (labs/day5_block_manager.ipynb).

Each runs the learner's code beside the reference (core/block_allocator.py,
core/block_manager.py) and prints one line, or raises AssertionError saying
what was expected, what came back, and where to look.
"""

from __future__ import annotations

import functools
import os
import tempfile
import traceback

from minivllm import LLM, SamplingParams
from minivllm.core.block_allocator import BlockAllocator, Device, PhysicalTokenBlock
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.sequence import Sequence, SequenceGroup
from minivllm.tracer import load_trace
from tools.labs.checks._common import passed
from tools.labs.checks._engine_runs import (
    Run,
    StepLimit,
    check_in_engine,
    compare_runs,
    component_of,
    learner_code,
    passes_through,
    quiet_engine,
    run_traced,
    token_prompts,
)

DAY = 5


# -- exercise 1: a free list ---------------------------------------------------


def _script(alloc, doing: list[str] | None = None) -> list:
    """A fixed sequence of allocations, shares and frees; what each returns.
    `doing` receives the name of each operation as it starts."""
    log = []
    doing = [] if doing is None else doing
    doing.append("allocate() three times")
    a, b, c = alloc.allocate(), alloc.allocate(), alloc.allocate()
    log.append(("allocate x3", [a.block_number, b.block_number, c.block_number]))
    log.append(("ref counts", [a.ref_count, b.ref_count, c.ref_count]))
    log.append(("free blocks", alloc.get_num_free_blocks()))
    doing.append("free(b)")
    alloc.free(b)
    log.append(("free(b): free blocks", alloc.get_num_free_blocks()))
    doing.append("allocate() after free(b)")
    d = alloc.allocate()
    log.append(("allocate after free(b)", d.block_number))
    a.ref_count += 1  # a second sequence maps block a (what fork does)
    doing.append("free(a) with a.ref_count == 2")
    alloc.free(a)
    log.append(("shared a, free(a) once: free blocks", alloc.get_num_free_blocks()))
    log.append(("shared a, free(a) once: a.ref_count", a.ref_count))
    doing.append("free(a) again, its last reference")
    alloc.free(a)
    log.append(("free(a) again: free blocks", alloc.get_num_free_blocks()))
    doing.append("free(c), then allocate() twice")
    alloc.free(c)
    e, f = alloc.allocate(), alloc.allocate()
    log.append(("allocate x2 after free(a), free(c)", [e.block_number, f.block_number]))
    return log


# What each line of the script's log tests: the hint when it differs.
_STACK = (
    "the free list is a stack, not a queue: allocate() takes the most recently freed block "
    "(pop() from the end, where free() appends)"
)
_SCRIPT_HINTS = {
    "allocate x3": "a fresh pool hands out block 0 first, then 1, 2, ...: keep the free block "
    "numbers as [n-1, ..., 1, 0] and pop() from the end",
    "ref counts": "a new block starts with ref_count 1: one sequence maps it",
    "free blocks": "get_num_free_blocks() is the length of the free list",
    "free(b): free blocks": "free() of a block with ref_count 1 puts it back on the free list",
    "allocate after free(b)": _STACK,
    "shared a, free(a) once: free blocks": "a shared block (ref_count 2) stays in use after one "
    "free(): it goes back on the free list only when its count reaches 0",
    "shared a, free(a) once: a.ref_count": "free() drops one reference (ref_count -= 1, not "
    "ref_count = 0)",
    "free(a) again: free blocks": "the second free() of a drops its last reference: now it is "
    "free",
    "allocate x2 after free(a), free(c)": _STACK,
}


def _script_hint(ref_log: list, got_log: list, what: str) -> str:
    """The hint for the first differing line; resetting the count to 0 is
    told apart from appending a block that is still shared."""
    if what == "shared a, free(a) once: free blocks" and dict(got_log).get(
        "shared a, free(a) once: a.ref_count"
    ) == 0:
        what = "shared a, free(a) once: a.ref_count"
    return _SCRIPT_HINTS[what]


def exercise_1(allocator_cls) -> None:
    """The learner's allocator against core/block_allocator.py::BlockAllocator."""
    ref_log = _script(BlockAllocator(Device.GPU, 16, 5))
    with learner_code(f"{allocator_cls.__name__}"):
        mine = allocator_cls(Device.GPU, 16, 5)
        block = mine.allocate()
    assert isinstance(block, PhysicalTokenBlock), (
        f"allocate() should return a PhysicalTokenBlock (the engine reads its block_number, "
        f"ref_count and device), got {type(block).__name__}"
    )
    assert block.ref_count == 1, (
        f"a new block starts with ref_count 1 (one sequence maps it); yours has "
        f"{block.ref_count}. Hint: PhysicalTokenBlock(device, number, block_size, ref_count=1)."
    )
    with learner_code(f"{allocator_cls.__name__}"):
        mine.free(block)
    with learner_code(f"{allocator_cls.__name__}"):
        mine, doing = allocator_cls(Device.GPU, 16, 5), []
    try:
        got_log = _script(mine, doing)
    except Exception as error:  # noqa: BLE001 - reported to the learner
        if passes_through(error):  # a verdict, or an unfinished exercise
            raise
        raise AssertionError(
            f"On a pool of 5 blocks, {allocator_cls.__name__} raised {type(error).__name__}: "
            f"{error} during '{doing[-1]}' (steps so far: {doing}). Hint: free() of a shared "
            "block (ref_count 2) only drops one reference (ref_count -= 1, not ref_count = 0); "
            "the block is free, and may be freed no more, only once the count reaches 0."
        ) from error
    for (what, expected), (_, got) in zip(ref_log, got_log, strict=True):
        assert got == expected, (
            f"With a pool of 5 blocks, after '{what}' the reference gives {expected}, yours "
            f"{got}.\nHint: {_script_hint(ref_log, got_log, what)} (lesson section 2; the "
            "reference is core/block_allocator.py::BlockAllocator)."
        )
    with learner_code(f"{allocator_cls.__name__}"):
        full = allocator_cls(Device.CPU, 16, 2)
        x = full.allocate()
        full.allocate()
        assert x.device == Device.CPU, "a block should remember its allocator's device"
    try:
        full.allocate()
    except ValueError:
        pass
    except Exception as error:  # noqa: BLE001 - reported to the learner
        raise AssertionError(
            f"allocate() on an empty pool raised {type(error).__name__}: {error}. It should "
            "raise ValueError('Out of memory'): test for an empty free list first, rather than "
            "let pop() fail."
        ) from error
    else:
        raise AssertionError(
            "allocate() on an empty pool should raise ValueError (out of memory): the block "
            "manager asks can_allocate/can_append_slots first, so this is a bug, not a wait"
        )
    with learner_code(f"{allocator_cls.__name__}"):
        full.free(x)
    try:
        full.free(x)
    except ValueError:
        pass
    except Exception as error:  # noqa: BLE001 - reported to the learner
        raise AssertionError(
            f"free() of a block whose ref_count is already 0 raised {type(error).__name__}: "
            f"{error}. It should raise ValueError (a double free): test ref_count == 0 first."
        ) from error
    else:
        raise AssertionError(
            "free() of a block whose ref_count is already 0 should raise ValueError (a double "
            "free): silently putting it on the free list twice would hand one block to two "
            "sequences"
        )
    passed(DAY, 1)


# -- exercise 2: slots -----------------------------------------------------------


_SLOT_CRASH = (
    "position p is in logical block p // block_size: index the table as "
    "block_table[p // block_size], never with p itself"
)


def _call(fn, *args, hint: str = ""):
    """The learner's function on `args`, an exception becoming a hint."""
    shown = ", ".join(map(repr, args))
    with learner_code(f"your `{fn.__name__}({shown})`", hint):
        got = fn(*args)
    assert got is not None, f"{fn.__name__}({shown}) returned None: did you forget the `return`?"
    return got


def exercise_2(num_blocks_needed, slot_mapping) -> None:
    """Block counts and slot numbers, against the slots the engine wrote in a trace."""
    for n, bs, want in [(1, 16, 1), (16, 16, 1), (17, 16, 2), (40, 16, 3), (0, 16, 0), (9, 4, 3)]:
        got = _call(num_blocks_needed, n, bs)
        hint = (
            "at an exact multiple of block_size the last block is full, not one more: "
            "(num_tokens + block_size - 1) // block_size"
            if got == want + 1 and n % bs == 0 else
            "a partly filled block still takes a whole block (round up)"
        )
        assert got == want, (
            f"num_blocks_needed({n}, block_size={bs}) should be {want}, got {got}. Hint: {hint}."
        )
    got = list(_call(slot_mapping, [7, 2, 9], [0, 3, 4, 11], 4, hint=_SLOT_CRASH))
    hint = (
        "you used the logical block number instead of the physical one: the block table maps "
        "logical block p // block_size to physical block block_table[p // block_size]"
        if got == [0, 3, 4, 11] else
        "position p lives in logical block p // block_size at offset p % block_size; the "
        "block table maps the logical block to a physical one, and the slot is "
        "block_table[p // block_size] * block_size + p % block_size"
    )
    assert got == [28, 31, 8, 39], (
        f"slot_mapping([7, 2, 9], positions=[0, 3, 4, 11], block_size=4) should be "
        f"[28, 31, 8, 39], got {got}. Hint: {hint} (lesson section 3)."
    )
    run = _slot_run()
    for step in run.trace.steps:
        for entry in step["scheduled"]:
            table = step["block_tables"].get(str(entry["seq_id"]))
            if table is None:
                continue  # finished in this step: its blocks are already freed
            got = list(_call(slot_mapping, table, entry["positions"], run.trace.block_size,
                             hint=_SLOT_CRASH))
            assert got == entry["slot_mapping"], (
                f"In step {step['step']} of a traced run, request {entry['request_id']} "
                f"(block table {table}) wrote positions {entry['positions']} to slots "
                f"{entry['slot_mapping']}; your slot_mapping gives {got}"
            )
    passed(DAY, 2)


@functools.lru_cache(maxsize=1)
def _slot_run() -> Run:
    return run_traced(
        token_prompts([5, 12, 9], request_stride=5),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        dry_run=True,
        block_size=4,
        num_gpu_blocks_override=9,
    )


# -- exercises 3 and 4: a block manager inside the engine ---------------------------

_HINTS = {
    "block_tables": "A table grows by one block when the next token starts a new block "
    "(token i lives in logical block i // block_size), keeps the order in which the blocks "
    "were allocated, and disappears when the sequence is freed. Forked sequences start with the "
    "same blocks (shared, ref_count > 1), and a write into a shared last block copies it "
    "first (copy-on-write).",
    "free_blocks": "More free blocks in the reference means yours leaks: a finished or "
    "preempted sequence must give every block back (free() decrements each block's "
    "ref_count). Fewer in the reference means yours frees too much, or allocates too little.",
    "copy": "The copy list holds (src, dst) pairs of copy-on-write: when a sequence is about "
    "to write into a last block it shares (ref_count > 1), it gets a fresh block, the old "
    "one loses a reference, and (old, new) is returned from append_slots.",
    "scheduled": "The scheduler admits and preempts by asking the block manager: if batches "
    "differ, your free-block count differs, or can_allocate/can_append_slots see wrong "
    "ref counts.",
    "queues_after": "Requests moved between queues differently: check that allocate gives a "
    "prompt all the blocks it needs and that free returns them all.",
    "preempted": "Preemptions differ: the cache filled up at a different step, which "
    "usually means blocks were leaked or over-allocated earlier.",
}


def _raised_in(error: BaseException, function: str) -> bool:
    """Is `function` (a method of the engine, or the learner's) on the exception's way?"""
    return any(frame.name == function for frame in traceback.extract_tb(error.__traceback__))


def _engine_hint(error: BaseException) -> str:
    """The likely mistake behind an exception from inside the engine."""
    text = str(error)
    if isinstance(error, TypeError) and "NoneType" in text:
        if _raised_in(error, "_schedule_running") or _raised_in(error, "_schedule_swapped"):
            return (
                "append_slots returns the list of copy-on-write pairs (src, dst) the worker "
                "must copy: `return []` when there is none"
            )
        return (
            "your allocate returned None: it returns how many leading tokens of the prompt "
            "are already computed (found in the prefix cache); with no prefix caching here, "
            "`return 0`"
        )
    if isinstance(error, KeyError) and _raised_in(error, "free"):
        return (
            f"free is also called for sequences that never got blocks (seq {error} is a "
            "prompt ignored because it can never fit, or a sequence already freed): "
            "self.block_tables.pop(seq.seq_id, None), and return if there was no table"
        )
    if "free_blocks.gpu is" in text and "more than the" in text:
        return (
            "the device pool has more free blocks than it holds: your free returned CPU blocks "
            "to the device allocator. A swapped sequence's table holds CPU blocks "
            "(block.device == Device.CPU), which go back to self.cpu_allocator"
        )
    if "that seqs lacks" in text:
        return (
            "a finished or preempted sequence still has a block table: free(seq) must give "
            "its blocks back and forget the table (self.block_tables.pop(seq.seq_id))"
        )
    if isinstance(error, IndexError) and _raised_in(error, "build"):
        return (
            "a block table is shorter than its sequence: allocate gives a prompt seq.n_blocks "
            "blocks (ceil(len / block_size)), and append_slots appends a block when the next "
            "token opens a new block (len(table) < seq.n_blocks), before any copy-on-write"
        )
    manager = component_of(error, BlockSpaceManager)
    if "Double free" in text and manager is not None:
        tables = list(manager.block_tables.values())
        if len({id(t) for t in tables}) < len(tables):
            return (
                "two sequences hold the same list as their block table: fork must give the "
                "child a copy of the parent's table (.copy()), or a block appended or "
                "replaced in one appears in the other"
            )
        return (
            "a block lost more references than it had: every sequence that maps a block "
            "holds one reference, so in fork every block gains a reference (ref_count += 1), "
            "and allocate sets ref_count to the number of waiting sequences"
        )
    return (
        "'Out of memory' from the allocator means a block was taken that the scheduler did "
        "not plan for (append_slots allocates only when len(table) < seq.n_blocks, or to copy "
        "a shared last block). 'Double free' means a block lost more references than it had: "
        "does every sequence that maps a block hold one reference (allocate, fork)?"
    )


def _closer_hint(field: str, want, have) -> str | None:
    """A closer hint for the first differing decision, when its values show the mistake."""
    if field == "block_tables":
        stale = [s for s in have if s not in want]
        if stale:
            return (
                f"seq {stale[0]} still has a block table after it finished or was preempted: "
                "free(seq) must give its blocks back and forget the table "
                "(self.block_tables.pop(seq.seq_id))"
            )
        longer = [s for s in want if s in have and len(have[s]) > len(want[s])]
        if longer:
            return (
                f"seq {longer[0]}'s table grew by a block although its next token still fits "
                "its last block: append_slots allocates only when len(table) < seq.n_blocks "
                "(seq.n_blocks already counts the newest token)"
            )
        # As many blocks as the reference's, but other ones: the free list
        # handed them out in another order, which the order of free decides.
        if have.keys() == want.keys() and all(len(have[s]) == len(want[s]) for s in want):
            other = [s for s in want if sorted(have[s]) != sorted(want[s])]
            if other:
                return (
                    f"seq {other[0]}'s table has as many blocks as the reference's but other "
                    "ones: blocks left the free list in another order. allocate hands out the "
                    "block freed last (the free list is a stack), so the order in which free "
                    "gives a table's blocks back decides which blocks come next. The reference "
                    "frees a table's blocks first to last (`for block in block_table`). Another "
                    "order would run just as well, but this checker compares block numbers with "
                    "the reference's step by step: free them first to last"
                )
    if field == "free_blocks" and have["gpu"] > want["gpu"] and have["cpu"] < want["cpu"]:
        return (
            "your free returned CPU blocks to the device allocator: a swapped sequence's table "
            "holds CPU blocks (block.device == Device.CPU), which go back to self.cpu_allocator"
        )
    if field == "copy":
        if have == [pair[::-1] for pair in want]:
            return (
                "each copy is a pair (src, dst) = (the shared block, the new one): yours are "
                "the other way round"
            )
        if len(have) > len(want):
            return (
                "more copies than the reference: copy only a shared last block (ref_count > 1) "
                "that the next token writes into; a block of your own is written in place, and "
                "once a copy is made the old block loses a reference (free it), so the last "
                "sequence left on it writes without copying"
            )
    return None


def _check_in_engine(cls, label: str, prompts, params, dry_run: bool, **engine) -> Run:
    got = check_in_engine(
        "block_manager_cls", cls, label, prompts, params, dry_run,
        hints=_HINTS, error_hint=_engine_hint, agreed="every block table agreed",
        refine_hint=_closer_hint, **engine,
    )
    _all_given_back(got.llm, label)
    return got


def _all_given_back(llm: LLM, label: str) -> None:
    """Once every request is done, every block of both pools is free."""
    bm = llm.llm_engine.scheduler.block_manager
    gpu, cpu = bm.get_num_free_gpu_blocks(), bm.get_num_free_cpu_blocks()
    assert gpu <= bm.num_total_gpu_blocks and cpu == bm.num_total_cpu_blocks, (
        f"{label}: at the end the device pool has {gpu} free blocks of "
        f"{bm.num_total_gpu_blocks} and the CPU pool {cpu} of {bm.num_total_cpu_blocks}. "
        "Hint: your free returned CPU blocks to the device allocator: a swapped sequence's "
        "table holds CPU blocks (block.device == Device.CPU), which go back to "
        "self.cpu_allocator."
    )
    total = bm.num_total_gpu_blocks
    assert not bm.block_tables and gpu == total, (
        f"{label}: once every request finished, all {total} device blocks should be free and "
        f"no block table left; yours has {gpu} free and tables for "
        f"seqs {sorted(bm.block_tables)}. Hint: free(seq) must release every block of the "
        "sequence's table, and forget the table."
    )


# Three prompts growing from 40 to 80 tokens in 12 blocks of 16: the third is
# swapped out, and aborted while it is swapped (its table holds CPU blocks).
ABORT_LENGTHS = [40, 40, 40]
ABORT_ENGINE = dict(block_size=16, num_gpu_blocks_override=12, preemption_mode="swap",
                    swap_space=0.01)


def _run_aborting_swapped(cls: type | None) -> Run:
    """Run the abort workload (with the learner's block manager, or the
    reference's); the first request found swapped after a step is aborted."""
    options = {} if cls is None else {"block_manager_cls": cls}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp, quiet_engine():
        path = os.path.join(tmp, "run.jsonl")
        llm = LLM(dry_run=True, trace=path, disable_log_stats=True, **ABORT_ENGINE, **options)
        engine = llm.llm_engine
        engine.add_step_observer(StepLimit(200))
        for i, prompt in enumerate(token_prompts(ABORT_LENGTHS)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        finished, aborted = {}, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if not aborted and engine.scheduler.swapped:
                engine.abort_request(engine.scheduler.swapped[0].request_id)
                aborted = True
        engine.stop_trace()
        trace = load_trace(path)
    assert aborted, "this workload should swap a request out"
    outs = [finished[rid] for rid in sorted(finished)]
    return Run(
        outputs=[[tuple(c.token_ids) for c in o.outputs] for o in outs],
        texts=[[c.text for c in o.outputs] for o in outs],
        trace=trace,
        llm=llm,
    )


def _check_abort_of_swapped(cls) -> None:
    label = "dry run, a request aborted while swapped out (its blocks are in the CPU pool)"
    ref = _run_aborting_swapped(None)
    with learner_code(f"{cls.__name__}, inside the engine ({label}),", _engine_hint):
        got = _run_aborting_swapped(cls)
    compare_runs(ref, got, label, _HINTS, agreed="every block table agreed",
                 refine_hint=_closer_hint)
    _all_given_back(got.llm, label)


_SHARE = (
    "the sequences of one group hold the same prompt, so they share its blocks: allocate takes "
    "seq.n_blocks blocks once, sets each one's ref_count to the number of waiting sequences, "
    "and gives every waiting sequence its own copy of that one list (vLLM's block manager does "
    "the same)"
)


def _check_waiting_group(cls) -> None:
    """allocate and free of a group whose two sequences wait together. The
    engine makes no such group (a prompt forks after its prefill, and a
    forked group is swapped out, never recomputed), so the checker builds
    one and asks the learner's block manager directly."""
    label = (
        "a group whose 2 sequences wait together (one 20-token prompt, blocks of 16, "
        "8 device blocks), asked directly"
    )
    seqs = [Sequence(seq_id, None, token_prompts([20])[0], 16) for seq_id in (0, 1)]
    group = SequenceGroup("0", seqs, SamplingParams(n=2, temperature=1.0), arrival_time=0.0)
    with learner_code(f"{cls.__name__}.allocate, on {label},", _engine_hint):
        manager = cls(block_size=16, num_gpu_blocks=8, num_cpu_blocks=8)
        manager.allocate(group)
    tables = [manager.block_tables.get(seq.seq_id) for seq in seqs]
    assert None not in tables, (
        f"{label}: after allocate, seq {tables.index(None)} has no block table.\n"
        f"Hint: {_SHARE}."
    )
    numbers = [[block.block_number for block in table] for table in tables]
    assert numbers[0] == numbers[1] and len(numbers[0]) == 2, (
        f"{label}: allocate gave seq 0 blocks {numbers[0]} and seq 1 blocks {numbers[1]}; "
        f"both should map the same 2 blocks.\nHint: {_SHARE}."
    )
    assert tables[0] is not tables[1], (
        f"{label}: both sequences hold the same list as their block table: a block appended "
        "to one would appear in the other.\nHint: give each waiting sequence its own copy "
        "of the list (block_table.copy())."
    )
    counts = [block.ref_count for block in tables[0]]
    assert counts == [2, 2], (
        f"{label}: the shared blocks have ref_count {counts}; each should have 2.\nHint: "
        "every sequence that maps a block holds one reference (free drops one): set each "
        "new block's ref_count to the number of waiting sequences, len(waiting)."
    )
    with learner_code(f"{cls.__name__}.free, on {label},", _engine_hint):
        for seq in seqs:
            manager.free(seq)
    free = manager.get_num_free_gpu_blocks()
    assert free == 8 and not manager.block_tables, (
        f"{label}: after free of both sequences, {free} of 8 blocks are free and tables are "
        f"left for seqs {sorted(manager.block_tables)}; all 8 should be free and no table left."
        "\nHint: free drops one reference to each block of the sequence's table; the block "
        "is free once the last sequence that maps it is freed."
    )


STORY_PROMPTS = ["Once upon a time", "The little dog", "Tom and Mia went to"]


def exercise_3(block_manager_cls) -> None:
    """allocate / append_slots / free of single sequences, under memory pressure;
    then allocate of a group whose sequences wait together."""
    if not issubclass(block_manager_cls, BlockSpaceManager):
        raise AssertionError("the block manager must subclass BlockSpaceManager")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _check_in_engine(
        block_manager_cls,
        "dry run, four prompts on block boundaries, 64 blocks of 16 (no pressure)",
        token_prompts([16, 17, 31, 5]),
        SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
        dry_run=True,
        block_size=16,
        num_gpu_blocks_override=64,
    )
    # Prompts on and around block boundaries (16, 17, 31); 12 blocks cannot
    # hold them all at full length: RECOMPUTE preemptions, then SWAP ones.
    # The 200-token prompt can never fit: it is ignored, and freed unallocated.
    lengths = [40, 16, 17, 31, 5, 40, 200]
    for mode in ("recompute", "swap"):
        _check_in_engine(
            block_manager_cls,
            f"dry run, seven prompts (one too long for the cache), 12 blocks of 16, "
            f"preemption by {mode}",
            token_prompts(lengths),
            greedy,
            dry_run=True,
            block_size=16,
            num_gpu_blocks_override=12,
            preemption_mode=mode,
            swap_space=0.01,
        )
    _check_abort_of_swapped(block_manager_cls)
    _check_in_engine(
        block_manager_cls,
        "the story model, three prompts, 8 blocks of 8",
        STORY_PROMPTS,
        SamplingParams(temperature=0, max_tokens=20),
        dry_run=False,
        block_size=8,
        num_gpu_blocks_override=8,
    )
    # Every run above admits one sequence per group: the shared prompt
    # blocks of a larger group are checked on their own.
    _check_waiting_group(block_manager_cls)
    passed(DAY, 3)


def exercise_4(block_manager_cls) -> None:
    """fork and copy-on-write: parallel sampling (n > 1), under memory pressure."""
    if not issubclass(block_manager_cls, BlockSpaceManager):
        raise AssertionError("the block manager must subclass BlockSpaceManager")
    _check_in_engine(
        block_manager_cls,
        "dry run, n=2 and n=3, 32 blocks of 16",
        token_prompts([20, 40, 32]),
        [
            SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=14, ignore_eos=True),
            SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=12, ignore_eos=True),
            SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True),
        ],
        dry_run=True,
        block_size=16,
        num_gpu_blocks_override=32,
    )
    _check_in_engine(
        block_manager_cls,
        "dry run, n=2, 12 blocks of 16 (forked groups preempt by SWAP)",
        token_prompts([40, 16, 31]),
        SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True),
        dry_run=True,
        block_size=16,
        num_gpu_blocks_override=12,
        swap_space=0.01,
    )
    _check_in_engine(
        block_manager_cls,
        "the story model, n=2, seeded, 8 blocks of 8",
        STORY_PROMPTS[:2],
        SamplingParams(n=2, temperature=0.8, seed=0, max_tokens=12),
        dry_run=False,
        block_size=8,
        num_gpu_blocks_override=8,
    )
    passed(DAY, 4)
