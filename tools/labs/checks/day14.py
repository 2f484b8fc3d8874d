"""Checkers for day 14, scaling out (labs/day14_scaling_out.ipynb).

Each checker runs the learner's code on small made-up cases that make each
common mistake visible, then against the real thing: the collectives the
driver of a real 2-rank engine makes, two real gloo ranks, the engine's own
`QKVParallelLinear.weight_loader`, or the learner's layer inside a real
`tensor_parallel_size=2` engine whose greedy tokens must equal one worker's.
It prints one line, or raises AssertionError saying what was expected, what
came back, and where to look.

Code that must run in the engine's other worker process (exercise 2) is
written by the checker into a small module in a temporary folder on
`sys.path`: a function defined in a notebook cell lives in the kernel's
`__main__`, which a spawned process cannot import, so it travels as source.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import math
import os
import re
import shutil
import sys
import tempfile
import textwrap
import uuid
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from minivllm import LLM, SamplingParams
from minivllm.assets import DEFAULT_MODEL
from minivllm.distributed import get_tp_group, parallel_state, tensor_model_parallel_all_reduce
from minivllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from minivllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size
from minivllm.model_executor.models import ModelRegistry
from minivllm.model_executor.models.llama import LlamaForCausalLM
from minivllm.model_executor.weight_utils import default_weight_loader
from minivllm.tracer.trace import Trace
from tools.labs.checks._common import needs, passed  # noqa: F401 - needs: for the notebook
from tools.labs.checks._engine_runs import learner_code, quiet_engine
from tools.labs.distributed import run_ranks

DAY = 14

# The shipped model (minivllm-stories): 4 layers, hidden 192, 6 query heads
# and 2 KV heads of 32, vocabulary 1271 (padded to 1280).
MODEL_LAYERS, MODEL_HIDDEN, MODEL_VOCAB = 4, 192, 1271

# The lab's workload: three prompts decoding together, greedy.
PROMPTS = ["Once upon a time", "The little dog", "Lily had a red ball and"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def shutdown(llm: LLM) -> None:
    """Stop a tensor-parallel engine's worker processes (one TP engine per process)."""
    llm.llm_engine.model_executor.shutdown()


