"""Day 10's checkers (tools/labs/checks/day10.py) reject every catalogued
mistake with the message that names it, and pass the solution and a
differently written correct answer.

The answers are written here as plain functions and classes (tests never
import notebooks); each mistake is the solution with one thing changed.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import OrderedDict

import pytest

from minivllm.core.block_allocator import BlockAllocator, PhysicalTokenBlock
from tools.labs.checks import day10

# -- exercise 1: the hash chain and the lookup ------------------------------------------


def _hashes(*, not_chained=False, tokens_back=False, partial=False, drop_last=False,
            salted=False, summed=False):
    def full_block_hashes(token_ids, block_size):
        hashes, parent, previous = [], None, None
        stop = len(token_ids) if partial else len(token_ids) - block_size + (0 if drop_last else 1)
        for start in range(0, max(stop, 0), block_size):
            block = tuple(token_ids[start:start + block_size])
            key = sum(block) if summed else block
            if not_chained:
                h = hash(key)
            elif tokens_back:
                h = hash((previous, key))
            else:
                h = hash((parent, key))
            if salted:
                h = hash((h, random.random()))
            hashes.append(h)
            parent, previous = h, block
        return hashes

    return full_block_hashes


def _lookup(hashes, *, no_cap=False, short_cap=False, past_miss=False):
    def cached_prefix(token_ids, block_size, lookup):
        if no_cap:
            limit = len(token_ids) // block_size
        elif short_cap:
            limit = max(len(token_ids) // block_size - 1, 0)
        else:
            limit = (len(token_ids) - 1) // block_size
        found = []
        for h in hashes(token_ids, block_size)[:limit]:
            block = lookup(h)
            if block is None:
                if past_miss:
                    continue
                break
            found.append(block)
        return found

    return cached_prefix


def _hashes_other(token_ids, block_size):
    """Correct, written otherwise: sha256 digests of a running prefix digest."""
    out, digest = [], hashlib.sha256(b"root")
    for end in range(block_size, len(token_ids) + 1, block_size):
        digest = digest.copy()
        digest.update(",".join(map(str, token_ids[end - block_size:end])).encode() + b";")
        out.append(digest.digest())
    return out


def _lookup_other(token_ids, block_size, lookup):
    return list(itertools.takewhile(
        lambda block: block is not None,
        map(lookup, _hashes_other(token_ids, block_size)[:(len(token_ids) - 1) // block_size])))


@pytest.mark.parametrize("mistake, message", [
    ("not_chained", "your hashes are not chained"),
    ("tokens_back", "looks one block back only"),
    ("partial", "you hashed the partial last block"),
    ("drop_last", "you dropped the last full block"),
    ("salted", "two calls with the same tokens"),
    ("summed", "depend on the tokens themselves"),
])
def test_exercise_1_rejects_hash(mistake, message):
    hashes = _hashes(**{mistake: True})
    with pytest.raises(AssertionError, match=rf"Day 10, exercise 1: (.|\n)*{re.escape(message)}"):
        day10.exercise_1(hashes, _lookup(hashes))


@pytest.mark.parametrize("mistake, message", [
    ("no_cap", "the last token's logits"),
    ("short_cap", "you stopped too early"),
    ("past_miss", "you went on past a miss"),
])
def test_exercise_1_rejects_lookup(mistake, message):
    hashes = _hashes()
    with pytest.raises(AssertionError, match=rf"Day 10, exercise 1: (.|\n)*{re.escape(message)}"):
        day10.exercise_1(hashes, _lookup(hashes, **{mistake: True}))


def test_exercise_1_rejects_a_hash_that_is_not_hashable():
    def as_lists(token_ids, block_size):
        return [list(token_ids[:end]) for end in range(block_size, len(token_ids) + 1,
                                                        block_size)]

    with pytest.raises(AssertionError, match="must be hashable"):
        day10.exercise_1(as_lists, _lookup(as_lists))


@pytest.mark.parametrize("answer", ["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    if answer == "solution":
        day10.exercise_1(_hashes(), _lookup(_hashes()))
    else:
        day10.exercise_1(_hashes_other, _lookup_other)
    assert capsys.readouterr().out == "Day 10, exercise 1: passed\n"


# -- exercise 2: the cached allocator -------------------------------------------------


def _allocator(*, stale=False, keep_in_evictor=False, evict_first=False, mru=False,
               not_counted=False, no_ref=False, overwrite=False, keep_hash=False,
               ref_zero=False, forget_cached=False, release_all=False):
    class Allocator(BlockAllocator):
        def __init__(self, device, block_size, num_blocks):
            super().__init__(device, block_size, num_blocks)
            self.cached_blocks = {}
            self.evictor = OrderedDict()

        def lookup(self, block_hash):
            return self.cached_blocks.get(block_hash)

        def reuse(self, block):
            if block.ref_count == 0 and not keep_in_evictor:
                del self.evictor[block.block_hash]
            if not no_ref:
                block.ref_count += 1
            return block

        def allocate(self):
            if (self.free_block_numbers and not (evict_first and self.evictor)) \
                    or not self.evictor:
                return super().allocate()
            block_hash, victim = self.evictor.popitem(last=mru)
            if not stale:
                del self.cached_blocks[block_hash]
            if keep_hash or ref_zero:
                victim.ref_count = 0 if ref_zero else 1
                return victim
            return PhysicalTokenBlock(self.device, victim.block_number, self.block_size,
                                      ref_count=1)

        def _release(self, block):
            if forget_cached:
                self.free_block_numbers.append(block.block_number)
            elif release_all or self.cached_blocks.get(block.block_hash) is block:
                self.evictor[block.block_hash] = block
            else:
                self.free_block_numbers.append(block.block_number)

        def register(self, block):
            if overwrite:
                self.cached_blocks[block.block_hash] = block
            else:
                self.cached_blocks.setdefault(block.block_hash, block)

        def get_num_free_blocks(self):
            if not_counted:
                return len(self.free_block_numbers)
            return len(self.free_block_numbers) + len(self.evictor)

    return Allocator


class _OtherAllocator(BlockAllocator):
    """Correct, written otherwise: a last-use clock per free cached block, the
    victim found by min(); no OrderedDict."""

    def __init__(self, device, block_size, num_blocks):
        super().__init__(device, block_size, num_blocks)
        self.table: dict[int, PhysicalTokenBlock] = {}
        self.idle: dict[int, int] = {}  # hash -> when it was freed
        self.clock = itertools.count()

    def lookup(self, block_hash):
        return self.table.get(block_hash)

    def reuse(self, block):
        self.idle.pop(block.block_hash, None)
        block.ref_count += 1
        return block

    def allocate(self):
        if not self.free_block_numbers and self.idle:
            oldest = min(self.idle, key=self.idle.__getitem__)
            del self.idle[oldest]
            victim = self.table.pop(oldest)
            return PhysicalTokenBlock(self.device, victim.block_number, self.block_size,
                                      ref_count=1)
        return super().allocate()

    def _release(self, block):
        if block.block_hash is not None and self.table.get(block.block_hash) is block:
            self.idle[block.block_hash] = next(self.clock)
        else:
            super()._release(block)

    def register(self, block):
        if block.block_hash not in self.table:
            self.table[block.block_hash] = block

    def get_num_free_blocks(self):
        return super().get_num_free_blocks() + len(self.idle)


@pytest.mark.parametrize("mistake, message", [
    ("stale", "a stale hit"),
    ("keep_in_evictor", "double allocation"),
    ("evict_first", "evicting early throws away"),
    ("mru", "evict the LEAST recently used"),
    ("not_counted", "counts the never-used/wiped blocks AND the evictable cached ones"),
    ("no_ref", "reuse() must increment block.ref_count"),
    ("overwrite", "register() keeps the block already cached"),
    ("keep_hash", "must have block_hash None"),
    ("ref_zero", "ref_count 1"),
    ("forget_cached", "If your _release puts cached blocks on the free list"),
    ("release_all", "released like an uncached one"),
])
def test_exercise_2_rejects(mistake, message):
    with pytest.raises(AssertionError, match=rf"Day 10, exercise 2: (.|\n)*{re.escape(message)}"):
        day10.exercise_2(_allocator(**{mistake: True}))


@pytest.mark.parametrize("answer", [_allocator(), _OtherAllocator], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day10.exercise_2(answer)
    assert capsys.readouterr().out == "Day 10, exercise 2: passed\n"


def test_exercise_2_a_stale_entry_the_script_cannot_see_is_caught_in_the_engine():
    """Evicted blocks numbered 5 or more stay in the table: the script's pool
    has 5 blocks, the engine's 10; the engine run finds the stale hit."""

    class StaleAbove5(_allocator()):
        def allocate(self):
            if self.free_block_numbers or not self.evictor:
                return BlockAllocator.allocate(self)
            block_hash, victim = self.evictor.popitem(last=False)
            if victim.block_number < 5:
                del self.cached_blocks[block_hash]
            return PhysicalTokenBlock(self.device, victim.block_number, self.block_size,
                                      ref_count=1)

    with pytest.raises(AssertionError, match=r"exercise 2: StaleAbove5, inside the engine "
                                             r"\(requests one after another(.|\n)*a stale hit"):
        day10.exercise_2(StaleAbove5)


