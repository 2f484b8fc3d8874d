"""What every engine benchmark shares: the seeded workload, the model, and
the timing, table and result helpers, so that each is defined in one place.

The workload is synthetic on purpose, as in vLLM's own throughput benchmark:
prompt and output lengths are drawn uniformly from a seeded RNG and every
request runs to its drawn length (`ignore_eos`), so two engines, or two
runs, do exactly the same work. Prompts are random token ids, never the
BOS/EOS ids (0 and 1) of the tiny tokenizer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from tools.tiny_models import make_tiny_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
FIRST_ORDINARY_TOKEN = 2  # 0 and 1 are BOS and EOS in tools/tiny_models.py
# Tokens per KV-cache block in every benchmark: vLLM's default, and the page
# size HF's paged cache is given where it is a peer.
BLOCK_SIZE = 16

T = TypeVar("T")


@dataclass(frozen=True)
class WorkloadSpec:
    """N requests with uniform prompt and output lengths (inclusive ranges)."""

    num_requests: int = 64
    min_prompt_len: int = 16
    max_prompt_len: int = 256
    min_output_len: int = 16
    max_output_len: int = 256
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        """The longest request possible: what a contiguous cache reserves."""
        return self.max_prompt_len + self.max_output_len


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + self.output_len


def sample_requests(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The workload: the same `spec` always gives the same requests."""
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(spec.min_prompt_len, spec.max_prompt_len)
        output_len = rng.randint(spec.min_output_len, spec.max_output_len)
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, output_len))
    return requests


def poisson_arrival_times(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds of a Poisson process of `rate` requests/s:
    exponential gaps, the first request at 0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# Llama-family shapes, saved by tools/tiny_models.py with its 384-token
# tokenizer (the vocabulary stays small so that the benchmark times the
# transformer, not a 32k-row embedding and LM head).
MODEL_PRESETS: dict[str, tuple[str, dict]] = {
    # The tests' model: 2 layers of 64.
    "tiny": ("llama", {"max_position_embeddings": 1024}),
    # ~20M parameters: the CPU benchmarks.
    "20m": (
        "llama",
        dict(
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=7,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            initializer_range=0.05,
        ),
    ),
    # Qwen2-0.5B's transformer (24 layers of 896, 14 heads, 2 KV heads) for a GPU.
    "0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            initializer_range=0.02,
        ),
    ),
}


def make_bench_model(preset: str, directory: str) -> str:
    """Save the random checkpoint `preset` under `directory`; returns its path."""
    arch, overrides = MODEL_PRESETS[preset]
    return make_tiny_model(arch, os.path.join(directory, f"bench-{preset}"), **overrides)


def add_workload_args(parser: argparse.ArgumentParser, num_requests: int) -> None:
    """The options every benchmark shares: the seeded workload and where results go."""
    parser.add_argument("--num-requests", type=int, default=num_requests)
    for name in ("--prompt-len", "--output-len"):
        parser.add_argument(name, type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="result path (default: tools/bench/results/)")
    parser.add_argument("--no-plot", action="store_true")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that run a model."""
    parser.add_argument("--model-size", choices=sorted(MODEL_PRESETS), default="20m")
    parser.add_argument("--model", help="an existing checkpoint directory instead")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="CPU threads (default: one per core)")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_requests, *args.prompt_len, *args.output_len, args.seed)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn's result, wall seconds it took)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def print_table(rows: list[dict], title: str | None = None) -> None:
    """Rows of one dict each, columns in the first row's key order."""
    if title:
        print(title)
    keys = list(rows[0])
    cells = [[_cell(row.get(k, "")) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths, strict=True)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def set_threads(num_threads: int | None) -> None:
    """Use `num_threads` CPU threads in torch and in the Numba kernel (None:
    their defaults, one per core). On a busy machine one thread is steadier:
    a thread pool waits for its slowest thread at every operation, and a
    thread that lost its core stalls every small matmul."""
    if num_threads is None:
        return
    import numba

    torch.set_num_threads(num_threads)
    numba.set_num_threads(num_threads)


def machine_info() -> dict:
    """Where and when a result was measured, load included: on a shared
    machine the load average says how far to trust a timing."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "numba_threads": _numba_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def write_result(name: str, payload: dict, path: str | None = None) -> Path:
    """Write `payload` plus the machine's description as JSON; by default to
    tools/bench/results/<name>.json. Returns the path."""
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"benchmark": name, "machine": machine_info(), **payload}, indent=1)
    # Lists of numbers on one line each: per-step series stay small and diffable.
    text = _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    out.write_text(text + "\n", encoding="utf-8")
    return out


_NUMBER_LIST = re.compile(r"\[\s+((?:-?[\d.eE+-]+|null)(?:,\s+(?:-?[\d.eE+-]+|null))*)\s+\]")


def plot_path(name: str, json_path: str | None) -> Path:
    """The PNG beside the JSON result."""
    return (Path(json_path) if json_path else RESULTS_DIR / f"{name}.json").with_suffix(".png")


@dataclass(frozen=True)
class Repeated:
    """One figure measured several times in one process, interleaved with the
    peers it is compared with (engine, HF, engine, HF, ...), so that a slow
    spell of a shared machine falls on both: the median is the figure to
    report, the spread says how far to trust it."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return percentile(self.values, 50)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0 for a single value, 0.2 when the runs
        range over a fifth of the median."""
        return (max(self.values) - min(self.values)) / self.median

    def summary(self) -> dict:
        return {
            "median": self.median,
            "min": min(self.values),
            "max": max(self.values),
            "spread": self.spread,
            "values": list(self.values),
        }