@functools.lru_cache(maxsize=4)
def one_worker_tokens(prompts: tuple[str, ...] = tuple(PROMPTS)) -> tuple[tuple[int, ...], ...]:
    """The greedy tokens of one worker (tensor_parallel_size=1): the reference."""
    with quiet_engine():
        llm = LLM(disable_log_stats=True)
        outs = llm.generate(list(prompts), GREEDY, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


# -- exercise 1: the collectives of one decode step -------------------------------------

KEYS = ("broadcast_calls", "all_reduce_calls", "all_reduce_bytes", "gather_calls", "gather_bytes")


def reference_collectives(num_layers: int, hidden_size: int, vocab_size: int, batch: int,
                          tp: int) -> dict[str, int]:
    """What the driver puts into collectives in one decode step of `batch`
    sequences (float32 activations), by kind."""
    if tp == 1:
        return dict.fromkeys(KEYS, 0)
    hidden_bytes = batch * hidden_size * 4
    return {
        "broadcast_calls": 1 + 6,  # the pickled plain values, then one per tensor
        "all_reduce_calls": 1 + 2 * num_layers,  # the embedding, then 2 per layer
        "all_reduce_bytes": (1 + 2 * num_layers) * hidden_bytes,
        "gather_calls": 1,  # the logits, to the driver
        "gather_bytes": batch * pad_vocab_size(vocab_size) // tp * 4,
    }


# Made-up configurations: (num_layers, hidden_size, vocab_size, batch, tp).
_CONFIGS = [
    (2, 64, 1000, 3, 4),  # 1000 pads to 1024: the padding shows; batch, tp, 4 bytes all differ
    (32, 4096, 32000, 8, 4),  # Llama-2-7B's shapes
    (80, 8192, 32000, 1, 8),
    (3, 48, 128, 5, 2),
    (4, 192, 1271, 3, 1),  # one worker: no collective at all
]


def _ex1_hint(key: str, got: int, want: int, cfg: tuple[int, ...]) -> str:
    layers, hidden, vocab, batch, tp = cfg
    if tp == 1:
        return ("with one worker there is no process group and no collective at all: every "
                "count and every byte is 0.")
    if key.endswith("_calls") and got == want * tp:
        return ("you counted every rank's collectives: a step's count is what one rank (the "
                "driver, whose counters the engine reads) takes part in; every rank joins the "
                "same collectives, so multiplying by tp counts each one tp times.")
    if key == "broadcast_calls":
        if got == 0:
            return ("the step starts with the driver broadcasting its input to the other "
                    "ranks (`Worker.execute_model` -> `broadcast_tensor_dict`): those are "
                    "collectives too.")
        return ("`broadcast_tensor_dict` makes one broadcast of a pickled object (the plain "
                "values and each tensor's dtype and shape), then one broadcast per tensor: "
                "input_ids, positions, selected_token_indices, slot_mapping, block_tables, "
                "seq_lens_tensor — 1 + 6.")
    if key == "all_reduce_calls":
        if got == 2 * layers:
            return ("you forgot the embedding's all-reduce: `VocabParallelEmbedding` looks up "
                    "only its rows of the vocabulary and all-reduces the result, before the "
                    "first layer.")
        if got in (layers, layers + 1):
            return ("each layer has two blocks, attention and MLP, and each ends with a "
                    "row-parallel projection (o_proj, down_proj) and its all-reduce: 2 per "
                    "layer, plus one for the embedding.")
        if got in (2 * layers + 2, 2 * layers + 2 + 1):
            return ("the logits are not all-reduced: each rank scores its slice of the "
                    "vocabulary and a gather brings the slices to the driver (one gather, not "
                    "an all-reduce); the q/k/v and gate/up projections are column-parallel and "
                    "need no collective.")
        return ("one all-reduce for the embedding, then two per layer (after o_proj, after "
                "down_proj).")
    if key == "all_reduce_bytes":
        calls = 1 + 2 * layers
        if got == calls * batch * hidden * 2:
            return ("the engine runs in float32 on this CPU: 4 bytes per value, not 2 "
                    "(float16 is what a GPU would use).")
        if got * tp == want:
            return ("an all-reduce's input is the whole [batch, hidden_size] partial sum on "
                    "every rank: its size does not shrink with tp (only the weights do).")
        if got * batch == want:
            return ("a decode step has `batch` tokens, one per sequence: each all-reduce "
                    "carries batch x hidden_size values.")
        return ("each all-reduce carries the batch's hidden states, batch x hidden_size "
                "float32 values (4 bytes each); count all of them.")
    if key == "gather_bytes":
        padded = pad_vocab_size(vocab)
        if got == batch * padded * 4 or got == batch * vocab * 4:
            return ("the driver puts only its own slice of the logits into the gather: "
                    "padded_vocab / tp columns per row, not the whole vocabulary.")
        if got == batch * vocab // tp * 4 or got == batch * (vocab / tp) * 4:
            return ("the vocabulary is padded to a multiple of 64 rows before it is split "
                    "(`pad_vocab_size`), so each rank scores padded_vocab / tp columns.")
        if got == batch * padded // tp * 2:
            return "the logits are float32 here: 4 bytes per value."
        return ("one gather of the logits: each of the batch's rows (one per sequence at "
                "decode) has padded_vocab / tp float32 values on each rank.")
    return "the logits travel in one gather, to the driver."


def _call_ex1(fn, cfg: tuple[int, ...]) -> dict[str, int]:
    with learner_code(f"decode_step_collectives{cfg}"):
        got = fn(*cfg)
    if not isinstance(got, dict) or set(got) != set(KEYS):
        raise AssertionError(
            f"Day {DAY}, exercise 1: decode_step_collectives{cfg} should return a dict with the "
            f"keys {list(KEYS)}; got {got!r}."
        )
    return got


def _compare_ex1(got: dict, want: dict, cfg: tuple[int, ...], where: str) -> None:
    names = "(num_layers, hidden_size, vocab_size, batch, tp)"
    for key in KEYS:
        if got[key] != want[key]:
            raise AssertionError(
                f"Day {DAY}, exercise 1: {where}, {names} = {cfg}: {key} should be "
                f"{want[key]}, yours is {got[key]}.\nHint: "
                f"{_ex1_hint(key, got[key], want[key], cfg)}"
            )


class KindCounter:
    """Counts the driver's collectives by kind, by wrapping the methods of
    its `GroupCoordinator` (the engine's own counters, `stats`, keep running)."""

    KINDS = {"broadcast": "broadcast", "broadcast_object": "broadcast",
             "all_reduce": "all_reduce", "gather": "gather", "all_gather": "all_gather"}

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.group = get_tp_group()
        for method in self.KINDS:
            setattr(self.group, method, self._wrap(method, getattr(self.group, method)))

    def _wrap(self, method: str, original):
        kind = self.KINDS[method]

        def counted(*args, **kwargs):
            tensor = args[0] if args else None
            self.calls[kind] += 1
            if isinstance(tensor, torch.Tensor):
                self.bytes[kind] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return counted

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return Counter(self.calls), Counter(self.bytes)


class _DecodeSteps:
    """A step observer: per step whose batch is all decodes, the driver's
    collectives by kind (the counters' change over the step) and the trace's totals."""

    def __init__(self, counter: KindCounter, batch: int) -> None:
        self.counter, self.batch = counter, batch
        self.rows: list[dict[str, Any]] = []
        self._last = counter.snapshot()

    def on_add_request(self, engine, seq_group) -> None:
        pass

    def on_step(self, engine, record) -> None:
        now = self.counter.snapshot()
        (calls0, bytes0), self._last = self._last, now
        decodes = [m for m in record.seq_group_metadata_list if not m.is_prompt]
        if len(decodes) == self.batch == len(record.seq_group_metadata_list):
            self.rows.append({"calls": now[0] - calls0, "bytes": now[1] - bytes0,
                              "stats": record.collectives})


def measure_decode_step(prompts=tuple(PROMPTS)) -> dict[str, Any]:
    """One real run on 2 ranks: per kind, the driver's calls and bytes in
    the first step in which every prompt decodes, and the engine's own
    `CollectiveStats` of that step (what the trace records)."""
    with quiet_engine():
        llm = LLM(tensor_parallel_size=2, disable_log_stats=True)
        try:
            counter = KindCounter()
            observer = _DecodeSteps(counter, len(prompts))
            llm.llm_engine.add_step_observer(observer)
            llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=3,
                                                       ignore_eos=True), use_tqdm=False)
        finally:
            shutdown(llm)
    row = observer.rows[0]
    return {"calls": dict(row["calls"]), "bytes": dict(row["bytes"]),
            "trace_calls": row["stats"].calls, "trace_bytes": row["stats"].bytes}