# -- exercise 3: measuring -------------------------------------------------------------


def _report(*, mean_rate=False, token_rate=False, every_chunk=False, first_only=False,
            with_decodes=False, none_crash=False, wrong_denominator=False, missing_zero=False):
    def prefix_cache_report(trace):
        queries = hits = prefill = 0
        rates = []
        cached = {} if missing_zero else {rid: 0 for rid in trace.requests}
        admitted = set()
        for step in trace.steps:
            cache = step["prefix_cache"]
            if none_crash or cache:
                queries += cache["queries"]
                hits += cache["hits"]
                if cache["queries"]:
                    rates.append(cache["hits"] / cache["queries"])
            waiting = set(step["queues_before"]["waiting"])
            seen = set()
            for e in step["scheduled"]:
                rid = e["request_id"]
                if e["is_prefill"] or with_decodes:
                    prefill += e["num_tokens"]
                if e["is_prefill"] and rid not in seen:
                    new = rid in waiting
                    found = e["positions"][0]
                    if (every_chunk or (new and not (first_only and rid in admitted))) \
                            and (found or not missing_zero):
                        cached[rid] = cached.get(rid, 0) + found
                        admitted.add(rid)
                seen.add(rid)
        total = sum(cached.values())
        prompt_tokens = sum(len(r["prompt_token_ids"]) for r in trace.requests.values())
        if mean_rate:
            rate = sum(rates) / len(rates) if rates else 0.0
        elif token_rate:
            rate = total / prompt_tokens
        else:
            rate = hits / queries if queries else 0.0
        if wrong_denominator:
            saved = total / prefill if prefill else 0.0
        else:
            saved = total / (total + prefill) if total + prefill else 0.0
        return {"queries": queries, "hits": hits, "hit_rate": rate, "cached_tokens": cached,
                "prefill_tokens": prefill, "saved_fraction": saved}

    return prefix_cache_report


