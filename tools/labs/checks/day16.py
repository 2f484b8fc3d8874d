"""Checkers for day 16, V1's KV cache and process split
(labs/day16_v1_kv_cache_and_processes.ipynb).

Every engine here is V1 (`LLM(use_v1=True)`) on the shipped model, greedy,
its engine core in this process. A learner's piece goes where the engine
takes it from: the block hasher the engine core builds
(`minivllm.v1.engine.core.get_request_block_hasher`), the free queue class
the block pool builds (`minivllm.v1.core.block_pool.FreeKVCacheBlockQueue`),
the client the front end talks to (`LLMEngine.engine_core`). Each checker
prints one line, or raises AssertionError saying what was expected, what
came back, and why.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import pickle
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import minivllm.v1.core.block_pool as block_pool_module
import minivllm.v1.engine.core as engine_core_module
from minivllm import LLM, SamplingParams
from minivllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)
from minivllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from minivllm.v1.engine.core_client import InprocClient
from tools.labs.checks._common import (  # noqa: F401 - needs: for the notebook
    SameEqualities,
    needs,
    passed,
)
from tools.labs.checks._engine_runs import learner_code, quiet_engine, token_prompts

DAY = 16

# The lab's small cache: blocks of 4 tokens, 10 blocks (block 0 the null block).
BLOCK_SIZE = 4
ENGINE = dict(block_size=BLOCK_SIZE, num_gpu_blocks_override=10, max_model_len=32,
              max_num_seqs=4, max_num_batched_tokens=64)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def v1_llm(**engine: Any) -> LLM:
    """A V1 engine on the shipped model, its engine core in this process, quiet."""
    with quiet_engine():
        return LLM(use_v1=True, disable_log_stats=True, **{**ENGINE, **engine})


def engine_core(llm: LLM):
    """The in-process EngineCore of a V1 `LLM` (under any client wrapping it)."""
    client = llm.llm_engine.engine_core
    while not isinstance(client, InprocClient):
        client = client.client
    return client.engine_core


def kv_cache_manager(llm: LLM):
    return engine_core(llm).scheduler.kv_cache_manager


def block_pool(llm: LLM):
    return kv_cache_manager(llm).block_pool


def free_queue(llm: LLM) -> list[int]:
    """The free queue's block ids, head (next handed out) first."""
    return [b.block_id for b in block_pool(llm).free_block_queue.get_all_free_blocks()]


def cached_free(llm: LLM) -> list[int]:
    """The free blocks that still hold a cached block (a hit can find them)."""
    return [b.block_id for b in block_pool(llm).free_block_queue.get_all_free_blocks()
            if b.block_hash is not None]


# -- the lab's scenario: requests one after another ----------------------------------------

def scenario_prompts() -> dict[str, list[int]]:
    """A (10 tokens), B (8), C (20) run one after another; then D is B again,
    E is A's first 8 tokens and 4 new ones, F is C again."""
    a, b, c = token_prompts([10, 8, 20])
    (new,) = token_prompts([4], first=800)
    return {"A": a, "B": b, "C": c, "D": list(b), "E": a[:8] + new, "F": list(c)}


@dataclass
class Finished:
    """One request of a sequential run, after it finished."""

    name: str
    hit_tokens: int  # prompt tokens found in the prefix cache
    block_ids: list[int]  # the blocks it held, in position order
    queue_after: list[int]  # the free queue once its blocks were given back
    num_free_after: int
    tokens: tuple[int, ...]


@dataclass
class SequentialRun:
    finished: list[Finished] = field(default_factory=list)

    def by_name(self) -> dict[str, Finished]:
        return {f.name: f for f in self.finished}


class _BlocksLog:
    """Wraps a KVCacheManager's free(): the blocks each request gave back."""

    def __init__(self, manager) -> None:
        self.blocks: dict[str, list[int]] = {}
        self._free = manager.free
        self._manager = manager
        manager.free = self

    def __call__(self, request) -> None:
        self.blocks[request.request_id] = self._manager.get_block_ids(request.request_id)
        self._free(request)


def run_sequential(llm: LLM, prompts: dict[str, list[int]], max_tokens: int = 1
                   ) -> SequentialRun:
    """Each prompt in turn, alone, to the end (greedy, `max_tokens` tokens)."""
    log = _BlocksLog(kv_cache_manager(llm))
    run = SequentialRun()
    num_free = lambda: block_pool(llm).get_num_free_blocks()  # noqa: E731
    for name, tokens in prompts.items():
        (out,) = llm.generate({"prompt_token_ids": tokens}, greedy(max_tokens), use_tqdm=False)
        run.finished.append(Finished(
            name, out.num_cached_tokens, log.blocks[out.request_id], free_queue(llm),
            num_free(), tuple(out.outputs[0].token_ids)))
    return run


@functools.cache
def reference_scenario() -> SequentialRun:
    """The lab's scenario on the reference engine."""
    return run_sequential(v1_llm(), scenario_prompts())


# -- a batch run, step by step -------------------------------------------------------------

@dataclass
class BatchStep:
    blocks: dict[str, list[int]]  # request -> its block ids after the step
    queue: list[int]
    num_free: int
    preempted: int


@dataclass
class BatchRun:
    steps: list[BatchStep]
    hits: dict[str, list[int]]  # request -> the hit (tokens) each time it was admitted
    tokens: dict[str, tuple[int, ...]]


