"""Checkers for day 10, prefix caching in the classic engine
(labs/day10_prefix_caching.ipynb).

Every engine here is the classic one on the shipped model, greedy, with
`enable_prefix_caching=True` and a tiny KV cache of blocks of 4 tokens. A
learner's piece goes where the engine takes it from: a `BlockSpaceManager`
subclass given as `block_manager_cls`, whose prefix lookup and block
registration call the learner's hash functions (exercise 1) or whose device
allocator is the learner's class (exercise 2); exercise 3 reads traces of
real runs, checked against the block manager's own counters and what its
`allocate` returned. Each checker prints one line, or raises AssertionError
saying what was expected, what came back, and why.
"""

from __future__ import annotations

import functools
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from minivllm.core.block_allocator import BlockAllocator, Device, PhysicalTokenBlock
from minivllm.core.block_manager import BlockSpaceManager
from minivllm.core.prefix_caching import CachedBlockAllocator, hash_block_tokens
from minivllm.tracer import load_trace
from minivllm.tracer.scenario import SCENARIO_DIR, load_scenario, run_scenario
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import (  # noqa: F401 - needs: for the notebook
    SameEqualities,
    needs,
    passed,
)
from tools.labs.checks._engine_runs import (
    StepLimit,
    first_difference,
    learner_code,
    passes_through,
    quiet_engine,
    the_step_before,
)

DAY = 10
BLOCK_SIZE = 4


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# -- running the engine ----------------------------------------------------------------


@dataclass
class Run:
    """Requests run one after another (or together) on one engine, traced."""

    names: list[str]
    hits: dict[str, int]  # request -> blocks found in the prefix cache at admission
    tables: dict[str, list[int]]  # request -> its block table when first admitted
    tokens: dict[str, tuple[int, ...]]
    trace: Trace
    llm: LLM
    pools: dict[str, str]  # request -> the reference pool after its batch (evictor_state)


class _AllocateLog:
    """Wraps a block manager's allocate(): the cached tokens of every admission."""

    def __init__(self, manager: BlockSpaceManager) -> None:
        self.cached: dict[str, list[int]] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self._manager = manager
        self._allocate = manager.allocate
        manager.allocate = self

    def __call__(self, seq_group) -> int:
        num_cached = self._allocate(seq_group)
        self.cached.setdefault(seq_group.request_id, []).append(num_cached)
        table = self._manager.get_block_table(seq_group.seqs[0])
        self.tables.setdefault(seq_group.request_id, []).append(table)
        return num_cached


def build_llm(trace_path: str | None = None, **engine: Any) -> LLM:
    with quiet_engine():
        return LLM(disable_log_stats=True, trace=trace_path, **engine)


Batch = dict[str, Any]  # request name -> token ids, or a function of the tokens so far


def run_requests(
    batches: list[Batch],
    max_tokens: int | list[int],
    engine: dict[str, Any],
    block_manager_cls: type | None = None,
    max_steps: int = 400,
) -> Run:
    """Each batch in turn (its requests together, to the end), on one engine
    with prefix caching, traced. Request names map to prompts' token ids, or
    to a function of the tokens generated so far (request name -> tokens).
    `max_tokens` is for every batch, or one per batch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        extra = {} if block_manager_cls is None else {"block_manager_cls": block_manager_cls}
        llm = build_llm(path, enable_prefix_caching=True, **engine, **extra)
        llm.llm_engine.add_step_observer(StepLimit(max_steps))
        log = _AllocateLog(llm.llm_engine.scheduler.block_manager)
        names, tokens, pools = [], {}, {}
        try:
            with quiet_engine():
                for i, batch in enumerate(batches):
                    prompts = [{"prompt_token_ids": list(p(tokens) if callable(p) else p)}
                               for p in batch.values()]
                    n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
                    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
                    alloc = llm.llm_engine.scheduler.block_manager.gpu_allocator
                    for name, out in zip(batch, outs, strict=True):
                        names.append(name)
                        tokens[name] = tuple(out.outputs[0].token_ids)
                        if type(alloc) is CachedBlockAllocator:
                            pools[name] = evictor_state(alloc)
        finally:
            llm.llm_engine.stop_trace()
        trace = load_trace(path)
    ids = dict(zip(names, map(str, range(len(names))), strict=True))
    hits = {name: sum(log.cached.get(ids[name], [])) // BLOCK_SIZE for name in names}
    tables = {name: log.tables.get(ids[name], [[]])[0] for name in names}
    return Run(names, hits, tables, tokens, trace, llm, pools)


def _compare_runs(ref: Run, got: Run, what: str, hint_more: str, hint_fewer: str,
                  hint_steps: str, hint_tokens: str) -> None:
    """Hits per request first, then the steps' decisions, then the tokens."""
    for name in ref.names:
        want, have = ref.hits[name], got.hits[name]
        if want != have:
            raise AssertionError(
                f"Day {DAY}, {what}: request {name} found {have} block(s) in the prefix cache, "
                f"the reference engine {want}.\n"
                f"  reference block table: {ref.tables[name]}\n"
                f"  yours:                 {got.tables[name]}\n"
                f"Hint: {hint_more if have > want else hint_fewer}")
    fields = ("scheduled", "preempted", "block_tables", "free_blocks", "finished",
              "prefix_cache")
    diff = first_difference(ref.trace, got.trace, fields)
    if diff is not None:
        step, field, want, have = diff
        raise AssertionError(
            f"Day {DAY}, {what}: step {step}'s {field} differ from the reference's.\n"
            f"  reference: {want}\n  yours:     {have}\nHint: {hint_steps}"
            f"{the_step_before(ref.trace, step)}")
    for name in ref.names:
        if got.tokens[name] != ref.tokens[name]:
            raise AssertionError(
                f"Day {DAY}, {what}: request {name} generated {list(got.tokens[name])}, the "
                f"reference engine {list(ref.tokens[name])}, with the same blocks found.\n"
                f"Hint: {hint_tokens}")