def _report_other(trace):
    """Correct, written otherwise: from the tracer's lifecycles and run totals."""
    from minivllm.tracer.facts import run_totals

    totals = run_totals(trace)
    cached = {rid: life.prefix_cache_hit_tokens for rid, life in trace.lifecycles().items()}
    saved = sum(cached.values())
    q, h = totals.prefix_cache_queries, totals.prefix_cache_hits
    return {"queries": q, "hits": h, "hit_rate": h / q if q else 0,
            "cached_tokens": cached, "prefill_tokens": totals.prefill_tokens,
            "saved_fraction": saved / (saved + totals.prefill_tokens)}


@pytest.mark.parametrize("mistake, message", [
    ("mean_rate", "a mean of per-step or per-request rates"),
    ("token_rate", "hits / queries over the whole run"),
    ("every_chunk", "a later chunk of a chunked prompt"),
    ("first_only", "preempted by recompute is admitted again"),
    ("with_decodes", "decodes excluded"),
    ("none_crash", "is None when caching is off"),
    ("wrong_denominator", "cached / (cached + prefill_tokens)"),
    ("missing_zero", "0 if it found nothing"),
])
def test_exercise_3_rejects(mistake, message):
    with pytest.raises(AssertionError, match=rf"Day 10, exercise 3: (.|\n)*{re.escape(message)}"):
        day10.exercise_3(_report(**{mistake: True}))


@pytest.mark.parametrize("answer", [_report(), _report_other], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day10.exercise_3(answer)
    assert capsys.readouterr().out == "Day 10, exercise 3: passed\n"