class _HitLog:
    """Wraps a KVCacheManager's get_computed_blocks(): every lookup's hit."""

    def __init__(self, manager) -> None:
        self.hits: dict[str, list[int]] = {}
        self._lookup = manager.get_computed_blocks
        manager.get_computed_blocks = self

    def __call__(self, request):
        blocks, num_tokens = self._lookup(request)
        self.hits.setdefault(request.request_id, []).append(num_tokens)
        return blocks, num_tokens


def run_batch(llm: LLM, prompts: dict[str, list[int]], max_tokens: int,
              arrivals: dict[str, int] | None = None, max_steps: int = 200) -> BatchRun:
    """The requests together (each added before step `arrivals[name]`, 0 by
    default), step by step, recording every request's blocks and the free queue."""
    engine = llm.llm_engine
    manager = kv_cache_manager(llm)
    hits = _HitLog(manager)
    pending = {name: (arrivals or {}).get(name, 0) for name in prompts}
    steps: list[BatchStep] = []
    tokens: dict[str, tuple[int, ...]] = {}
    while pending or engine.has_unfinished_requests():
        for name in [n for n, at in pending.items() if at <= len(steps)]:
            engine.add_request(name, {"prompt_token_ids": prompts[name]}, greedy(max_tokens))
            del pending[name]
        if len(steps) >= max_steps:
            raise AssertionError(
                f"Day {DAY}: the engine ran {max_steps} steps without finishing, far more than "
                "the reference needs: requests are preempted or kept waiting forever (are "
                "freed blocks given back to the queue, and counted?).")
        preempted_before = engine.total_preemptions
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = tuple(out.outputs[0].token_ids)
        steps.append(BatchStep(
            {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks},
            free_queue(llm), block_pool(llm).get_num_free_blocks(),
            engine.total_preemptions - preempted_before))
    return BatchRun(steps, hits.hits, tokens)


# The batch workload: three 12-token prompts that share their first 8 tokens,
# growing by 8 tokens each in 9 blocks: the last is preempted and comes back,
# finding its own blocks (and the shared prefix) in the cache.
def batch_prompts() -> dict[str, list[int]]:
    shared, x, y, z = token_prompts([8, 4, 4, 4], first=300)
    return {"X": shared + x, "Y": shared + y, "Z": shared + z}


BATCH_MAX_TOKENS = 8


@functools.cache
def reference_batch() -> BatchRun:
    return run_batch(v1_llm(), batch_prompts(), BATCH_MAX_TOKENS)


# -- exercise 1: the chained block hash -----------------------------------------------------

