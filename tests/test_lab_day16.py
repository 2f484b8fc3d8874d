"""Day 16's checkers (tools/labs/checks/day16.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions and classes (tests never
import notebooks); each mistake is the solution with one thing changed.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import re
import sys

import pytest

from minivllm.v1.core.kv_cache_utils import NONE_HASH, KVCacheBlock
from tools.labs.checks import day16

# -- exercise 1: the chained block hash -------------------------------------------------


def _hash_solution(*, not_chained=False, tokens_only=False, partial=False, drop_last=False,
                   no_extra=False, python_hash=False, digits=False, salted=False):
    def hash_block(parent, parent_tokens, token_ids, extra_keys):
        if no_extra:
            extra_keys = None
        if not_chained:
            parent = None
        if tokens_only:
            parent = tuple(parent_tokens)
        if python_hash:
            return hash((parent, tuple(token_ids), extra_keys))
        body = "".join(map(str, token_ids)) if digits else tuple(token_ids)
        salt = random.random() if salted else 0
        payload = pickle.dumps((parent or NONE_HASH, body, extra_keys, salt), protocol=5)
        return hashlib.sha256(payload).digest()

    def hash_request_tokens(block_size, token_ids, extra_keys=None):
        hashes, parent, previous = [], None, ()
        stop = len(token_ids) if partial else len(token_ids) - block_size + (0 if drop_last else 1)
        for start in range(0, max(stop, 0), block_size):
            block = token_ids[start:start + block_size]
            parent = hash_block(parent, previous, block, extra_keys)
            previous = block
            hashes.append(parent)
        return hashes

    return hash_request_tokens


def _hash_alternative(block_size, token_ids, extra_keys=None):
    """Correct, written otherwise: blake2b over the parent and a repr, by a while loop."""
    out, parent = [], b"root"
    i = block_size
    while i <= len(token_ids):
        digest = hashlib.blake2b(parent)
        digest.update(repr((token_ids[i - block_size:i], extra_keys)).encode())
        parent = digest.digest()
        out.append(parent)
        i += block_size
    return out


@pytest.mark.parametrize("mistake, message", [
    ("not_chained", "your hashes are not chained"),
    ("tokens_only", "looks only one block back"),
    ("partial", "you hashed the partial last block"),
    ("drop_last", "you dropped the last block"),
    ("no_extra", "the extra keys must go into every block's hash"),
    ("python_hash", "Python's hash() gives 64 bits"),
    ("digits", "your encoding of the tokens is ambiguous"),
    ("salted", "two calls with the same tokens"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=rf"Day 16, exercise 1: (.|\n)*{_re(message)}"):
        day16.exercise_1(_hash_solution(**{mistake: True}))


def _re(text: str) -> str:
    return re.escape(text)


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_hash_solution(), _hash_alternative],
                         ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day16.exercise_1(answer)
    assert capsys.readouterr().out == "Day 16, exercise 1: passed\n"


# -- exercise 2: the free queue ----------------------------------------------------------


def _queue_class(*, head_append=False, stack_pop=False, remove_no_count=False,
                 append_no_count=False, no_unlink=False, popleft_n_short=False,
                 no_check=False, walk_reversed=False, append_n_reversed=False,
                 prepend_n_reversed=False, prepend_n_at_tail=False):
    class Queue:
        def __init__(self, blocks):
            self.num_free_blocks = len(blocks)
            self.head, self.tail = KVCacheBlock(-1), KVCacheBlock(-1)
            chain = [self.head, *blocks, self.tail]
            for prev, nxt in zip(chain, chain[1:], strict=False):
                prev.next_free_block, nxt.prev_free_block = nxt, prev

        def popleft(self):
            block = self.tail.prev_free_block if stack_pop else self.head.next_free_block
            if block in (self.head, self.tail) and not no_check:
                raise ValueError("empty")
            self.remove(block)
            return block

        def popleft_n(self, n):
            if n > self.num_free_blocks and not no_check:
                raise ValueError("too many")
            return [self.popleft() for _ in range(n - 1 if popleft_n_short and n else n)]

        def remove(self, block):
            if not no_unlink:
                block.prev_free_block.next_free_block = block.next_free_block
                block.next_free_block.prev_free_block = block.prev_free_block
            block.prev_free_block = block.next_free_block = None
            if not remove_no_count:
                self.num_free_blocks -= 1

        def append(self, block):
            if head_append:
                first = self.head.next_free_block
                self.head.next_free_block, block.prev_free_block = block, self.head
                block.next_free_block, first.prev_free_block = first, block
            else:
                last = self.tail.prev_free_block
                last.next_free_block, block.prev_free_block = block, last
                block.next_free_block, self.tail.prev_free_block = self.tail, block
            if not append_no_count:
                self.num_free_blocks += 1

        def append_n(self, blocks):
            for block in (list(blocks)[::-1] if append_n_reversed else blocks):
                self.append(block)

        def prepend_n(self, blocks):
            if prepend_n_at_tail:
                self.append_n(blocks)
                return
            for block in (blocks if prepend_n_reversed else list(blocks)[::-1]):
                first = self.head.next_free_block
                self.head.next_free_block, block.prev_free_block = block, self.head
                block.next_free_block, first.prev_free_block = first, block
                self.num_free_blocks += 1

        def get_all_free_blocks(self):
            out = []
            if walk_reversed:
                block = self.tail.prev_free_block
                while block is not self.head:
                    out.append(block)
                    block = block.prev_free_block
                return out
            block = self.head.next_free_block
            while block is not self.tail:
                out.append(block)
                block = block.next_free_block
            return out

    return Queue


class _DictQueue:
    """Correct, written otherwise: a dict keeps insertion order, and deleting
    a key is O(1) too."""

    def __init__(self, blocks):
        self._blocks = {b.block_id: b for b in blocks}

    @property
    def num_free_blocks(self):
        return len(self._blocks)

    def popleft(self):
        return self._blocks.pop(next(iter(self._blocks)))

    def popleft_n(self, n):
        if n > len(self._blocks):
            raise ValueError(n)
        return [self.popleft() for _ in range(n)]

    def remove(self, block):
        del self._blocks[block.block_id]

    def append(self, block):
        self._blocks[block.block_id] = block

    def append_n(self, blocks):
        self._blocks.update((b.block_id, b) for b in blocks)

    def prepend_n(self, blocks):
        self._blocks = {**{b.block_id: b for b in blocks}, **self._blocks}

    def get_all_free_blocks(self):
        return list(self._blocks.values())


@pytest.mark.parametrize("mistake, message", [
    ("head_append", "a freed block goes to the TAIL"),
    ("stack_pop", "popleft takes the HEAD"),
    ("remove_no_count", "num_free_blocks must follow every change (popleft takes one away)"),
    ("append_no_count", "num_free_blocks must follow every change (append adds one)"),
    ("no_unlink", "the removed block's neighbours must point at each other"),
    ("popleft_n_short", "popleft_n(n) hands out exactly n blocks, here 3, not 2"),
    ("no_check", "should raise ValueError"),
    ("walk_reversed", "yours lists it tail first"),
    ("append_n_reversed", "append_n appends the blocks in the order given"),
    ("prepend_n_reversed", "prepend_n puts the blocks at the HEAD, in the order given"),
    ("prepend_n_at_tail", "prepend_n puts the blocks at the HEAD, in the order given"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day16.exercise_2(_queue_class(**{mistake: True}))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_queue_class(), _DictQueue], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day16.exercise_2(answer)
    assert capsys.readouterr().out == "Day 16, exercise 2: passed\n"


# -- exercise 3: by hand ----------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    ({"tail_first": False}, "LAST block first"),
    ({"freed_to_tail": False}, "freed blocks that are cached join the TAIL"),
    ({"uncached_to_head": False}, "goes to the HEAD of the queue, not the tail"),
    ({"null_in_queue": True}, "block 0 is the null block"),
    ({"cap": False}, "at most num_tokens - 1 tokens come from the cache"),
    ({"evict": False}, "is evicted: its hash is forgotten"),
])
def test_exercise_3_rejects(flags, message):
    queue, hits = day16.simulate_scenario(**flags)
    with pytest.raises(AssertionError, match=_re(message)):
        day16.exercise_3(queue, hits)


def test_exercise_3_rejects_hits_in_blocks():
    queue, hits = day16.simulate_scenario()
    with pytest.raises(AssertionError, match="the hits are in TOKENS"):
        day16.exercise_3(queue, {k: v // day16.BLOCK_SIZE for k, v in hits.items()})


def test_exercise_3_says_what_differs_on_a_guess():
    with pytest.raises(AssertionError, match=r"the free queue after C should be (.|\n)*walk it"):
        day16.exercise_3(list(range(9, 0, -1)), {"D": 4, "E": 4, "F": 16})


def test_exercise_3_passes(capsys):
    day16.exercise_3([2, 1, 4, 3, 9, 8, 7, 6, 5], {"D": 4, "E": 4, "F": 16})
    assert capsys.readouterr().out == "Day 16, exercise 3: passed\n"


def test_exercise_3_passes_answers_worked_out_with_the_rules(capsys):
    """Any way of getting the answer will do, e.g. a simulation of the rules."""
    day16.exercise_3(*day16.simulate_scenario())
    assert capsys.readouterr().out == "Day 16, exercise 3: passed\n"


# -- exercise 4: what crosses the wire ----------------------------------------------------


def _tap(*, getsizeof=False, original_in=False, original_out=False, per_request=False,
         skip_empty=False, outputs_only=False, no_abort=False):
    class Tap:
        def __init__(self, client):
            self.client = client
            self.sent, self.received = [], []

        def add_request(self, request):
            payload = pickle.dumps(request)
            self.sent.append(sys.getsizeof(request) if getsizeof else len(payload))
            self.client.add_request(request if original_in else pickle.loads(payload))

        def get_output(self):
            outputs = self.client.get_output()
            payload = pickle.dumps(outputs)
            if per_request:
                self.received.extend(len(pickle.dumps(o)) for o in outputs.outputs)
            elif outputs_only:
                self.received.append(len(pickle.dumps(outputs.outputs)))
            elif not (skip_empty and not outputs.outputs):
                self.received.append(len(payload))
            return outputs if original_out else pickle.loads(payload)

        def reset_prefix_cache(self, reset_running_requests=False):
            return self.client.reset_prefix_cache(reset_running_requests)

        def shutdown(self):
            self.client.shutdown()

    if not no_abort:
        Tap.abort_requests = lambda self, ids: self.client.abort_requests(ids)
    return Tap


class _DelegatingTap:
    """Correct, written otherwise: everything else passed on by __getattr__,
    one helper for both directions."""

    def __init__(self, client):
        self.client, self.sent, self.received = client, [], []

    def _cross(self, obj, sizes):
        data = pickle.dumps(obj, protocol=pickle.DEFAULT_PROTOCOL)
        sizes.append(len(data))
        return pickle.loads(data)

    def add_request(self, request):
        self.client.add_request(self._cross(request, self.sent))

    def get_output(self):
        return self._cross(self.client.get_output(), self.received)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ("getsizeof", "sys.getsizeof counts a Python object's own header"),
    ("original_in", "the engine core received the very EngineCoreRequest"),
    ("original_out", "the front end got the engine core's own"),
    ("per_request", "you counted one per request"),
    ("skip_empty", "even one with no news"),
    ("outputs_only", "pickle the whole EngineCoreOutputs"),
    ("no_abort", "pass those on to the client"),
])
def test_exercise_4_rejects(mistake, message):
    with pytest.raises(AssertionError, match=_re(message)):
        day16.exercise_4(_tap(**{mistake: True}))


@pytest.mark.slow
@pytest.mark.parametrize("answer", [_tap(), _DelegatingTap], ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day16.exercise_4(answer)
    assert capsys.readouterr().out == "Day 16, exercise 4: passed\n"


@pytest.mark.slow
def test_no_text_crosses():
    """The lesson's claim: the prompt's and the output's text are in no message."""
    llm = day16.v1_llm()
    tap = _RecordingTap(llm.llm_engine.engine_core)
    llm.llm_engine.engine_core = tap
    (out,) = llm.generate(["Once upon a time"], day16.greedy(6), use_tqdm=False)
    assert out.outputs[0].text.strip()
    assert not day16.text_in(tap.payloads, [out.prompt, out.outputs[0].text.strip()])


class _RecordingTap(_DelegatingTap):
    def __init__(self, client):
        super().__init__(client)
        self.payloads = []

    def _cross(self, obj, sizes):
        self.payloads.append(pickle.dumps(obj))
        return super()._cross(obj, sizes)