def exercise_1(decode_step_collectives) -> None:
    """`decode_step_collectives(num_layers, hidden_size, vocab_size, batch,
    tp)` on made-up shapes, then against a real 2-rank decode step."""
    fn = decode_step_collectives
    for cfg in _CONFIGS:
        _compare_ex1(_call_ex1(fn, cfg), reference_collectives(*cfg), cfg, "made-up shapes")
    cfg = (MODEL_LAYERS, MODEL_HIDDEN, MODEL_VOCAB, len(PROMPTS), 2)
    got = _call_ex1(fn, cfg)
    measured = measure_decode_step()
    real = {
        "broadcast_calls": measured["calls"].get("broadcast", 0),
        "all_reduce_calls": measured["calls"].get("all_reduce", 0),
        "all_reduce_bytes": measured["bytes"].get("all_reduce", 0),
        "gather_calls": measured["calls"].get("gather", 0),
        "gather_bytes": measured["bytes"].get("gather", 0),
    }
    _compare_ex1(got, real, cfg, "the real engine on 2 ranks (the shipped model)")
    total_calls = sum(got[k] for k in KEYS if k.endswith("_calls"))
    assert total_calls == measured["trace_calls"], (
        f"Day {DAY}, exercise 1: your counts add up to {total_calls} collectives, the engine's "
        f"CollectiveStats (the trace's `collectives.calls`) counted {measured['trace_calls']}."
    )
    broadcast_bytes = measured["bytes"].get("broadcast", 0)
    total_bytes = got["all_reduce_bytes"] + got["gather_bytes"] + broadcast_bytes
    assert total_bytes == measured["trace_bytes"], (
        f"Day {DAY}, exercise 1: all-reduces + gather + the step's input ({broadcast_bytes} "
        f"bytes) make {total_bytes} bytes; the trace's `collectives.bytes` is "
        f"{measured['trace_bytes']}."
    )
    passed(DAY, 1)


# -- exercise 2: RowParallelLinear ------------------------------------------------------

_HEADER = "import math\n\nimport torch\nimport torch.nn.functional as F\n\n"


def _source(fn) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as error:
        raise AssertionError(
            f"Day {DAY}: the checker needs the source of `{fn.__name__}` to run it in the "
            f"other rank's process, and Python cannot find it ({error}). Define it with `def` "
            "in a cell (not a lambda) and run that cell."
        ) from error


@contextlib.contextmanager
def learner_module(fns: dict[str, Any], footer: str = ""):
    """The functions' source in a fresh module, each also bound to the name
    `fns` gives it (a learner may call theirs anything), plus `footer`, in a
    temporary folder on sys.path, so a spawned process can import it; the
    module's name. The functions must be self-contained: only torch, F and
    math are imported for them."""
    name = f"day14_yours_{uuid.uuid4().hex[:12]}"
    folder = tempfile.mkdtemp(prefix="day14-")
    aliases = "".join(f"{alias} = {fn.__name__}\n" for alias, fn in fns.items()
                      if alias != fn.__name__)
    text = (_HEADER + "\n\n".join(_source(fn) for fn in fns.values()) + "\n\n" + aliases
            + footer)
    with open(os.path.join(folder, name + ".py"), "w") as f:
        f.write(text)
    sys.path.insert(0, folder)
    try:
        yield name
    finally:
        sys.path.remove(folder)
        sys.modules.pop(name, None)
        shutil.rmtree(folder, ignore_errors=True)