def reference_hashes(block_size: int, token_ids: list[int],
                     extra_keys: tuple | None = None) -> list[bytes]:
    """The engine's recipe, block by block (kv_cache_utils.hash_block_tokens)."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class HashCase:
    block_size: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None

    def describe(self) -> str:
        extra = "" if self.extra_keys is None else f", extra_keys={self.extra_keys!r}"
        return f"block_size={self.block_size}, token_ids={list(self.token_ids)}{extra}"


def _crafted_cases() -> list[HashCase]:
    """Small cases, each making one mistake visible."""
    c = HashCase
    return [
        # How many hashes: full blocks only.
        c(4, ()), c(4, (1, 2, 3)), c(4, (1, 2, 3, 4)), c(4, (1, 2, 3, 4, 5)),
        c(4, tuple(range(8))), c(4, tuple(range(11))), c(4, tuple(range(12))),
        c(16, tuple(range(15))), c(16, tuple(range(16))), c(16, tuple(range(40))),
        # The same block after different prefixes (chaining).
        c(4, (1, 2, 3, 4, 9, 9, 9, 9)), c(4, (5, 6, 7, 8, 9, 9, 9, 9)),
        # The same two blocks after different first blocks (chaining beyond one block).
        c(4, (1, 2, 3, 4, 7, 7, 7, 7, 9, 9, 9, 9)), c(4, (5, 6, 7, 8, 7, 7, 7, 7, 9, 9, 9, 9)),
        # Different tokens whose digits run together the same way.
        c(4, (1, 23, 4, 5)), c(4, (12, 3, 4, 5)),
        # The same tokens with and without extra keys (a LoRA adapter, say).
        c(4, (1, 2, 3, 4, 5, 6, 7, 8), ("lora-a",)),
        c(4, (1, 2, 3, 4, 5, 6, 7, 8), ("lora-b",)),
        c(4, (1, 2, 3, 4, 5, 6, 7, 8)),
    ]


def _random_cases(n: int = 150, seed: int = 16) -> list[HashCase]:
    """Many prompts built from a few shared prefixes and a small vocabulary, so
    that blocks repeat at the same and at different positions."""
    rng = random.Random(seed)
    stems = [[rng.randrange(6) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    cases = []
    for _ in range(n):
        tokens = list(rng.choice(stems)) + [rng.randrange(6) for _ in range(rng.randrange(0, 14))]
        extra = rng.choice([None, None, None, ("lora-a",)])
        cases.append(HashCase(rng.choice([2, 4]), tuple(tokens), extra))
    return cases


def _diagnose_collision(a: HashCase, i: int, b: HashCase, j: int) -> str:
    """Why two blocks that differ (as the engine names them) got one hash."""
    bs = a.block_size
    block = lambda case, k: case.token_ids[k * bs:(k + 1) * bs]  # noqa: E731
    prefix = lambda case, k: case.token_ids[:(k + 1) * bs]  # noqa: E731
    if i == j and prefix(a, i) == prefix(b, j) and a.extra_keys != b.extra_keys:
        return ("the extra keys must go into every block's hash: a LoRA adapter (or an image) "
                "changes the K/V of the same tokens, so the same tokens with other extra keys "
                "are another block.")
    if block(a, i) == block(b, j) and i > 0 and j > 0 and block(a, i - 1) == block(b, j - 1):
        return ("your hash looks only one block back (the previous block's tokens, not its "
                "hash): block k's name must stand for ALL the tokens before it. Hash the "
                "parent block's HASH with this block's tokens; the parent hash already names "
                "everything before.")
    if block(a, i) == block(b, j):
        return ("your hashes are not chained: the same tokens after different prefixes got the "
                "same hash, so a hit would reuse K/V computed in another context (the keys and "
                "values of a token depend on every token before it). Hash (parent hash, this "
                "block's tokens, extra keys), the first block's parent being a fixed value.")
    return ("two different blocks got the same hash: your encoding of the tokens is ambiguous "
            "(joining the digits without separators makes [1, 23] and [12, 3] the same text). "
            "Hash a tuple of the ints (pickle it, or use repr with separators).")


def _call_hash(fn, case: HashCase) -> list:
    with learner_code(f"hash_request_tokens({case.describe()})"):
        if case.extra_keys is None:
            got = fn(case.block_size, list(case.token_ids))
        else:
            got = fn(case.block_size, list(case.token_ids), case.extra_keys)
    if not isinstance(got, list):
        raise AssertionError(
            f"Day {DAY}, exercise 1: hash_request_tokens({case.describe()}) should return a "
            f"list of hashes, one per full block; got {type(got).__name__}: {got!r}.")
    return got


def _check_hash_counts(fn, cases: list[HashCase]) -> None:
    for case in cases:
        got, want = _call_hash(fn, case), len(case.token_ids) // case.block_size
        if len(got) != want:
            n = len(case.token_ids)
            if len(got) == -(-n // case.block_size):
                hint = ("you hashed the partial last block too. Only FULL blocks get a hash: a "
                        "block still filling will get more tokens, so its content (and K/V) is "
                        "not final, and another request must not match it.")
            elif len(got) == want - 1 and n % case.block_size == 0:
                hint = ("you dropped the last block when the tokens fill it exactly: blocks "
                        "start at 0, block_size, ... while start + block_size <= len(token_ids).")
            else:
                hint = "one hash per full block: len(token_ids) // block_size of them."
            raise AssertionError(
                f"Day {DAY}, exercise 1: hash_request_tokens({case.describe()}) returned "
                f"{len(got)} hashes, the engine {want}.\nHint: {hint}")
        for h in got:
            if not isinstance(h, bytes):
                python_hash = isinstance(h, int)
                raise AssertionError(
                    f"Day {DAY}, exercise 1: a block hash should be the bytes of a digest "
                    f"(hashlib.sha256(...).digest()); yours is a {type(h).__name__}, {h!r}.\n"
                    "Hint: " + ("Python's hash() gives 64 bits: two different prefixes could "
                                "collide, and a request would be served another's K/V (vLLM "
                                "moved to sha256 for this reason)." if python_hash else
                                "return the digest's bytes, as the engine's BlockHash is."))


def _check_hash_relation(fn, cases: list[HashCase]) -> None:
    """Equal where the engine's hashes are equal, different where they differ."""
    agreement = SameEqualities()
    for case in cases:
        got = _call_hash(fn, case)
        want = reference_hashes(case.block_size, list(case.token_ids), case.extra_keys)
        again = _call_hash(fn, case)
        if again != got:
            raise AssertionError(
                f"Day {DAY}, exercise 1: two calls with the same tokens ({case.describe()}) "
                "gave different hashes.\nHint: a hash must depend on the tokens, the parent "
                "hash and the extra keys only (nothing random, no id() of an object), or no "
                "later request could find the block.")
        for k, (mine, ref) in enumerate(zip(got, want, strict=True)):
            # One hash space per block size.
            clash = agreement.add(mine, (case.block_size, ref), (case, k))
            if clash is None:
                continue
            kind, (other, k2) = clash
            if kind == "collision":
                raise AssertionError(
                    f"Day {DAY}, exercise 1: block {k2} of ({other.describe()}) and block {k} "
                    f"of ({case.describe()}) hold different prefixes, but your hashes for them "
                    f"are equal.\nHint: {_diagnose_collision(other, k2, case, k)}")
            raise AssertionError(
                f"Day {DAY}, exercise 1: block {k2} of ({other.describe()}) and block {k} "
                f"of ({case.describe()}) hold the same tokens after the same prefix, but "
                "your hashes for them differ.\nHint: hash only (parent hash, this block's "
                "tokens as a tuple, extra keys): equal inputs must give equal hashes, or "
                "the prefix cache never hits.")


@contextlib.contextmanager
def block_hasher_from(fn) -> Iterator[None]:
    """Engines built inside use `fn` (hash_request_tokens) for their requests'
    block hashes: the engine core builds its hasher with
    `get_request_block_hasher`, replaced here by one calling `fn`."""

    def get_request_block_hasher(block_size: int):
        def request_block_hasher(request) -> list:
            hashes = fn(block_size, list(request.all_token_ids))
            return list(hashes[len(request.block_hashes):])

        return request_block_hasher

    original = engine_core_module.get_request_block_hasher
    engine_core_module.get_request_block_hasher = get_request_block_hasher
    try:
        yield
    finally:
        engine_core_module.get_request_block_hasher = original


