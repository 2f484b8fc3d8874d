"""Day 5's checkers (tools/labs/checks/day5.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

Each mistake is a flag on a copy of the solution (solutions/day5_block_manager.ipynb),
written here: tests never import notebooks.
"""

from __future__ import annotations

import collections
import re

import pytest

from minivllm.core.block_allocator import Device, PhysicalTokenBlock
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.sequence import SequenceStatus
from tools.labs.checks import day5

# -- exercise 1: the allocator -----------------------------------------------------------


def _allocator(*, fifo=False, highest_first=False, ref_zero_on_free=False,
               always_append=False, no_double_free_check=False, no_oom_check=False,
               starts_at_zero=False):
    class MyBlockAllocator:
        def __init__(self, device, block_size, num_blocks):
            self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
            if fifo:
                self.free_block_numbers = collections.deque(range(num_blocks))
            elif highest_first:
                self.free_block_numbers = list(range(num_blocks))
            else:
                self.free_block_numbers = list(reversed(range(num_blocks)))

        def allocate(self):
            if not self.free_block_numbers and not no_oom_check:
                raise ValueError("Out of memory")
            number = (self.free_block_numbers.popleft() if fifo
                      else self.free_block_numbers.pop())
            return PhysicalTokenBlock(self.device, number, self.block_size,
                                      ref_count=0 if starts_at_zero else 1)

        def free(self, block):
            if block.ref_count == 0 and not no_double_free_check:
                raise ValueError("Double free")
            if ref_zero_on_free:
                block.ref_count = 0
            else:
                block.ref_count -= 1
            if block.ref_count == 0 or always_append:
                self.free_block_numbers.append(block.block_number)

        def get_num_free_blocks(self):
            return len(self.free_block_numbers)

    return MyBlockAllocator


class _AlternativeAllocator:
    """Correct, written otherwise: a set of used numbers and a stack."""

    def __init__(self, device, block_size, num_blocks):
        self.device, self.block_size = device, block_size
        self.stack = [num_blocks - 1 - i for i in range(num_blocks)]

    def allocate(self):
        try:
            number = self.stack.pop()
        except IndexError:
            raise ValueError("Out of memory") from None
        return PhysicalTokenBlock(device=self.device, block_number=number,
                                  block_size=self.block_size, ref_count=1)

    def free(self, block):
        if block.ref_count < 1:
            raise ValueError("Double free")
        block.ref_count = block.ref_count - 1
        if not block.ref_count:
            self.stack += [block.block_number]

    def get_num_free_blocks(self):
        return len(self.stack)