# -- exercise 1: the hash chain and the lookup -------------------------------------------


def reference_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The engine's chain over the full blocks (core/prefix_caching.py)."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


def reference_prefix(token_ids: list[int], block_size: int, lookup: Callable) -> list:
    """The engine's lookup (BlockSpaceManager._cached_prefix)."""
    found = []
    for h in reference_hashes(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        block = lookup(h)
        if block is None:
            break
        found.append(block)
    return found


def hash_labels(*hash_lists: list) -> list[list[str]]:
    """Hashes as names (h0, h1, ... in order of first appearance): Python's
    hash of a tuple holding None changes from one process to the next (before
    Python 3.12), the pattern of equal and different hashes does not."""
    names: dict[Any, str] = {}
    return [[names.setdefault(h, f"h{len(names)}") for h in hashes] for hashes in hash_lists]


@dataclass(frozen=True)
class HashCase:
    block_size: int
    token_ids: tuple[int, ...]

    def describe(self) -> str:
        return f"token_ids={list(self.token_ids)}, block_size={self.block_size}"


def _crafted_cases() -> list[HashCase]:
    c = HashCase
    return [
        # How many: full blocks only.
        c(4, ()), c(4, (1, 2, 3)), c(4, (1, 2, 3, 4)), c(4, (1, 2, 3, 4, 5)),
        c(4, tuple(range(1, 9))), c(4, tuple(range(1, 12))), c(4, tuple(range(1, 13))),
        c(2, (7, 8, 9)), c(16, tuple(range(40))),
        # The same tokens in two blocks of one prompt.
        c(4, (5, 5, 5, 5, 5, 5, 5, 5)),
        # The same block after different first blocks.
        c(4, (1, 2, 3, 4, 9, 9, 9, 9)), c(4, (5, 6, 7, 8, 9, 9, 9, 9)),
        # The same two blocks after different first blocks (one block back is not enough).
        c(4, (1, 2, 3, 4, 7, 7, 7, 7, 9, 9, 9, 9)), c(4, (5, 6, 7, 8, 7, 7, 7, 7, 9, 9, 9, 9)),
        # The same block at another position.
        c(4, (9, 9, 9, 9, 1, 2, 3, 4)),
    ]


def _random_cases(n: int = 120, seed: int = 10) -> list[HashCase]:
    """Prompts from a few shared stems and a tiny vocabulary: blocks repeat at
    the same and at other positions."""
    rng = random.Random(seed)
    stems = [[rng.randrange(4) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    cases = []
    for _ in range(n):
        tokens = list(rng.choice(stems)) + [rng.randrange(4) for _ in range(rng.randrange(8))]
        cases.append(HashCase(rng.choice([2, 4]), tuple(tokens)))
    return cases


def _call_hashes(fn, case: HashCase) -> list:
    with learner_code(f"Day {DAY}, exercise 1: full_block_hashes({case.describe()})"):
        got = fn(list(case.token_ids), case.block_size)
    if not isinstance(got, list):
        raise AssertionError(
            f"Day {DAY}, exercise 1: full_block_hashes({case.describe()}) should return a "
            f"list, one hash per full block; got {type(got).__name__}: {got!r}.")
    for h in got:
        try:
            hash(h)
        except TypeError:
            raise AssertionError(
                f"Day {DAY}, exercise 1: a block hash is a key of the cached-block table (a "
                f"dict), so it must be hashable; yours is a {type(h).__name__}: {h!r}.\n"
                "Hint: hash a tuple, e.g. hash((parent_hash, tuple(block_tokens))).") from None
        if h is None:
            raise AssertionError(
                f"Day {DAY}, exercise 1: full_block_hashes({case.describe()}) returned None "
                "for a block: None means 'not full yet' to the engine, every full block needs "
                "a hash.")
    return got


def _check_counts(fn, cases: list[HashCase]) -> None:
    for case in cases:
        got = _call_hashes(fn, case)
        n, bs = len(case.token_ids), case.block_size
        want = n // bs
        if len(got) == want:
            continue
        if len(got) == -(-n // bs):
            hint = ("you hashed the partial last block too. Only a FULL block gets a hash: "
                    "the one still filling will receive more tokens, so its content is not "
                    "final. Hashed now, it would keep a hash that stops being true.")
        elif len(got) == want - 1:
            hint = ("you dropped the last full block: a block starting at `start` is full "
                    "when start + block_size <= len(token_ids).")
        else:
            hint = "one hash per full block: len(token_ids) // block_size of them."
        raise AssertionError(
            f"Day {DAY}, exercise 1: full_block_hashes({case.describe()}) returned "
            f"{len(got)} hash(es), the engine has {want}.\nHint: {hint}")


def _why_collide(a: HashCase, i: int, b: HashCase, j: int) -> str:
    bs = a.block_size
    block = lambda case, k: case.token_ids[k * bs:(k + 1) * bs]  # noqa: E731
    if block(a, i) == block(b, j) and i > 0 and j > 0 and block(a, i - 1) == block(b, j - 1):
        return ("your hash looks one block back only (the previous block's TOKENS, not its "
                "hash): block k's hash must stand for every token before it. Chain the "
                "parent block's HASH: it already stands for everything before.")
    if block(a, i) == block(b, j):
        return ("your hashes are not chained: the same tokens at another position, or after "
                "another prefix, got the same hash. A hit would then reuse K/V computed in "
                "another context (a token's K/V depend on every token before it and on its "
                "position). Hash (parent hash, this block's tokens), None as the first parent.")
    return ("two different blocks got the same hash: make the hash depend on the tokens "
            "themselves (a tuple of the ints), not on something coarser like their sum or "
            "their set.")


def _check_relation(fn, cases: list[HashCase]) -> None:
    """Equal exactly where the engine's hashes are equal."""
    agreement = SameEqualities()
    for case in cases:
        got = _call_hashes(fn, case)
        again = _call_hashes(fn, case)
        if got != again:
            raise AssertionError(
                f"Day {DAY}, exercise 1: two calls with the same tokens ({case.describe()}) "
                f"gave different hashes.\nHint: a block's hash must depend only on the tokens "
                "and the parent hash (no random numbers, no id() of an object), or no later "
                "request could find the block.")
        want = reference_hashes(list(case.token_ids), case.block_size)
        for k, (mine, ref) in enumerate(zip(got, want, strict=True)):
            clash = agreement.add(mine, (case.block_size, ref), (case, k))
            if clash is None:
                continue
            kind, (other, k2) = clash
            if kind == "collision":
                raise AssertionError(
                    f"Day {DAY}, exercise 1: block {k2} of ({other.describe()}) and block {k} "
                    f"of ({case.describe()}) hold different prefixes, yet your hashes for them "
                    f"are equal.\nHint: {_why_collide(other, k2, case, k)}")
            raise AssertionError(
                f"Day {DAY}, exercise 1: block {k2} of ({other.describe()}) and block {k} "
                f"of ({case.describe()}) hold the same tokens after the same prefix, yet "
                "your hashes for them differ.\nHint: hash only (parent hash, the block's "
                "tokens as a tuple): equal prefixes must give equal hashes, or nothing "
                "is ever found.")


@dataclass(frozen=True)
class LookupCase:
    """Prompts already cached (their full blocks), and one to look up."""

    cached: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]
    block_size: int = 4
    gap: int | None = None  # a block of cached[0] evicted meanwhile

    def describe(self) -> str:
        gap = "" if self.gap is None else f" (block {self.gap} of the first since evicted)"
        cached = ", ".join(str(list(c)) for c in self.cached)
        return (f"token_ids={list(self.query)}, block_size={self.block_size}, with the full "
                f"blocks of {cached} in the cache{gap}")


def _lookup_cases() -> list[LookupCase]:
    a = tuple(range(10, 22))  # 12 tokens: 3 full blocks
    c = LookupCase
    return [
        c((), a),
        c((a,), a[:5]),  # 1 full block, then 1 token: 1 block may hit
        c((a,), a[:9] + (99,)),  # 2 blocks match, the third block differs
        c((a,), a + (99,)),  # 13 tokens: all 3 cached blocks hit
        c((a,), a),  # 12 tokens, all cached: the cap leaves the last block to compute
        c((a,), a[:8]),  # 8 tokens, both cached: 1 block
        c((a,), a[:4]),  # 4 tokens: nothing may come from the cache
        c((a,), a[:1]),
        c((a,), ()),
        c((a,), (99,) + a[1:]),  # the first block differs: nothing after it can hit
        c((a,), a + (99,), gap=1),  # block 1 evicted: blocks 0 only, though block 2 is there
        c((a[:4] + a[:4] + a[:4],), a[:4] * 3 + (99,)),
        c((a[:8],), a[4:8] + a[:4] + (1,)),  # the same blocks, in another order
    ]


class _Cached:
    """What the learner's lookup finds: a label naming the cached block."""

    def __init__(self, label: str) -> None:
        self.label = label

    def __repr__(self) -> str:
        return self.label


def _run_lookup(cached_prefix, hashes_fn, case: LookupCase) -> list[str]:
    table: dict[Any, _Cached] = {}
    for i, prompt in enumerate(case.cached):
        for k, h in enumerate(hashes_fn(list(prompt), case.block_size)):
            if i == 0 and k == case.gap:
                continue
            table.setdefault(h, _Cached(f"prompt {i} block {k}"))
    with learner_code(f"Day {DAY}, exercise 1: cached_prefix({case.describe()})"):
        got = cached_prefix(list(case.query), case.block_size, table.get)
    if not isinstance(got, list):
        raise AssertionError(
            f"Day {DAY}, exercise 1: cached_prefix({case.describe()}) should return a list "
            f"of the blocks found; got {type(got).__name__}: {got!r}.")
    return [b.label if isinstance(b, _Cached) else repr(b) for b in got]


def _check_lookup(cached_prefix, hashes_fn) -> None:
    for case in _lookup_cases():
        got = _run_lookup(cached_prefix, hashes_fn, case)
        want = _run_lookup(reference_prefix, reference_hashes, case)
        if got == want:
            continue
        n, bs = len(case.query), case.block_size
        if len(got) > len(want) and got[:len(want)] == want and n % bs == 0 and \
                len(got) * bs >= n:
            hint = ("every block of the prompt came from the cache, so nothing is left to "
                    "compute, and the last token's logits (which the next token is sampled "
                    "from) are never produced. Look up at most (len(token_ids) - 1) // "
                    "block_size blocks: the block holding the last token is always computed.")
        elif case.gap is not None and len(got) > len(want):
            hint = ("you went on past a miss. The blocks after a missing one are useless: their "
                    "K/V were computed after tokens whose K/V are not in the cache any more, "
                    "and a block table must be a prefix. Stop at the first miss.")
        elif len(got) < len(want) and got == want[:len(got)]:
            hint = ("you stopped too early: a prompt of n tokens may take (n - 1) // block_size "
                    "blocks from the cache, every full block but the one holding its last "
                    "token.")
        else:
            hint = ("walk the prompt's full blocks from the first, look each hash up, and keep "
                    "the blocks found until the first miss; return them in order.")
        raise AssertionError(
            f"Day {DAY}, exercise 1: cached_prefix({case.describe()}) returned {got}, the "
            f"engine finds {want}.\nHint: {hint}")


def manager_using(full_block_hashes, cached_prefix) -> type:
    """A block manager whose prefix lookup is `cached_prefix` and whose blocks are
    named by `full_block_hashes` when they become full and computed."""

    class LearnerHashBlockManager(BlockSpaceManager):
        def _cached_prefix(self, seq):
            if not self.enable_caching:
                return []
            return list(cached_prefix(seq.get_token_ids(), self.block_size,
                                      self.gpu_allocator.lookup))

        def mark_blocks_as_computed(self, seq, num_computed_tokens):
            if not self.enable_caching:
                return
            table = self.block_tables[seq.seq_id]
            tokens = seq.get_token_ids()[:num_computed_tokens]
            for block, h in zip(table, full_block_hashes(tokens, self.block_size),
                                strict=False):
                if block.block_hash is None:
                    block.block_hash = h
                    self.gpu_allocator.register(block)

    return LearnerHashBlockManager


ROOMY = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=48, max_model_len=48,
             max_num_seqs=4)


def hash_workload() -> list[Batch]:
    """A alone; then C, G and E together; then D, which is A's prompt followed by
    A's output (X, Y, Z, Q are 4-token blocks)."""
    x, y, z, q = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]
    a = x + x + y + q + [51, 52]
    return [
        {"A": a},
        {"C": x + y + z + [61],  # Y after X, not after X X as in A
         "G": x + x + x + y + [62],  # X X X: the third X is not A's block 2
         "E": x + x + y + q},  # exactly 4 full blocks, all cached
        # A's 5th block ([51, 52] and A's first 2 outputs) was filled while A decoded.
        {"D": lambda tokens: a + list(tokens["A"])},
    ]


HASH_MAX_TOKENS = 3


def _hash_run(block_manager_cls: type | None) -> Run:
    return run_requests(hash_workload(), HASH_MAX_TOKENS, ROOMY, block_manager_cls)


@functools.cache
def reference_hash_run() -> Run:
    return _hash_run(None)


def exercise_1(full_block_hashes, cached_prefix) -> None:
    """`full_block_hashes(token_ids, block_size)` against the engine's chain on
    made-up and random prompts; `cached_prefix(token_ids, block_size, lookup)`
    on made-up caches; then both inside a real engine (block_manager_cls)."""
    crafted = _crafted_cases()
    _check_counts(full_block_hashes, crafted)
    _check_relation(full_block_hashes, crafted)
    _check_relation(full_block_hashes, crafted + _random_cases())
    _check_lookup(cached_prefix, full_block_hashes)
    ref = reference_hash_run()
    manager = manager_using(full_block_hashes, cached_prefix)
    with learner_code(f"Day {DAY}, exercise 1: your hash functions, inside the engine,"):
        got = _hash_run(manager)
    _compare_runs(
        ref, got, "exercise 1 (inside the engine)",
        hint_more="a block was found that holds other tokens, or the same tokens at another "
        "position: chain the hashes, and stop at the first miss.",
        hint_fewer="a block the reference finds was not found with your hashes. D is A's "
        "prompt followed by A's output: its 5th block was filled while A decoded, and "
        "must get its hash when it became full, not before (the last, partial block must "
        "not be hashed).",
        hint_steps="the blocks found are the reference's, but the engine then took other "
        "decisions: compare the step above with the reference's.",
        hint_tokens="the hits reused K/V computed for other tokens.",
    )
    passed(DAY, 1)


# -- exercise 2: the cached allocator and its evictor --------------------------------------


def manager_with(allocator_cls: type) -> type:
    """A block manager whose device pool is `allocator_cls` when caching is on."""

    class LearnerAllocatorBlockManager(BlockSpaceManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.enable_caching:
                self.gpu_allocator = allocator_cls(Device.GPU, self.block_size,
                                                   self.num_total_gpu_blocks)

    LearnerAllocatorBlockManager.__name__ = f"BlockSpaceManager with {allocator_cls.__name__}"
    return LearnerAllocatorBlockManager


def _hashed(alloc, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
            tokens: tuple[int, ...]) -> None:
    """What the block manager does when a block becomes full and computed."""
    block.block_hash = hash_block_tokens(None if parent is None else parent.block_hash, tokens)
    alloc.register(block)


def _script(alloc, doing: list[str], log: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A fixed sequence of operations on a pool of 5 blocks of 2 tokens; what
    each observably returns goes to `log` as it happens. `doing` names each
    operation as it starts."""

    def found(block) -> bool:
        return alloc.lookup(block.block_hash) is block

    doing.append("allocate() twice on a fresh pool")
    a, b = alloc.allocate(), alloc.allocate()
    log.append(("fresh: block numbers", [a.block_number, b.block_number]))
    doing.append("register(a), register(b) as they become full")
    _hashed(alloc, a, None, (1, 2))
    _hashed(alloc, b, a, (3, 4))
    log.append(("register: lookup finds them", [found(a), found(b)]))
    log.append(("lookup of a hash never registered", alloc.lookup(hash(("nothing",)))))
    doing.append("free(a), free(b): their last references")
    alloc.free(a)
    alloc.free(b)
    log.append(("free cached blocks: lookup still finds them", [found(a), found(b)]))
    log.append(("free cached blocks: get_num_free_blocks()", alloc.get_num_free_blocks()))
    doing.append("allocate() while never-used blocks remain")
    c = alloc.allocate()
    log.append(("allocate with never-used blocks: block number", c.block_number))
    log.append(("allocate with never-used blocks: cached ones still found", [found(a), found(b)]))
    doing.append("reuse(lookup(a's hash)): a prefix hit on a free cached block")
    got = alloc.reuse(alloc.lookup(a.block_hash))
    log.append(("reuse of a free cached block: returns it", got is a))
    log.append(("reuse of a free cached block: its ref_count", a.ref_count))
    log.append(("reuse of a free cached block: get_num_free_blocks()",
                alloc.get_num_free_blocks()))
    doing.append("reuse(a) again: a second request shares it")
    alloc.reuse(a)
    log.append(("reuse of a block in use: its ref_count", a.ref_count))
    log.append(("reuse of a block in use: get_num_free_blocks()", alloc.get_num_free_blocks()))
    doing.append("free(a) once, with ref_count 2")
    alloc.free(a)
    log.append(("free of a shared block: ref_count and free blocks",
                [a.ref_count, alloc.get_num_free_blocks()]))
    doing.append("allocate() twice more")
    d, e = alloc.allocate(), alloc.allocate()
    log.append(("allocate the last never-used blocks: block numbers",
                [d.block_number, e.block_number]))
    doing.append("allocate() when the only free block is b, cached")
    f = alloc.allocate()
    log.append(("evicting allocate: block number", f.block_number))
    log.append(("evicting allocate: ref_count", f.ref_count))
    log.append(("evicting allocate: block_hash", f.block_hash))
    log.append(("evicting allocate: lookup of the evicted block's hash",
                alloc.lookup(b.block_hash)))
    log.append(("evicting allocate: get_num_free_blocks()", alloc.get_num_free_blocks()))
    doing.append("allocate() from a full pool")
    try:
        alloc.allocate()
        log.append(("allocate from a full pool", "no error"))
    except ValueError:
        log.append(("allocate from a full pool", "ValueError"))
    doing.append("register c, d, e; free(d), free(c), free(e), then reuse(c) and free(c)")
    _hashed(alloc, c, None, (5, 6))
    _hashed(alloc, d, c, (7, 8))
    _hashed(alloc, e, None, (9, 10))
    for block in (d, c, e):
        alloc.free(block)
    alloc.reuse(alloc.lookup(c.block_hash))
    alloc.free(c)  # c is now the most recently used
    doing.append("allocate() with d, e, c free and cached, d least recently used")
    g = alloc.allocate()
    log.append(("LRU: which block is evicted first", g.block_number))
    log.append(("LRU: after evicting d, lookups of d, e, c",
                [alloc.lookup(d.block_hash) is not None, found(e), found(c)]))
    doing.append("allocate() again")
    h = alloc.allocate()
    log.append(("LRU: which block is evicted next (c was freed again last)", h.block_number))
    doing.append("g becomes full with c's content: register(g) while c is cached")
    g.block_hash = c.block_hash
    alloc.register(g)
    log.append(("register of content already cached: lookup finds", alloc.lookup(c.block_hash)
                is c))
    doing.append("free(g), the duplicate")
    alloc.free(g)
    log.append(("free of a duplicate: get_num_free_blocks() and lookup finds c",
                [alloc.get_num_free_blocks(), found(c)]))
    doing.append("allocate() with the duplicate's block free and c cached")
    k = alloc.allocate()
    log.append(("allocate after freeing the duplicate: block number, c still found",
                [k.block_number, found(c)]))
    for block in (a, f, h, k):
        alloc.free(block)
    log.append(("all freed: get_num_free_blocks()", alloc.get_num_free_blocks()))
    return []


_SCRIPT_HINTS: dict[str, str] = {
    "fresh: block numbers": "before anything is cached, allocate() is the plain allocator's: "
    "call super().allocate() (block 0 first).",
    "register: lookup finds them": "register(block) puts the block into the cached-block "
    "table under block.block_hash; lookup(hash) returns it (None when absent).",
    "lookup of a hash never registered": "lookup(hash) returns None for a hash it does not "
    "hold (dict.get), it must not raise.",
    "free cached blocks: lookup still finds them": "a cached block freed by its last user is "
    "not forgotten: it stays in the cached-block table, findable, and waits in the evictor "
    "until its slot is needed. That is the whole point: the next request with this prefix "
    "finds it.",
    "free cached blocks: get_num_free_blocks()": "a cached block with ref_count 0 is free: it "
    "holds K/V a later request may reuse, but its slot can be handed out at any time. "
    "get_num_free_blocks() counts the never-used/wiped blocks AND the evictable cached ones; "
    "otherwise the scheduler believes the cache is full and stops admitting requests.",
    "allocate with never-used blocks: block number": "allocate() must take a never-used (or "
    "wiped) block while there is one, and evict a cached block only when no other block is "
    "free: evicting early throws away K/V that a later request could have reused. (If your "
    "_release puts cached blocks on the free list, they are handed out like any free block "
    "and their content is overwritten while the table still points at them.)",
    "allocate with never-used blocks: cached ones still found": "taking a never-used block "
    "must leave the cached blocks alone.",
    "reuse of a free cached block: returns it": "reuse(block) returns the block it was given.",
    "reuse of a free cached block: its ref_count": "a prefix hit is one more user of the "
    "block: reuse() must increment block.ref_count (from 0 to 1 here). With the count "
    "unchanged, the first free() of it is a double free, or the block is released while "
    "a request still reads it.",
    "reuse of a free cached block: get_num_free_blocks()": "a revived block (ref_count 0 -> "
    "1) must leave the evictor. Left there, it is still counted as free and the next "
    "allocate() that evicts hands it out to a second request while the first still uses "
    "it: double allocation, two requests writing one block.",
    "reuse of a block in use: its ref_count": "reuse() of a block already in use (another "
    "request shares it) only increments its ref_count.",
    "reuse of a block in use: get_num_free_blocks()": "a block in use is not in the evictor: "
    "reuse() of it changes no free count.",
    "free of a shared block: ref_count and free blocks": "free() of a block with ref_count 2 "
    "only decrements it: _release runs when the count reaches 0 (BlockAllocator.free does "
    "this; do not override free() to release at once).",
    "allocate the last never-used blocks: block numbers": "never-used blocks first, in the "
    "plain allocator's order (super().allocate()).",
    "evicting allocate: block number": "with no never-used block left, allocate() evicts the "
    "least recently used cached block with ref_count 0 and hands out its block number.",
    "evicting allocate: ref_count": "the block allocate() returns, evicted or not, is in use "
    "by one sequence: ref_count 1.",
    "evicting allocate: block_hash": "an evicted block's slot gets new content: the block "
    "handed out must have block_hash None (a new PhysicalTokenBlock with the victim's "
    "number, or the victim reset). With the old hash kept, the block manager thinks it is "
    "already named and never registers its new content.",
    "evicting allocate: lookup of the evicted block's hash": "evicting a block must remove it "
    "from the cached-block table too. Left there, a later request finds it by its old hash "
    "and reads K/V that another sequence has overwritten: a stale hit, and wrong tokens.",
    "evicting allocate: get_num_free_blocks()": "after evicting the last cached free block, "
    "no block is free.",
    "allocate from a full pool": "with no never-used block and nothing to evict, allocate() "
    "raises ValueError (the plain allocator's out-of-memory error).",
    "LRU: which block is evicted first": "evict the LEAST recently used cached block: the one "
    "freed longest ago (an OrderedDict in release order, popped from the front: "
    "popitem(last=False)). The most recently used blocks are the likeliest to be asked for "
    "again.",
    "LRU: after evicting d, lookups of d, e, c": "only the evicted block leaves the table.",
    "LRU: which block is evicted next (c was freed again last)": "a block revived by a hit "
    "and freed again is used again: it goes to the most-recent end of the evictor, not back "
    "to its old place.",
    "register of content already cached: lookup finds": "register() keeps the block already "
    "cached under that hash (dict.setdefault): two blocks can hold the same content (a "
    "request recomputed a block it could not take from the cache), and the table names "
    "one of them. Replacing it orphans the old block: it stays in the evictor under a hash "
    "that now names another block, and is never freed again.",
    "free of a duplicate: get_num_free_blocks() and lookup finds c": "a block that is not the "
    "cached copy of its hash is released like an uncached one, to the free list; the "
    "cached copy stays findable. Check `cached_blocks.get(block.block_hash) is block`, not "
    "just that the hash is known.",
    "allocate after freeing the duplicate: block number, c still found": "a free uncached "
    "block is taken before any cached block is evicted.",
    "all freed: get_num_free_blocks()": "once every block is freed, all 5 are free (cached or "
    "not): a block went missing, or was counted twice.",
}


def _run_script(alloc_cls: type, n: int = 5) -> tuple[list, list[str], Exception | None]:
    """The script's log (as far as it got), the operations begun, and the
    exception that stopped it, if one did."""
    doing: list[str] = []
    log: list[tuple[str, Any]] = []
    with learner_code(f"Day {DAY}, exercise 2: {alloc_cls.__name__}(GPU, 2, {n})"):
        alloc = alloc_cls(Device.GPU, 2, n)
    try:
        log.extend(_script(alloc, doing, log))
    except Exception as error:  # noqa: BLE001 - reported to the learner
        if passes_through(error):
            raise
        return log, doing, error
    return log, doing, None


@functools.cache
def _reference_script() -> tuple:
    log, _, error = _run_script(CachedBlockAllocator)
    assert error is None, error
    return tuple(log)


def _check_script(alloc_cls: type) -> None:
    got, doing, error = _run_script(alloc_cls)
    # The first difference explains a later crash better than the crash itself.
    for (label, want), (_, have) in zip(_reference_script(), got, strict=False):
        if want != have:
            raise AssertionError(
                f"Day {DAY}, exercise 2: on a pool of 5 blocks of 2 tokens, at "
                f"'{label}':\n  expected: {want!r}\n  yours:    {have!r}\n"
                f"Hint: {_SCRIPT_HINTS[label]}")
    if error is not None:
        step = doing[-1] if doing else "the first operation"
        hint = ""
        if "Double free" in str(error):
            hint = ("\nHint: a block was freed more often than it was taken: a hit (reuse) "
                    "must increment ref_count, and allocate() hands out a block with "
                    "ref_count 1.")
        raise AssertionError(
            f"Day {DAY}, exercise 2: {alloc_cls.__name__} raised {type(error).__name__}: "
            f"{error}, during: {step}.{hint}") from error


TIGHT = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=10, max_model_len=40,
             max_num_seqs=4)


def eviction_workload() -> list[dict[str, list[int]]]:
    """One after another on 10 blocks, one output token each (so each request
    holds exactly its prompt's blocks): A (12 tokens), B (12) and C (14) fill
    the pool; A2 (A + 4 tokens) finds A's blocks; D (8 new tokens) must evict;
    then B, A and C come back, and A's prompt once more: its last block is
    recomputed beside the cached copy (two blocks, one content)."""
    a, b = list(range(100, 112)), list(range(200, 212))
    c, d = list(range(300, 314)), list(range(400, 408))
    return [{"A": a}, {"B": b}, {"C": c}, {"A2": a + [120, 121, 122, 123]}, {"D": d},
            {"B2": list(b)}, {"A3": a + [130]}, {"C2": list(c)}, {"A4": list(a)}]


def shared_batch() -> list[dict[str, list[int]]]:
    """Three requests sharing an 8-token system prompt, together on 10 blocks,
    growing until one is preempted (7 tokens each); then the system prompt
    again with a new question (1 token)."""
    system = list(range(400, 408))
    batch = {"X": system + [410, 411, 412, 413], "Y": system + [420, 421, 422, 423],
             "Z": system + [430, 431, 432, 433]}
    return [batch, {"W": system + [440, 441, 442]}]


EVICTION_MAX_TOKENS = 1
BATCH_MAX_TOKENS = [7, 1]


@functools.cache
def reference_eviction_run() -> Run:
    return run_requests(eviction_workload(), EVICTION_MAX_TOKENS, TIGHT)


@functools.cache
def reference_batch_run() -> Run:
    return run_requests(shared_batch(), BATCH_MAX_TOKENS, TIGHT)


def evictor_state(alloc: CachedBlockAllocator) -> str:
    """The reference allocator's free blocks, in words (for the notebook)."""
    return (f"free list {list(reversed(alloc.free_block_numbers))}, evictor "
            f"{[b.block_number for b in alloc.evictor.values()]}")


_ENGINE_HINTS = dict(
    hint_more="a request found a block the reference had evicted: an evicted block must "
    "leave the cached-block table (and a cached block freed to the free list is "
    "overwritten while still findable).",
    hint_fewer="a block the reference still had was gone: evict only when no never-used "
    "block is free, least recently used first, and keep freed cached blocks findable.",
    hint_steps="the same blocks were found, but your pool handed out other blocks or "
    "counted free blocks differently: compare the step above with the reference's.",
    hint_tokens="two sequences wrote into one block (a revived block still in the evictor "
    "was handed out again), or a stale block was read.",
)


def _engine_error_hint(error: BaseException) -> str:
    text = str(error)
    if isinstance(error, KeyError):
        return ("your pool did not find a block where it expected it: most often an evicted "
                "block left in the cached-block table, found again by its old hash (a stale "
                "hit: its slot now holds another sequence's K/V), or a block taken out of the "
                "evictor twice.")
    if "Double free" in text:
        return ("a block was freed more often than it was taken: a hit (reuse) must "
                "increment ref_count, and allocate() hands out blocks with ref_count 1.")
    if "Out of memory" in text or "no free" in text:
        return ("allocate() found nothing to hand out although get_num_free_blocks() said "
                "there was room: it must count exactly the blocks allocate() can give.")
    return ""


def exercise_2(allocator_cls: type) -> None:
    """The allocator beside the reference on a script of operations, then as
    the device pool of real engines: requests one after another on a cache so
    small that the eviction order decides the hits, and a shared-prompt batch
    that preempts."""
    if not (isinstance(allocator_cls, type) and issubclass(allocator_cls, BlockAllocator)):
        raise AssertionError(
            f"Day {DAY}, exercise 2: pass your allocator class (a subclass of "
            f"BlockAllocator), not {allocator_cls!r}.")
    _check_script(allocator_cls)
    manager = manager_with(allocator_cls)
    for label, reference, workload, max_tokens in (
        ("requests one after another on 10 blocks", reference_eviction_run,
         eviction_workload, EVICTION_MAX_TOKENS),
        ("a shared system prompt, batched, with preemption", reference_batch_run,
         shared_batch, BATCH_MAX_TOKENS),
    ):
        ref = reference()
        with learner_code(f"Day {DAY}, exercise 2: {allocator_cls.__name__}, inside the engine "
                          f"({label}),", _engine_error_hint):
            got = run_requests(workload(), max_tokens, TIGHT, manager,
                               max_steps=3 * len(ref.trace.steps) + 20)
        _compare_runs(ref, got, f"exercise 2 ({label})", **_ENGINE_HINTS)
    passed(DAY, 2)


# -- exercise 3: measuring the cache -----------------------------------------------------


def system_prompt_workload(n: int = 6, system_len: int = 48, question_len: int = 8
                           ) -> list[list[int]]:
    """n prompts: one system prompt of `system_len` tokens, then a question each."""
    rng = random.Random(10)
    system = [rng.randrange(5, 1200) for _ in range(system_len)]
    return [system + [rng.randrange(5, 1200) for _ in range(question_len)] for _ in range(n)]


@dataclass
class Measured:
    """A traced run and what the engine itself counted."""

    label: str
    trace: Trace
    queries: int
    hits: int
    cached_tokens: dict[str, int]  # request -> cached tokens, over its admissions
    tokens: list[tuple[int, ...]] | None = None  # generated, in prompt order


def measure_run(label: str, prompts: list[list[int]], max_tokens: int, caching: bool = True,
                **engine: Any) -> Measured:
    """The prompts together on a fresh engine, traced, with the block
    manager's counters and what its allocate() returned."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        llm = build_llm(path, enable_prefix_caching=caching, **engine)
        bm = llm.llm_engine.scheduler.block_manager
        log = _AllocateLog(bm)
        try:
            with quiet_engine():
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    greedy(max_tokens), use_tqdm=False)
        finally:
            llm.llm_engine.stop_trace()
        trace = load_trace(path)
    return Measured(label, trace, bm.prefix_cache_queries, bm.prefix_cache_hits,
                    {rid: sum(v) for rid, v in log.cached.items()},
                    [tuple(o.outputs[0].token_ids) for o in outs])


@functools.cache
def measured_runs() -> tuple[Measured, ...]:
    """The workloads exercise 3 is checked on (besides the tracer's scenario):
    a shared system prompt with caching on and off, and three requests that
    share one, prefilled in chunks of 16 tokens on 12 blocks, the last of which
    is preempted by recompute and comes back finding its own blocks."""
    prompts = system_prompt_workload()
    roomy = dict(block_size=BLOCK_SIZE, max_model_len=64, num_gpu_blocks_override=128)
    # The engine's dry run (no weights, pseudo-random tokens) where only counts matter.
    tight = dict(block_size=BLOCK_SIZE, max_model_len=48, num_gpu_blocks_override=12,
                 enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4,
                 preemption_mode="recompute", dry_run=True)
    return (
        measure_run("the shared system prompt", prompts, 2, **roomy),
        measure_run("a shared system prompt, prefilled in chunks, with a preemption",
                    system_prompt_workload(3, 16, 4), 6, **tight),
        measure_run("the shared system prompt, prefix caching off", prompts, 2, caching=False,
                    **roomy),
    )


class _CountAdmissions:
    """A step observer that wraps the block manager's allocate() as the first
    request arrives (run_scenario builds the engine itself)."""

    def __init__(self) -> None:
        self.log: _AllocateLog | None = None
        self.bm: BlockSpaceManager | None = None

    def on_add_request(self, engine, seq_group) -> None:
        if self.log is None:
            self.bm = engine.scheduler.block_manager
            self.log = _AllocateLog(self.bm)

    def on_step(self, engine, record) -> None:
        pass


@functools.cache
def scenario_run() -> Measured:
    """The tracer's prefix_cache scenario on the classic engine's dry run (no
    weights: only the counts matter here), traced and counted."""
    scenario = load_scenario(SCENARIO_DIR / "prefix_cache.yaml")
    counter = _CountAdmissions()
    with tempfile.TemporaryDirectory() as tmp, quiet_engine():
        path = os.path.join(tmp, "prefix_cache.jsonl")
        run_scenario(scenario, path, DEFAULT_MODEL, dry_run=True, observers=[counter])
        trace = load_trace(path)
    return Measured("the tracer's prefix_cache scenario", trace, counter.bm.prefix_cache_queries,
                    counter.bm.prefix_cache_hits,
                    {rid: sum(v) for rid, v in counter.log.cached.items()})


def expected_report(m: Measured) -> dict[str, Any]:
    """The figures, from the engine's own counts and the trace's batch entries."""
    prefill = sum(e["num_tokens"] for s in m.trace.steps for e in s["scheduled"]
                  if e["is_prefill"])
    cached = {rid: m.cached_tokens.get(rid, 0) for rid in m.trace.requests}
    total_cached = sum(cached.values())
    return {
        "queries": m.queries,
        "hits": m.hits,
        "hit_rate": round(m.hits / m.queries, 4) if m.queries else 0.0,
        "cached_tokens": cached,
        "prefill_tokens": prefill,
        "saved_fraction": round(total_cached / (total_cached + prefill), 4)
        if total_cached + prefill else 0.0,
    }


_REPORT_KEYS = ("queries", "hits", "hit_rate", "cached_tokens", "prefill_tokens",
                "saved_fraction")

_REPORT_HINTS = {
    "queries": "the blocks looked up: each step's `prefix_cache['queries']`, summed (a step "
    "line's `prefix_cache` is None when caching is off: count 0). The block manager looks up "
    "(len - 1) // block_size blocks per admission, not every block of the prompt.",
    "hits": "the blocks found: each step's `prefix_cache['hits']`, summed (None: 0).",
    "hit_rate": "hits / queries over the whole run, both summed first (0.0 when nothing was "
    "looked up): a mean of per-step or per-request rates weighs a 1-block lookup like a "
    "100-block one.",
    "cached_tokens": "a request's cached tokens show where its first batch entry after "
    "leaving the waiting queue starts: `positions[0]` of that entry (the tokens before it "
    "came from the cache). Count it once per admission: a later chunk of a chunked prompt "
    "starts where the previous chunk ended, not after a hit; and a request preempted by "
    "recompute is admitted again, finding blocks again. Every request of the trace gets an "
    "entry, 0 if it found nothing.",
    "prefill_tokens": "the tokens the model computed in prefill entries (`is_prefill`): "
    "their `num_tokens`, summed, decodes excluded. Chunks and recomputed prompts count.",
    "saved_fraction": "cached / (cached + prefill_tokens): of all the prompt tokens the "
    "model would have computed without the cache, the share it did not.",
}


_REPORT_CRASH_HINT = (
    "read only the trace's fields (SCHEMA.md): a step's `prefix_cache` is None when caching "
    "is off (count 0 queries and hits then), and a run that looked nothing up has a hit rate "
    "of 0.0, not a division by zero.")


def _check_report(report, want: dict[str, Any], label: str) -> None:
    if not isinstance(report, dict):
        raise AssertionError(
            f"Day {DAY}, exercise 3: prefix_cache_report should return a dict with the keys "
            f"{list(_REPORT_KEYS)}; got {type(report).__name__}.")
    missing = [k for k in _REPORT_KEYS if k not in report]
    if missing:
        raise AssertionError(
            f"Day {DAY}, exercise 3: the report has no {missing} (keys: {list(_REPORT_KEYS)}).")
    for key in _REPORT_KEYS:
        have = report[key]
        if key in ("hit_rate", "saved_fraction"):
            ok = isinstance(have, (int, float)) and abs(have - want[key]) < 5e-4
        elif key == "cached_tokens":
            ok = isinstance(have, dict) and {str(k): v for k, v in have.items()} == want[key]
        else:
            ok = have == want[key]
        if not ok:
            raise AssertionError(
                f"Day {DAY}, exercise 3: on the trace of {label}, your report's {key!r} is "
                f"{have!r}; the engine counted {want[key]!r}.\nHint: {_REPORT_HINTS[key]}")


def exercise_3(prefix_cache_report) -> None:
    """`prefix_cache_report(trace)` on traces of the tracer's prefix_cache
    scenario, a shared system prompt with and without caching, and a batch
    prefilled in chunks and preempted by recompute, against the engine's own
    counts (its block manager's counters, what its allocate() returned)."""
    for m in (scenario_run(), *measured_runs()):
        with learner_code(f"Day {DAY}, exercise 3: prefix_cache_report(<the trace of "
                          f"{m.label}>)", _REPORT_CRASH_HINT):
            report = prefix_cache_report(m.trace)
        _check_report(report, expected_report(m), m.label)
    passed(DAY, 3)