def hash_prompts() -> dict[str, list[int]]:
    """P runs first and generates 10 tokens; Q is P's prompt and output (its
    later blocks were filled by decoding); R shares P's first 8 tokens; S
    shares P's second block only, after another first block."""
    (p,) = token_prompts([10], first=40)
    other, tail = token_prompts([4, 6], first=500)
    return {"P": p, "R": p[:8] + tail, "S": other + p[4:8] + tail}


@functools.cache
def _reference_hash_run() -> tuple[dict[str, tuple[int, int]], ...]:
    return _hash_run(None)


def _hash_run(fn) -> tuple[dict[str, tuple[int, int]], ...]:
    """The hash workload: (request -> (hit, tokens)) for the first pass and
    the second (Q: P's prompt followed by P's output)."""
    context = block_hasher_from(fn) if fn is not None else contextlib.nullcontext()
    with context:
        llm = v1_llm(num_gpu_blocks_override=20)
    prompts = hash_prompts()
    first = run_sequential(llm, {"P": prompts["P"]}, max_tokens=10)
    p_all = prompts["P"] + list(first.finished[0].tokens)
    second = run_sequential(llm, {"Q": p_all, "R": prompts["R"], "S": prompts["S"]})
    return ({f.name: (f.hit_tokens, f.tokens) for f in first.finished},
            {f.name: (f.hit_tokens, f.tokens) for f in second.finished})


def exercise_1(hash_request_tokens) -> None:
    """`hash_request_tokens(block_size, token_ids, extra_keys=None)` on made-up
    and many random prompts against the engine's hashes, then as the hasher
    of a real V1 engine, whose prefix hits must equal the reference's."""
    fn = hash_request_tokens
    crafted = _crafted_cases()
    _check_hash_counts(fn, crafted)
    _check_hash_relation(fn, crafted)
    _check_hash_relation(fn, crafted + _random_cases())
    with learner_code("hash_request_tokens, inside the engine"):
        got = _hash_run(fn)
    want = _reference_hash_run()
    for g, w in zip(got, want, strict=True):
        for name in w:
            if g[name][0] != w[name][0]:
                raise AssertionError(
                    f"Day {DAY}, exercise 1: inside the engine, request {name} found "
                    f"{g[name][0]} tokens in the prefix cache with your hashes, "
                    f"{w[name][0]} with the engine's.\nHint: Q is P's prompt followed by the "
                    "10 tokens P generated: its blocks were hashed as P's tokens were appended, "
                    "one full block at a time; your hashes of a longer token list must begin "
                    "with your hashes of its prefix.")
            if g[name][1] != w[name][1]:
                raise AssertionError(
                    f"Day {DAY}, exercise 1: request {name} generated {list(g[name][1])} with "
                    f"your hashes, {list(w[name][1])} with the engine's: a hit reused K/V "
                    "computed for other tokens.")
    passed(DAY, 1)


# -- exercise 2: the free queue ----------------------------------------------------------

def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


@contextlib.contextmanager
def free_queue_class(cls) -> Iterator[None]:
    """Block pools built inside use `cls` for their free queue."""
    original = block_pool_module.FreeKVCacheBlockQueue
    block_pool_module.FreeKVCacheBlockQueue = cls
    try:
        yield
    finally:
        block_pool_module.FreeKVCacheBlockQueue = original


# A script of queue operations on 8 blocks: (operation, argument).
_SCRIPT: list[tuple[str, Any]] = [
    ("popleft", None), ("popleft", None),
    ("append", 0), ("remove", 4), ("popleft_n", 3),
    ("append_n", [5, 1, 4]), ("remove", 7), ("append", 7), ("remove", 1),
    ("popleft_n", 0), ("popleft_n", 2), ("prepend_n", [2, 3]), ("prepend_n", []),
    ("remove", 2), ("append_n", [2, 6]), ("remove", 3), ("popleft_n", 3),
    ("popleft_n", 2), ("prepend_n", [7, 1]), ("popleft", None),
]


def _describe_op(op: str, arg: Any) -> str:
    if op in ("append", "remove"):
        return f"{op}(block {arg})"
    if op in ("append_n", "prepend_n"):
        return f"{op}(blocks {arg})"
    return f"{op}({'' if arg is None else arg})"


def _queue_state(queue) -> tuple[list[int], int]:
    return _ids(queue.get_all_free_blocks()), queue.num_free_blocks