# The made-up layer: in 24 -> out 16 (not square, so a split on the wrong
# dimension cannot go unnoticed), 5 tokens.
ROW_IN, ROW_OUT, ROW_TOKENS = 24, 16, 5


def _row_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(14)
    x = torch.randn(ROW_TOKENS, ROW_IN, generator=g)
    w = torch.randn(ROW_OUT, ROW_IN, generator=g)
    b = torch.randn(ROW_OUT, generator=g) + 3.0  # large: a bias counted twice shows
    return x, w, b


def _check_row_shard(row_shard) -> None:
    _, w, _ = _row_inputs()
    for tp in (2, 4):
        for rank in range(tp):
            with learner_code(f"row_shard(weight, tp_rank={rank}, tp_size={tp})"):
                got = row_shard(w, rank, tp)
            want = w.chunk(tp, dim=1)[rank]
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                hint = ("a row-parallel layer splits the weight's *input* columns (dim 1 of "
                        "the [out, in] weight), so every rank keeps all output rows."
                        if isinstance(got, torch.Tensor) and got.shape[0] != ROW_OUT
                        else "each rank holds in/tp columns.")
                raise AssertionError(
                    f"Day {DAY}, exercise 2: row_shard of a [{ROW_OUT}, {ROW_IN}] weight for "
                    f"rank {rank} of {tp} should be {tuple(want.shape)}, yours is {shape}.\n"
                    f"Hint: {hint}"
                )
            if not torch.equal(got, want):
                start = next((r * ROW_IN // tp for r in range(tp)
                              if torch.equal(got, w.chunk(tp, dim=1)[r])), None)
                hint = (f"yours holds columns from {start}: rank r's columns start at "
                        "r * in / tp." if start is not None else
                        "take the contiguous columns [r * in/tp, (r+1) * in/tp) — the slice "
                        "of the input the column-parallel layer before left on rank r.")
                raise AssertionError(
                    f"Day {DAY}, exercise 2: row_shard for rank {rank} of {tp} should hold the "
                    f"weight's columns [{rank * ROW_IN // tp}, {(rank + 1) * ROW_IN // tp}).\n"
                    f"Hint: {hint}"
                )


def _yours(row_shard, row_parallel_linear) -> dict[str, Any]:
    if row_shard.__name__ == row_parallel_linear.__name__:
        raise AssertionError(f"Day {DAY}, exercise 2: give your two functions different names.")
    return {"row_shard": row_shard, "row_parallel_linear": row_parallel_linear}


def _row_rank(rank: int, module_name: str) -> dict[str, Any]:
    """On one of two real ranks: the learner's shard and forward on the
    made-up layer, with and without a bias."""
    yours = importlib.import_module(module_name)
    x, w, b = _row_inputs()
    tp = get_tp_group().world_size
    calls = [0]

    def all_reduce(t):
        calls[0] += 1
        return tensor_model_parallel_all_reduce(t)

    out = {}
    for name, bias in (("bias", b), ("no_bias", None)):
        x_shard = x.chunk(tp, dim=-1)[rank]
        w_shard = yours.row_shard(w, rank, tp)
        y = yours.row_parallel_linear(x_shard, w_shard, bias, rank, all_reduce)
        out[name] = np.asarray(y.detach().numpy(), dtype=np.float64)
    out["all_reduce_calls"] = calls[0]
    return out


def _diagnose_forward(got: np.ndarray, name: str, rank: int, calls: int) -> str:
    x, w, b = (t.double() for t in _row_inputs())
    tp = 2
    bias = b if name == "bias" else torch.zeros_like(b)
    partial = [F.linear(xs, ws) for xs, ws in zip(x.chunk(tp, -1), w.chunk(tp, 1), strict=True)]
    full = sum(partial)
    g = torch.from_numpy(got)
    close = functools.partial(torch.allclose, g, atol=1e-4, rtol=1e-4)
    if calls == 0 or close(partial[rank]) or close(partial[rank] + bias):
        return ("each rank's product is a partial sum over its slice of the input: the ranks "
                "must add them up with `all_reduce` before anything else uses the output.")
    if close(full + tp * bias):
        return ("the bias was added on every rank before the all-reduce, so the sum counts it "
                f"{tp} times: add it on rank 0 only before the all-reduce (as the engine does), "
                "or on every rank after it.")
    if close(full / tp + bias) or close((full + bias) / tp) or close((full + tp * bias) / tp):
        return ("all_reduce sums, it does not average: do not divide by the number of ranks.")
    if close(full):
        return "the bias is missing: add it once (rank 0 before the all-reduce, or after it)."
    if calls > 2:
        return (f"all_reduce ran {calls} times for two calls of the layer: once per forward, on "
                "the partial product.")
    return ("the result is not X W^T + b: multiply the rank's input slice by its weight slice "
            "(F.linear(x, weight)), sum over the ranks, add the bias once.")