@pytest.mark.parametrize("mistake, message", [
    ("fifo", "a stack, not a queue"),
    ("highest_first", "a fresh pool hands out block 0 first"),
    ("ref_zero_on_free", "ref_count -= 1, not ref_count = 0"),
    ("always_append", "only when its count reaches 0"),
    ("no_double_free_check", "a double free"),
    ("no_oom_check", "raised IndexError"),
    ("starts_at_zero", "a new block starts with ref_count 1"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day5.exercise_1(_allocator(**{mistake: True}))


@pytest.mark.parametrize("answer", [_allocator(), _AlternativeAllocator],
                         ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day5.exercise_1(answer)
    assert capsys.readouterr().out == "Day 5, exercise 1: passed\n"


# -- exercise 2: block counts and slots ----------------------------------------------------


def _blocks(n, bs, *, floor=False, plus_one=False):
    if floor:
        return n // bs
    if plus_one:
        return n // bs + 1
    return (n + bs - 1) // bs


def _slots(table, positions, bs, *, logical=False, by_position=False, none=False):
    if none:
        return None
    if logical:
        return [(p // bs) * bs + p % bs for p in positions]
    if by_position:
        return [table[p] * bs + p % bs for p in positions]
    return [table[p // bs] * bs + p % bs for p in positions]


@pytest.mark.parametrize("blocks, slots, message", [
    ({"floor": True}, {}, "round up"),
    ({"plus_one": True}, {}, "exact multiple"),
    ({}, {"logical": True}, "the logical block number instead of the physical one"),
    ({}, {"by_position": True}, "block_table[p // block_size]"),
    ({}, {"none": True}, "did you forget the `return`?"),
])
def test_exercise_2_rejects(blocks, slots, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day5.exercise_2(lambda n, bs: _blocks(n, bs, **blocks),
                        lambda t, p, bs: _slots(t, p, bs, **slots))


def _alternative_slots(block_table, positions, block_size):
    out = []
    for position in positions:
        block, offset = divmod(position, block_size)
        out.append(block_table[block] * block_size + offset)
    return out


@pytest.mark.parametrize("blocks, slots", [
    (_blocks, _slots),
    (lambda n, bs: -(-n // bs), _alternative_slots),
], ids=["solution", "other"])
def test_exercise_2_passes(blocks, slots, capsys):
    day5.exercise_2(blocks, slots)
    assert capsys.readouterr().out == "Day 5, exercise 2: passed\n"


# -- exercise 3: the block manager -----------------------------------------------------------


def _manager(*, no_return=False, le=False, cpu_to_gpu=False, keep_table=False,
             strict_free=False, round_down=False, append_no_return=False, own_blocks=False,
             one_list=False, ref_one=False, reversed_free=False):
    class MyBlockManager(BlockSpaceManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gpu_allocator = _allocator()(Device.GPU, self.block_size,
                                              self.num_total_gpu_blocks)
            self.cpu_allocator = _allocator()(Device.CPU, self.block_size,
                                              self.num_total_cpu_blocks)

        def allocate(self, seq_group):
            waiting = seq_group.get_seqs(SequenceStatus.WAITING)
            n = waiting[0].get_len() // self.block_size if round_down else waiting[0].n_blocks
            if own_blocks:  # each waiting sequence its own blocks: nothing shared
                for seq in waiting:
                    self.block_tables[seq.seq_id] = [self.gpu_allocator.allocate()
                                                     for _ in range(n)]
                return 0
            block_table = []
            for _ in range(n):
                block = self.gpu_allocator.allocate()
                if not ref_one:
                    block.ref_count = len(waiting)
                block_table.append(block)
            for seq in waiting:
                self.block_tables[seq.seq_id] = block_table if one_list else block_table.copy()
            if not no_return:
                return 0

        def append_slots(self, seq):
            block_table = self.block_tables[seq.seq_id]
            if (len(block_table) <= seq.n_blocks) if le else (len(block_table) < seq.n_blocks):
                block_table.append(self.gpu_allocator.allocate())
            if not append_no_return:
                return []

        def free(self, seq):
            if strict_free:
                block_table = self.block_tables.pop(seq.seq_id)
            elif keep_table:
                block_table = self.block_tables.get(seq.seq_id)
            else:
                block_table = self.block_tables.pop(seq.seq_id, None)
            if block_table is None:
                return
            for block in reversed(block_table) if reversed_free else block_table:
                if cpu_to_gpu or block.device == Device.GPU:
                    self.gpu_allocator.free(block)
                else:
                    self.cpu_allocator.free(block)

    return MyBlockManager


class _AlternativeManager(BlockSpaceManager):
    """Correct, written otherwise: pools looked up by device, a list comprehension."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpu_allocator = _AlternativeAllocator(Device.GPU, self.block_size,
                                                   self.num_total_gpu_blocks)
        self.cpu_allocator = _AlternativeAllocator(Device.CPU, self.block_size,
                                                   self.num_total_cpu_blocks)

    def allocate(self, seq_group):
        waiting = seq_group.get_seqs(SequenceStatus.WAITING)
        shared = [self.gpu_allocator.allocate() for _ in range(waiting[0].n_blocks)]
        for block in shared:
            block.ref_count = len(waiting)
        self.block_tables.update({seq.seq_id: list(shared) for seq in waiting})
        return 0

    def append_slots(self, seq):
        table = self.block_tables[seq.seq_id]
        while len(table) < seq.n_blocks:
            table.append(self.gpu_allocator.allocate())
        return []

    def free(self, seq):
        if seq.seq_id not in self.block_tables:
            return
        pools = {Device.GPU: self.gpu_allocator, Device.CPU: self.cpu_allocator}
        for block in self.block_tables.pop(seq.seq_id):
            pools[block.device].free(block)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("no_return", "`return 0`"),
    ("le", "len(table) < seq.n_blocks"),
    ("cpu_to_gpu", "CPU blocks to the device allocator"),
    ("keep_table", "forget the table"),
    ("strict_free", "never got blocks"),
    ("round_down", "seq.n_blocks"),
    ("append_no_return", "append_slots returns the list of copy-on-write pairs"),
    # The engine never admits a group of several waiting sequences: the
    # checker asks allocate about one directly.
    ("own_blocks", "both should map the same 2 blocks"),
    ("one_list", "the same list as their block table"),
    ("ref_one", "the shared blocks have ref_count [1, 1]"),
    # Correct in itself, but it hands out other blocks than the reference:
    # the message says so rather than blaming how tables grow.
    ("reversed_free", "the order in which free gives a table's blocks back"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day5.exercise_3(_manager(**{mistake: True}))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_manager(), _AlternativeManager], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day5.exercise_3(answer)
    assert capsys.readouterr().out == "Day 5, exercise 3: passed\n"


# -- exercise 4: fork and copy-on-write ----------------------------------------------------------


def _forking(*, alias=False, no_incref=False, no_free_old=False, reversed_pair=False,
             copy_when_unshared=False, no_len_check=False):
    class MyForkingBlockManager(_manager()):
        def fork(self, parent, child):
            parent_table = self.block_tables[parent.seq_id]
            block_table = parent_table if alias else parent_table.copy()
            if not no_incref:
                for block in block_table:
                    block.ref_count += 1
            self.block_tables[child.seq_id] = block_table

        def append_slots(self, seq):
            block_table = self.block_tables[seq.seq_id]
            last = block_table[-1]
            shared = last.ref_count > (0 if copy_when_unshared else 1)
            if (no_len_check or len(block_table) == seq.n_blocks) and shared:
                new = self.gpu_allocator.allocate()
                block_table[-1] = new
                if not no_free_old:
                    self.gpu_allocator.free(last)
                pair = (new.block_number, last.block_number) if reversed_pair else (
                    last.block_number, new.block_number)
                return [pair]
            return super().append_slots(seq)

    return MyForkingBlockManager


class _AlternativeForking(_AlternativeManager):
    """Correct, written otherwise: list() for the copy, the new block first."""

    def fork(self, parent, child):
        self.block_tables[child.seq_id] = list(self.block_tables[parent.seq_id])
        for block in self.block_tables[child.seq_id]:
            block.ref_count = block.ref_count + 1

    def append_slots(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(table) < seq.n_blocks:
            return super().append_slots(seq)
        old = table[-1]
        if old.ref_count == 1:
            return []
        table[-1] = self.gpu_allocator.allocate()
        self.gpu_allocator.free(old)
        return [(old.block_number, table[-1].block_number)]


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("alias", "the same list"),
    ("no_incref", "every block gains a reference"),
    ("no_free_old", "the old block loses a reference"),
    ("reversed_pair", "(src, dst)"),
    ("copy_when_unshared", "only a shared last block"),
    ("no_len_check", "opens a new block"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day5.exercise_4(_forking(**{mistake: True}))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_forking(), _AlternativeForking], ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day5.exercise_4(answer)
    assert capsys.readouterr().out == "Day 5, exercise 4: passed\n"