def _op_hint(op: str, want_ids, got_ids, want_n, got_n, result_want, result_got) -> str:
    if op == "init":
        if got_ids == want_ids[::-1]:
            return ("get_all_free_blocks lists the queue from the HEAD (the next block "
                    "handed out) to the tail; yours lists it tail first.")
        return "the queue starts with the given blocks in the given order, all of them free."
    if result_got is not None and result_want is not None and result_got != result_want:
        if op == "popleft":
            return ("popleft takes the HEAD: the block freed longest ago (least recently "
                    "used). Handing out the most recently freed block would evict the very "
                    "blocks a returning request is most likely to hit.")
        if op == "popleft_n" and len(result_got) != len(result_want):
            return (f"popleft_n(n) hands out exactly n blocks, here {len(result_want)}, not "
                    f"{len(result_got)}: check the loop's bounds.")
        return "popleft_n(n) hands out the first n blocks from the head, head first."
    if got_n != want_n and got_ids == want_ids:
        verb = {"remove": "remove takes one away", "append": "append adds one",
                "append_n": "append_n adds one per block",
                "prepend_n": "prepend_n adds one per block",
                "popleft": "popleft takes one away", "popleft_n": "popleft_n takes n away"}[op]
        return (f"num_free_blocks must follow every change ({verb}): allocate_slots compares "
                "it with the blocks a step needs, so a wrong count admits requests that do "
                "not fit, or refuses ones that do.")
    if op == "prepend_n":
        return ("prepend_n puts the blocks at the HEAD, in the order given (the first given "
                "is handed out first): the pool frees a request's uncached blocks there, last "
                "block first, since no hit can want them. Prepending them one at a time "
                "reverses them.")
    if op in ("append", "append_n"):
        if got_ids and want_ids and got_ids[0] != want_ids[0]:
            return ("a freed block goes to the TAIL: it was used most recently, so it is "
                    "evicted last. Putting it at the head makes the queue a stack, and the "
                    "next allocation overwrites the prefix just freed.")
        return ("append_n appends the blocks in the order given (the first given is evicted "
                "first): the caller passes a request's blocks tail first on purpose.")
    if op == "remove":
        return ("remove must unlink the block from wherever it is, in O(1): its neighbours "
                "point at each other (prev.next = block.next, next.prev = block.prev), then "
                "the block's own links are cleared. A touched cached block must not be "
                "handed out again while a request uses it.")
    return "compare the queue with the reference after this operation."


def _check_queue_script(cls) -> None:
    """The script on 8 made-up blocks, the learner's queue beside the reference's."""
    blocks_ref = [KVCacheBlock(i) for i in range(8)]
    blocks_got = [KVCacheBlock(i) for i in range(8)]
    with learner_code(f"{cls.__name__}(blocks)"):
        queue = cls(list(blocks_got))
    ref = FreeKVCacheBlockQueue(list(blocks_ref))
    done = ["start: blocks 0..7 free"]
    steps = [("init", None), *_SCRIPT]
    for op, arg in steps:
        result_ref = result_got = None
        if op != "init":
            done.append(_describe_op(op, arg))
            args_ref = args_got = ()
            if op in ("append", "remove"):
                args_ref, args_got = (blocks_ref[arg],), (blocks_got[arg],)
            elif op in ("append_n", "prepend_n"):
                args_ref = ([blocks_ref[i] for i in arg],)
                args_got = ([blocks_got[i] for i in arg],)
            elif op == "popleft_n":
                args_ref = args_got = (arg,)
            out_ref = getattr(ref, op)(*args_ref)
            with learner_code(f"{cls.__name__}.{op}", _queue_error_hint(op)):
                out_got = getattr(queue, op)(*args_got)
            if op == "popleft":
                result_ref, result_got = [out_ref.block_id], [getattr(out_got, "block_id", out_got)]
            elif op == "popleft_n":
                result_ref = _ids(out_ref)
                result_got = [getattr(b, "block_id", b) for b in (out_got or [])]
        with learner_code(f"{cls.__name__}.get_all_free_blocks", _queue_error_hint("walk")):
            got_ids, got_n = _queue_state(queue)
        want_ids, want_n = _queue_state(ref)
        if (got_ids, got_n, result_got) != (want_ids, want_n, result_ref):
            said = "" if result_ref is None else (
                f"\n  it returned blocks {result_got}, the reference {result_ref}")
            raise AssertionError(
                f"Day {DAY}, exercise 2: after {' -> '.join(done)}:\n"
                f"  your queue (head first) {got_ids}, num_free_blocks {got_n}\n"
                f"  the reference           {want_ids}, num_free_blocks {want_n}{said}\n"
                f"Hint: {_op_hint(op, want_ids, got_ids, want_n, got_n, result_ref, result_got)}")
    too_many = ("popleft_n(n) with fewer than n free blocks should raise ValueError before "
                "taking any (handing out blocks that are not free would give one block to "
                "two requests).")
    with learner_code(f"{cls.__name__}.popleft_n(num_free_blocks + 1)", too_many):
        try:
            queue.popleft_n(queue.num_free_blocks + 1)
        except ValueError:
            pass
        else:
            raise AssertionError(
                f"Day {DAY}, exercise 2: popleft_n(n) with fewer than n free blocks should raise "
                "ValueError (handing out blocks that are not free would give one block to two "
                "requests); yours returned.")


def _queue_error_hint(op: str) -> Callable[[BaseException], str]:
    def hint(error: BaseException) -> str:
        if isinstance(error, AttributeError) and "NoneType" in str(error):
            return ("a link is None where the walk expected a block: after remove, the "
                    "removed block's neighbours must point at each other, and a popped or "
                    "removed block's own links are cleared only after that.")
        if op == "walk":
            return "get_all_free_blocks walks from the head's next to the tail sentinel."
        return f"compare your {op} with the docstring above the exercise."

    return hint