def _check_row_on_ranks(row_shard, row_parallel_linear) -> None:
    x, w, b = _row_inputs()
    want = {"bias": F.linear(x, w, b).double().numpy(),
            "no_bias": F.linear(x, w).double().numpy()}
    with learner_module(_yours(row_shard, row_parallel_linear)) as module:
        try:
            results = run_ranks(_row_rank, module)
        except AssertionError as error:
            raise AssertionError(
                f"Day {DAY}, exercise 2: your functions raised on a real rank:\n{error}\n"
                "Hint: they run in another process, from their source: they must not use "
                "anything defined elsewhere in the notebook (torch, F and math are imported "
                "for them); `all_reduce(t)` returns the sum over the ranks."
            ) from None
    for rank, result in enumerate(results):
        for name, value in want.items():
            got = result[name]
            if got.shape != value.shape:
                raise AssertionError(
                    f"Day {DAY}, exercise 2: on rank {rank} of 2, row_parallel_linear returned "
                    f"shape {got.shape}, expected {value.shape} ([tokens, out]: the whole "
                    "output, on every rank)."
                )
            if not np.allclose(got, value, atol=1e-4, rtol=1e-4):
                raise AssertionError(
                    f"Day {DAY}, exercise 2: on rank {rank} of 2 real ranks, "
                    f"row_parallel_linear ({name.replace('_', ' ')}) differs from the unsharded "
                    f"F.linear(x, W, b) by up to {np.abs(got - value).max():.3g}.\nHint: "
                    f"{_diagnose_forward(got, name, rank, result['all_reduce_calls'])}"
                )


class _LearnerRowParallel(RowParallelLinear):
    """The engine's RowParallelLinear with the learner's shard and forward."""

    row_shard = None  # set on the subclass made for the learner's module
    row_forward = None

    def weight_loader(self, param, loaded):
        default_weight_loader(param, type(self).row_shard(loaded, self.tp_rank, self.tp_size))

    def forward(self, x):
        out = type(self).row_forward(x, self.weight, self.bias, self.tp_rank,
                                     tensor_model_parallel_all_reduce)
        return out, None


def llama_with_row(module_name: str, row_shard, row_forward) -> type:
    """A Llama whose o_proj and down_proj are the learner's row-parallel
    layer; its classes are named as if the learner's module defined them
    (the worker process imports them from there)."""
    layer_cls = type("YourRowParallelLinear", (_LearnerRowParallel,),
                     {"row_shard": staticmethod(row_shard),
                      "row_forward": staticmethod(row_forward), "__module__": module_name})

    def __init__(self, config):
        LlamaForCausalLM.__init__(self, config)
        for layer in self.model.layers:
            for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
                old = getattr(owner, name)
                setattr(owner, name, layer_cls(old.input_size, old.output_size,
                                               bias=old.bias is not None))

    return type("LlamaWithYourRowParallel", (LlamaForCausalLM,),
                {"__init__": __init__, "__module__": module_name})


_ENGINE_FOOTER = (
    "from tools.labs.checks.day14 import llama_with_row\n\n"
    "LlamaWithYourRowParallel = llama_with_row(__name__, row_shard, row_parallel_linear)\n"
)


@contextlib.contextmanager
def model_with_architecture(architecture: str, kv_heads: int | None = None):
    """A copy of the shipped model whose config names `architecture`; with
    `kv_heads`, cut down to its first `kv_heads` KV heads (a different,
    smaller model, the same for every worker count)."""
    import json

    from safetensors.torch import load_file, save_file

    folder = tempfile.mkdtemp(prefix="day14-model-")
    try:
        changed = {"config.json"} | ({"model.safetensors"} if kv_heads else set())
        for name in os.listdir(DEFAULT_MODEL):
            if name not in changed:
                os.symlink(os.path.join(DEFAULT_MODEL, name), os.path.join(folder, name))
        with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = [architecture]
        if kv_heads:
            rows = kv_heads * config["head_dim"]
            config["num_key_value_heads"] = kv_heads
            weights = load_file(os.path.join(DEFAULT_MODEL, "model.safetensors"))
            weights = {name: (t[:rows].contiguous() if name.endswith(("k_proj.weight",
                                                                        "v_proj.weight")) else t)
                       for name, t in weights.items()}
            save_file(weights, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_in_engine(architecture: str, model_cls: type, prompts=tuple(PROMPTS),
                  kv_heads: int | None = None) -> tuple:
    """Greedy tokens of a 2-rank engine that builds `model_cls` (registered
    under `architecture`, which reaches the worker process); the driver's model."""
    ModelRegistry.register_model(architecture, model_cls)
    try:
        with model_with_architecture(architecture, kv_heads) as path, quiet_engine():
            llm = LLM(path, tensor_parallel_size=2, disable_log_stats=True)
            try:
                model = llm.llm_engine.worker.model_runner.model
                outs = llm.generate(list(prompts), GREEDY, use_tqdm=False)
            finally:
                shutdown(llm)
    finally:
        # Every later engine ships the registrations to its workers: this
        # one's module is about to be deleted.
        ModelRegistry._registered.pop(architecture, None)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs), model