def _compare_sequential(got: SequentialRun, want: SequentialRun, what: str) -> None:
    for g, w in zip(got.finished, want.finished, strict=True):
        for attr, label in (("block_ids", "held the blocks"), ("hit_tokens", "hit"),
                            ("queue_after", "left the free queue (head first)"),
                            ("num_free_after", "left num_free_blocks at")):
            if getattr(g, attr) != getattr(w, attr):
                raise AssertionError(
                    f"Day {DAY}, exercise 2: {what}: request {g.name} {label} "
                    f"{getattr(g, attr)} with your queue, {getattr(w, attr)} with the "
                    f"reference's.\nHint: {_engine_hint(attr)}")


def _engine_hint(attr: str) -> str:
    return {
        "block_ids": "the engine takes new blocks with popleft_n (the head) and gives a "
                     "request's blocks back last block first: the cached ones with append_n "
                     "(the tail), the others with prepend_n (the head).",
        "hit_tokens": "a hit depends on which cached blocks are still there: the head of the "
                      "queue is evicted first, so the order decides who hits.",
        "queue_after": "after a request finishes, its cached blocks join the tail in the "
                       "order append_n receives them, its uncached ones the head in the order "
                       "prepend_n receives them.",
        "num_free_after": "num_free_blocks must equal the number of blocks in the queue.",
        "queue": "compare the queue after each step with the reference's.",
    }[attr]


def exercise_2(queue_cls) -> None:
    """The learner's free queue on a script of operations, then inside the
    block pool of real V1 engines: the lab's scenario (requests one after
    another) and a batch that preempts; block tables, hits, the free queue
    and the tokens must equal the reference's."""
    _check_queue_script(queue_cls)
    what = "the lab's scenario (A, B, C, then D, E, F, one after another)"
    with free_queue_class(queue_cls):
        llm = v1_llm()
    with learner_code(f"{queue_cls.__name__}, inside the engine", _queue_error_hint("engine")):
        got = run_sequential(llm, scenario_prompts())
    _compare_sequential(got, reference_scenario(), what)
    with free_queue_class(queue_cls):
        llm = v1_llm()
    with learner_code(f"{queue_cls.__name__}, inside the engine", _queue_error_hint("engine")):
        got_batch = run_batch(llm, batch_prompts(), BATCH_MAX_TOKENS)
    want_batch = reference_batch()
    for i, (g, w) in enumerate(zip(got_batch.steps, want_batch.steps, strict=False)):
        if (g.blocks, g.queue, g.num_free) != (w.blocks, w.queue, w.num_free):
            raise AssertionError(
                f"Day {DAY}, exercise 2: the batch (X, Y, Z sharing 8 tokens, growing to 20 in "
                f"9 blocks), after step {i}:\n"
                f"  yours: blocks {g.blocks}, free queue {g.queue} ({g.num_free} free)\n"
                f"  ref:   blocks {w.blocks}, free queue {w.queue} ({w.num_free} free)\n"
                f"Hint: {_engine_hint('block_ids')}")
    if got_batch.tokens != want_batch.tokens or len(got_batch.steps) != len(want_batch.steps):
        raise AssertionError(
            f"Day {DAY}, exercise 2: the batch generated {got_batch.tokens} in "
            f"{len(got_batch.steps)} steps with your queue, {want_batch.tokens} in "
            f"{len(want_batch.steps)} with the reference's.")
    passed(DAY, 2)


# -- exercise 3: the free queue and the hits, by hand ---------------------------------------