def _check_row_in_engine(row_shard, row_parallel_linear) -> None:
    want = one_worker_tokens()
    with learner_module(_yours(row_shard, row_parallel_linear), _ENGINE_FOOTER) as module:
        model_cls = importlib.import_module(module).LlamaWithYourRowParallel
        with learner_code(f"Day {DAY}, exercise 2: the 2-rank engine with your row-parallel "
                          "layer"):
            got, model = run_in_engine("Day14LlamaWithYourRowParallel", model_cls)
    used = type(model.model.layers[0].mlp.down_proj).__name__
    assert used == "YourRowParallelLinear", f"the engine should have used your layer, not {used}"
    assert got == want, (
        f"Day {DAY}, exercise 2: with your layer as o_proj and down_proj, the 2-rank engine's "
        f"greedy tokens differ from one worker's.\n  one worker: {list(want)}\n  yours:      "
        f"{list(got)}\nHint: the made-up cases passed, so look at what the engine passes "
        "in: `weight` is this rank's shard (already split), `x` this rank's slice of the input."
    )


def exercise_2(row_shard, row_parallel_linear) -> None:
    """`row_shard(weight, tp_rank, tp_size)` on its own, then both functions
    on two real gloo ranks against the unsharded F.linear, then as o_proj
    and down_proj of every layer in a real 2-rank engine."""
    _check_row_shard(row_shard)
    _check_row_on_ranks(row_shard, row_parallel_linear)
    _check_row_in_engine(row_shard, row_parallel_linear)
    passed(DAY, 2)


# -- exercise 3: QKVParallelLinear's shards ---------------------------------------------

# (num_heads, num_kv_heads, tp): plain split, grouped-query, replication.
QKV_CASES = [(4, 4, 2), (6, 2, 2), (8, 2, 4), (8, 4, 2), (8, 1, 2), (8, 2, 8), (4, 1, 4)]
QKV_HIDDEN, QKV_HEAD = 8, 4


@contextlib.contextmanager
def as_rank(rank: int, tp: int):
    """Build layers as rank `rank` of `tp` would (no process group: a layer
    only asks the group for its rank and size when it is built)."""
    saved = parallel_state._TP
    parallel_state._TP = parallel_state.GroupCoordinator(list(range(tp)), rank, None, None)
    try:
        yield
    finally:
        parallel_state._TP = saved


def labelled_qkv(num_heads: int, num_kv_heads: int, head_size: int = QKV_HEAD,
                 hidden: int = QKV_HIDDEN) -> tuple[torch.Tensor, ...]:
    """q, k, v checkpoint tensors whose rows say what they are: row i of
    head h of part p (q=1, k=2, v=3) holds p*10000 + h*100 + i, plus the column / 1000."""
    columns = torch.arange(hidden, dtype=torch.float64) / 1000

    def part(p, heads):
        rows = torch.tensor([p * 10000 + h * 100 + i for h in range(heads)
                             for i in range(head_size)], dtype=torch.float64)
        return (rows[:, None] + columns[None, :]).float()

    return part(1, num_heads), part(2, num_kv_heads), part(3, num_kv_heads)


def engine_qkv_shard(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads, head_size):
    """The engine's answer: a real QKVParallelLinear, built as this rank, loaded part by part."""
    with as_rank(tp_rank, tp_size):
        layer = QKVParallelLinear(q.shape[1], head_size, num_heads, num_kv_heads, bias=False)
    for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
    return layer.weight.data


def heads_of(t: torch.Tensor, head_size: int) -> list[str]:
    """Which checkpoint heads a shard's row blocks are (by their labels)."""
    names = []
    for start in range(0, t.shape[0], head_size):
        label = int(round(float(t[start, 0])))
        part, head = divmod(label, 10000)
        names.append(f"{'?qkv'[part] if part in (1, 2, 3) else '?'}{head // 100}")
    return names