def simulate_scenario(*, tail_first: bool = True, freed_to_tail: bool = True,
                      uncached_to_head: bool = True, cap: bool = True, evict: bool = True,
                      null_in_queue: bool = False) -> tuple[list[int], dict[str, int]]:
    """The lab's scenario by the rules (each flag off: a mistaken rule):
    (the free queue after C, head first; hit tokens of D, E and F)."""
    bs = BLOCK_SIZE
    prompts = scenario_prompts()
    queue = list(range(0 if null_in_queue else 1, ENGINE["num_gpu_blocks_override"]))
    cached: dict[tuple[int, ...], int] = {}  # prefix tokens -> block
    content: dict[int, tuple[int, ...]] = {}  # block -> the prefix it caches
    after_c, hits = None, {}
    for name, tokens in prompts.items():
        limit = (len(tokens) - 1) if cap else len(tokens)
        hit_blocks = []
        for k in range(limit // bs):
            block = cached.get(tuple(tokens[:(k + 1) * bs]))
            if block is None:
                break
            hit_blocks.append(block)
        for block in hit_blocks:
            if block in queue:
                queue.remove(block)
        needed = -(-len(tokens) // bs) - len(hit_blocks)
        new, queue = queue[:needed], queue[needed:]
        for block in new:
            if evict and block in content:
                cached.pop(content.pop(block), None)
        blocks = hit_blocks + new
        for k in range(len(hit_blocks), len(tokens) // bs):
            prefix = tuple(tokens[:(k + 1) * bs])
            cached.setdefault(prefix, blocks[k])
            content[blocks[k]] = prefix
        freed = list(reversed(blocks)) if tail_first else list(blocks)
        if not freed_to_tail:
            queue = freed + queue
        elif not uncached_to_head:
            queue = queue + freed
        else:  # cached blocks to the tail, the others (a partial block) to the head
            queue = ([b for b in freed if b not in content] + queue
                     + [b for b in freed if b in content])
        if name == "C":
            after_c = list(queue)
        if name in "DEF":
            hits[name] = len(hit_blocks) * bs
    return after_c, hits


_EX3_MISTAKES = [
    ({"tail_first": False},
     "a finished request's blocks are given back LAST block first (KVCacheManager.free "
     "passes them reversed): the end of a prompt is the part least likely to be shared, so "
     "it should be evicted before the beginning."),
    ({"freed_to_tail": False},
     "freed blocks that are cached join the TAIL of the queue and new blocks come from the "
     "head: the cached blocks are evicted least recently used first."),
    ({"uncached_to_head": False},
     "a freed block that holds no cached block (A's partial last block) goes to the HEAD of "
     "the queue, not the tail: no request can ever hit it, so it is reused before any "
     "cached block is evicted (BlockPool.free_blocks: prepend_n for blocks without a hash)."),
    ({"null_in_queue": True},
     "block 0 is the null block: the pool takes it out of the queue at the start and never "
     "hands it out or frees it."),
    ({"cap": False},
     "at most num_tokens - 1 tokens come from the cache: the last prompt token must be "
     "computed, its logits give the first output token. A prompt that is exactly cached "
     "blocks hits one block less."),
    ({"evict": False},
     "a cached block handed out from the head of the queue is evicted: its hash is "
     "forgotten as its slots are overwritten. Follow D: which block did its second block "
     "come from, and what did that block hold?"),
]


def exercise_3(queue_after_c: list[int], hit_tokens: dict[str, int]) -> None:
    """The free queue after A, B and C (head first) and the hits of D, E and F,
    against the reference engine's run of the scenario."""
    run = reference_scenario().by_name()
    want_queue = run["C"].queue_after
    want_hits = {name: run[name].hit_tokens for name in "DEF"}
    assert simulate_scenario() == (want_queue, want_hits), "the rules disagree with the engine"
    got_queue = list(queue_after_c) if queue_after_c is not None else None
    got_hits = dict(hit_tokens) if hit_tokens is not None else None
    if got_queue == want_queue and got_hits == want_hits:
        passed(DAY, 3)
        return
    in_blocks = got_hits is not None and set(got_hits) == set(want_hits) and all(
        got_hits[n] * BLOCK_SIZE == want_hits[n] for n in want_hits)
    if in_blocks and any(want_hits.values()):
        hint = ("the hits are in TOKENS (num_cached_tokens), not blocks: blocks times "
                f"block_size ({BLOCK_SIZE}).")
    else:
        hint = None
        mistaken = [(simulate_scenario(**flags), text) for flags, text in _EX3_MISTAKES]
        for (queue, hits), text in mistaken:  # the whole answer follows one mistaken rule
            if (got_queue, got_hits) == (queue, hits):
                hint = text
                break
        for (queue, hits), text in mistaken if hint is None else []:  # or the wrong half does
            if (got_queue == queue != want_queue) or (got_hits == hits != want_hits):
                hint = text
                break
        if hint is None:
            hint = ("walk it block by block: the queue starts [1..9]; each request takes "
                    "ceil(tokens / 4) blocks from the head (after its hits), caches its full "
                    "blocks, and on finishing gives them back last block first: cached "
                    "ones to the tail, the others to the head.")
    which = []
    if got_queue != want_queue:
        which.append(f"the free queue after C should be {want_queue}; yours is {got_queue}")
    if got_hits != want_hits:
        which.append(f"the hits should be {want_hits}; yours are {got_hits}")
    raise AssertionError(f"Day {DAY}, exercise 3: " + "; ".join(which) + f".\nHint: {hint}")


# -- exercise 4: what crosses the wire ------------------------------------------------------

# "long" first: its first step is a prompt chunk alone, a step with no news.
WIRE_PROMPTS = {"long": 40, "short": 6, "mid": 12}
WIRE_ENGINE = dict(block_size=16, num_gpu_blocks_override=16, max_model_len=64,
                   max_num_batched_tokens=16)


class _Inner:
    """Stands between the learner's tap and the real InprocClient: records
    the objects the engine core receives and produces."""

    def __init__(self, client: InprocClient) -> None:
        self.client = client
        self.engine_core = client.engine_core
        self.received: list[Any] = []
        self.produced: list[EngineCoreOutputs] = []
        self.aborts: list[list[str]] = []

    def add_request(self, request) -> None:
        self.received.append(request)
        self.client.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        out = self.client.get_output()
        self.produced.append(out)
        return out

    def abort_requests(self, request_ids) -> None:
        self.aborts.append(list(request_ids))
        self.client.abort_requests(request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.client.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.client.shutdown()


class _Outer:
    """Stands between the front end and the learner's tap: records what the
    front end sends and gets back."""

    def __init__(self, tap) -> None:
        self.client = tap
        self.sent: list[EngineCoreRequest] = []
        self.returned: list[Any] = []

    def add_request(self, request) -> None:
        self.sent.append(request)
        self.client.add_request(request)

    def get_output(self):
        out = self.client.get_output()
        self.returned.append(out)
        return out

    def abort_requests(self, request_ids) -> None:
        self.client.abort_requests(request_ids)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.client.reset_prefix_cache(reset_running_requests)

    def shutdown(self) -> None:
        self.client.shutdown()


def wire_prompts() -> dict[str, list[int]]:
    return dict(zip(WIRE_PROMPTS, token_prompts(list(WIRE_PROMPTS.values()), first=60),
                    strict=True))


def run_wire(tap_cls=None):
    """The wire workload on a fresh engine, its client wrapped in `tap_cls`
    (between two recorders): (outer, tap, inner, request outputs)."""
    llm = v1_llm(**WIRE_ENGINE)
    engine = llm.llm_engine
    inner = _Inner(engine.engine_core)
    tap = tap_cls(inner) if tap_cls is not None else inner
    outer = _Outer(tap)
    engine.engine_core = outer
    prompts = wire_prompts()
    outputs: dict[str, tuple[int, ...]] = {}
    for name, tokens in prompts.items():
        engine.add_request(name, {"prompt_token_ids": tokens}, greedy(4))
    engine.add_request("dropped", {"prompt_token_ids": prompts["mid"]}, greedy(4))
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = tuple(out.outputs[0].token_ids)
        step += 1
        if step == 1:
            engine.abort_request("dropped")
        if step > 100:
            raise AssertionError(f"Day {DAY}, exercise 4: the run did not finish.")
    return outer, tap, inner, outputs


@functools.cache
def _reference_wire_tokens() -> tuple:
    _, _, _, outputs = run_wire()
    return tuple(sorted(outputs.items()))


def _wire_error_hint(error: BaseException) -> str:
    if isinstance(error, AttributeError):
        return ("the front end calls more than add_request and get_output: it calls "
                "abort_requests every step (with the requests a stop string ended), and "
                "shutdown and reset_prefix_cache: pass those on to the client.")
    return "add_request pickles and sends; get_output receives and unpickles."


def exercise_4(tap_cls) -> None:
    """`tap_cls(client)`: a client that makes everything cross as bytes
    (pickle both ways) and records each message's size in `sent` and
    `received`, run as the client of a real in-process V1 engine."""
    with learner_code(f"{tap_cls.__name__}, as the engine's client", _wire_error_hint):
        outer, tap, inner, outputs = run_wire(tap_cls)
    sent = getattr(tap, "sent", None)
    received = getattr(tap, "received", None)
    if not isinstance(sent, list) or not isinstance(received, list):
        raise AssertionError(
            f"Day {DAY}, exercise 4: your tap should keep two lists, `sent` (one size per "
            f"request sent) and `received` (one size per outputs message); found sent={sent!r}, "
            f"received={received!r}.")
    if tuple(sorted(outputs.items())) != _reference_wire_tokens():
        raise AssertionError(
            f"Day {DAY}, exercise 4: with your tap the requests generated "
            f"{dict(sorted(outputs.items()))}, without it {dict(_reference_wire_tokens())}: "
            "the engine core must get every request and the front end every output.")
    for front, core in zip(outer.sent, inner.received, strict=True):
        if front is core or front.sampling_params is core.sampling_params:
            raise AssertionError(
                f"Day {DAY}, exercise 4: the engine core received the very EngineCoreRequest "
                "object the front end made. Across a process boundary nothing is shared: "
                "send pickle.dumps(request) and hand the engine core pickle.loads of those "
                "bytes, so it gets only what survives the trip.")
    for produced, returned in zip(inner.produced, outer.returned, strict=True):
        if produced is returned:
            raise AssertionError(
                f"Day {DAY}, exercise 4: the front end got the engine core's own "
                "EngineCoreOutputs object: return pickle.loads of the bytes you measured, the "
                "copy that crossed.")
    want_sent = [len(pickle.dumps(r)) for r in outer.sent]
    want_received = [len(pickle.dumps(o)) for o in inner.produced]
    per_request = sum(len(o.outputs) for o in inner.produced)
    if sent != want_sent:
        hint = ("measure len(pickle.dumps(request)), the bytes that cross: sys.getsizeof "
                "counts a Python object's own header, not what it refers to."
                if len(sent) == len(want_sent) else
                "one entry per add_request: the size of that EngineCoreRequest, pickled.")
        raise AssertionError(
            f"Day {DAY}, exercise 4: `sent` should be {want_sent} (bytes per request); yours "
            f"is {sent}.\nHint: {hint}")
    if received != want_received:
        if len(received) == per_request:
            hint = ("one message per step, the whole EngineCoreOutputs, however many "
                    "requests it carries news for (you counted one per request).")
        elif len(received) < len(want_received):
            hint = ("every step sends one message, even one with no news (a prompt chunk "
                    "that did not finish its prompt produces no token): the front end waits "
                    "for it all the same.")
        elif len(received) == len(want_received):
            hint = ("pickle the whole EngineCoreOutputs (the outputs and the stats and "
                    "timestamp with them), as the engine core's output thread does, and take "
                    "len() of the bytes; sys.getsizeof does not measure what crosses.")
        else:
            hint = "one entry per get_output() call."
        raise AssertionError(
            f"Day {DAY}, exercise 4: `received` should be {want_received} (bytes per step); "
            f"yours is {received}.\nHint: {hint}")
    passed(DAY, 4)


def wire_report(tap) -> str:
    """What crossed: messages and bytes each way."""
    return (f"to the engine core: {sum(tap.sent)} bytes in {len(tap.sent)} message(s); "
            f"back: {sum(tap.received)} bytes in {len(tap.received)} message(s)")


def text_in(payloads: list[bytes], texts: list[str]) -> bool:
    """Whether any of `texts` appears in any payload (as UTF-8)."""
    return any(t.encode() in p for p, t in itertools.product(payloads, texts) if t)