def exercise_3(qkv_shard) -> None:
    """`qkv_shard(q, k, v, tp_rank, tp_size, num_heads, num_kv_heads,
    head_size)` against the engine's own `QKVParallelLinear.weight_loader`,
    for every rank of plain, grouped-query and replicated layouts; then
    loading every layer of a real 2-rank engine whose one KV head is
    replicated on both ranks."""
    for heads, kv_heads, tp in QKV_CASES:
        q, k, v = labelled_qkv(heads, kv_heads)
        for rank in range(tp):
            want = engine_qkv_shard(q, k, v, rank, tp, heads, kv_heads, QKV_HEAD)
            what = (f"qkv_shard for rank {rank} of tp={tp}, with {heads} query heads and "
                    f"{kv_heads} KV heads of size {QKV_HEAD}")
            hint = ""
            if kv_heads < tp:
                hint = (f"with fewer KV heads than ranks, each KV head is replicated on "
                        f"tp / num_kv_heads = {tp // kv_heads} consecutive ranks: rank r holds "
                        "KV head r // (tp / num_kv_heads).")
            with learner_code(f"Day {DAY}, exercise 3: {what},",
                              hint or "each rank takes whole heads of q, k and v."):
                got = qkv_shard(q.clone(), k.clone(), v.clone(), rank, tp, heads, kv_heads,
                                QKV_HEAD)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(
                    f"Day {DAY}, exercise 3: {what} should have shape {tuple(want.shape)} "
                    f"({heads // tp} query heads + 2 x {max(1, kv_heads // tp)} KV heads, "
                    f"{QKV_HEAD} rows each), yours has {shape}.\nHint: "
                    + (hint or "each rank holds num_heads / tp query heads and "
                       "num_kv_heads / tp KV heads, concatenated [q; k; v] along dim 0.")
                )
            if not torch.equal(got, want):
                yours, expected = heads_of(got, QKV_HEAD), heads_of(want, QKV_HEAD)
                detail = ("the right heads, but rows or columns inside them moved"
                          if yours == expected else f"yours holds heads {yours}")
                if sorted(yours) == sorted(expected) and yours != expected:
                    tip = ("the right heads in the wrong order: the fused weight is [q; k; v], "
                           "in that order (the model splits the output that way).")
                elif yours != expected and kv_heads < tp:
                    tip = hint + (" (rank % num_kv_heads spreads them round-robin instead.)"
                                  if yours[-1] == f"v{rank % kv_heads}" else "")
                elif yours != expected and any(name[0] != e[0] for name, e in
                                               zip(yours, expected, strict=False)):
                    tip = ("split q, k and v separately, by heads: one split of the fused "
                           "[q; k; v] tensor hands rank 0 all the query heads.")
                else:
                    tip = ("rank r holds query heads [r * num_heads/tp, (r+1) * num_heads/tp) and "
                           "KV heads [r * kv/tp, (r+1) * kv/tp), whole heads of head_size rows, "
                           "in the order q, k, v.")
                raise AssertionError(
                    f"Day {DAY}, exercise 3: {what}: the engine's shard holds heads {expected} "
                    f"(q0 = query head 0, k0 = KV head 0's key, ...); {detail}.\nHint: {tip}"
                )
    _check_qkv_in_engine(qkv_shard)
    passed(DAY, 3)


class _LearnerQKV:
    """A Llama that loads its q/k/v projections through the learner's
    `qkv_shard` (after the engine's own loading, which it overwrites)."""

    qkv_shard = None

    def load_weights(self, weights):
        weights = list(weights)
        LlamaForCausalLM.load_weights(self, weights)
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            match = re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight", name)
            if match:
                parts.setdefault(int(match[1]), {})[match[2]] = tensor
        for index, part in parts.items():
            attn = self.model.layers[index].self_attn
            qkv = attn.qkv_proj
            shard = type(self).qkv_shard(part["q"], part["k"], part["v"], qkv.tp_rank,
                                         qkv.tp_size, attn.total_num_heads,
                                         attn.total_num_kv_heads, attn.head_size)
            default_weight_loader(qkv.weight, shard)


def llama_with_qkv(module_name: str, qkv_shard) -> type:
    """A Llama loading q/k/v with the learner's function, named as if the
    learner's module defined it (the worker process imports it from there)."""
    return type("LlamaWithYourQKV", (_LearnerQKV, LlamaForCausalLM),
                {"qkv_shard": staticmethod(qkv_shard), "__module__": module_name})


_QKV_FOOTER = (
    "from tools.labs.checks.day14 import llama_with_qkv\n\n"
    "LlamaWithYourQKV = llama_with_qkv(__name__, qkv_shard)\n"
)


@functools.lru_cache(maxsize=1)
def one_kv_head_tokens() -> tuple[tuple[int, ...], ...]:
    """One worker's greedy tokens on the shipped model cut to 1 KV head."""
    with model_with_architecture("LlamaForCausalLM", kv_heads=1) as path, quiet_engine():
        outs = LLM(path, disable_log_stats=True).generate(PROMPTS, GREEDY, use_tqdm=False)
    return tuple(tuple(o.outputs[0].token_ids) for o in outs)


def _check_qkv_in_engine(qkv_shard) -> None:
    """The shipped model cut to 1 KV head, on 2 ranks: both hold a replica."""
    want = one_kv_head_tokens()
    with learner_module({"qkv_shard": qkv_shard}, _QKV_FOOTER) as module:
        model_cls = importlib.import_module(module).LlamaWithYourQKV
        with learner_code(
            f"Day {DAY}, exercise 3: the 2-rank engine loading q/k/v with your qkv_shard",
            "it runs in the other rank's process from its source: use only torch, F and math "
            "inside it.",
        ):
            got, _ = run_in_engine("Day14LlamaWithYourQKV", model_cls, kv_heads=1)
    assert got == want, (
        f"Day {DAY}, exercise 3: with your qkv_shard loading every layer, a 2-rank engine "
        "(the shipped model cut to 1 KV head, so both ranks hold a replica) generates other "
        f"tokens than one worker.\n  one worker: {list(want)}\n  yours:      {list(got)}"
    )


# -- exercise 4: the communication share of a step --------------------------------------


def reference_share(trace: Trace) -> float:
    decode = [s for s in trace.steps
              if s["scheduled"] and not any(e["is_prefill"] for e in s["scheduled"])]
    comm = sum(s["collectives"]["ms"] for s in decode)
    execute = sum(s["timings"]["execute_ms"] for s in decode)
    return comm / execute


def _made_up(trace: Trace) -> Trace:
    """The same steps, with timings that tell the mistakes apart: a prefill
    step with much communication, schedule and process phases as long as
    execute, and decode steps whose per-step shares differ."""
    steps = copy.deepcopy(trace.steps)
    decode_numbers = [(10.0, 2.0), (30.0, 3.0), (20.0, 12.0), (40.0, 4.0)]  # (execute, comm)
    decodes = 0
    for step in steps:
        if any(e["is_prefill"] for e in step["scheduled"]):
            execute, comm = 60.0, 50.0
        else:
            execute, comm = decode_numbers[decodes % len(decode_numbers)]
            decodes += 1
        step["timings"] = {"schedule_ms": 7.0, "execute_ms": execute, "process_ms": 5.0}
        step["collectives"] = dict(step["collectives"] or {}, ms=comm)
    return Trace(header=trace.header, requests=trace.requests, steps=steps)


def _ex4_hint(trace: Trace, got: float) -> str:
    decode = [s for s in trace.steps
              if s["scheduled"] and not any(e["is_prefill"] for e in s["scheduled"])]
    every = [s for s in trace.steps if s["scheduled"]]
    comm = sum(s["collectives"]["ms"] for s in decode)
    execute = sum(s["timings"]["execute_ms"] for s in decode)
    candidates = [
        (sum(s["collectives"]["ms"] for s in every)
         / sum(s["timings"]["execute_ms"] for s in every),
         "you included the prefill steps: take only the steps whose batch is all decodes."),
        (comm / sum(trace.step_ms(s) for s in decode),
         "divide by the execute phase (`timings.execute_ms`), where the collectives happen, "
         "not the whole step (schedule + execute + process)."),
        (comm / (execute - comm),
         "that is communication / compute; the share is communication / execute."),
        (100 * comm / execute, "return a fraction between 0 and 1, not a percentage."),
        (sum(s["collectives"]["ms"] / s["timings"]["execute_ms"] for s in decode) / len(decode),
         "that is the mean of the steps' shares; take total communication over total execute "
         "time, so a long step weighs more."),
    ]
    for value, hint in candidates:
        if math.isclose(got, value, rel_tol=1e-6):
            return hint
    return ("the share is the sum of `collectives.ms` over the decode steps divided by the sum "
            "of their `timings.execute_ms`.")


def exercise_4(communication_share, trace: Trace) -> None:
    """`communication_share(trace)` on the lab's own 2-rank trace and on a
    copy with made-up timings, against the trace's own numbers."""
    for what, t in (("a copy of your trace with made-up timings", _made_up(trace)),
                    ("your 2-rank trace", trace)):
        with learner_code(f"communication_share({what})"):
            got = communication_share(t)
        want = reference_share(t)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-6):
            hint = _ex4_hint(t, got) if isinstance(got, (int, float)) else "return one float."
            raise AssertionError(
                f"Day {DAY}, exercise 4: on {what}, the communication share should be "
                f"{want:.4f}, yours is {got!r}.\nHint: {hint}"
            )
    passed(DAY, 4)
