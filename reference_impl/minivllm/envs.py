"""Every environment variable minivllm reads, in one place (vLLM keeps its
own in `vllm/envs.py`, with `VLLM_` names where ours say `MINIVLLM_`).

Each is read when used, not at import, so a notebook can set one in
`os.environ` and the next engine sees it: `envs.MINIVLLM_TRACE` reads
the variable now. The value is the raw string, or None when it is unset; the
code that uses it checks it and names the variable when it is wrong.

- MINIVLLM_API_KEY: the key the API server requires (`Authorization:
  Bearer KEY`) when no --api-key is given (entrypoints/openai/api_server.py).
  vLLM's twin is VLLM_API_KEY.
- MINIVLLM_ATTENTION_BACKEND: the attention backend when `LLM(...)` names
  none: "torch", "numba", "cuda" or "auto" (attention/selector.py). vLLM's
  twin is VLLM_ATTENTION_BACKEND.
- MINIVLLM_CPU_KVCACHE_SPACE: the KV cache on a CPU, in GiB (default 1),
  when no `kv_cache_memory_bytes` is given (config.py). vLLM's CPU backend
  reads VLLM_CPU_KVCACHE_SPACE.
- MINIVLLM_ENABLE_V1_MULTIPROCESSING: "1" runs V1's engine core in a
  process of its own (`SyncMPClient`, v1/engine/core_client.py), "0" or
  unset in the front end's process (`InprocClient`), for `LLMEngine` and
  so `LLM(use_v1=True)` when no `multiprocess_mode` is given
  (v1/engine/llm_engine.py). `AsyncLLM` always uses a process. vLLM's twin
  VLLM_ENABLE_V1_MULTIPROCESSING defaults to 1; ours defaults to 0 because
  minivllm runs mostly in notebooks, tests and debuggers: in one process a
  breakpoint or a print in the scheduler just works, and no engine pays a
  few seconds to spawn an interpreter or leaves one behind.
- MINIVLLM_ENGINE_ITERATION_TIMEOUT_S: the longest one step of the classic
  `AsyncLLMEngine` (the API server's) may run, in seconds (default 60).
  Past it the engine stops: the requests in flight fail with TimeoutError
  and /health answers 503, where a hung step (a stuck collective, a
  deadlock) would leave every client waiting (engine/async_llm_engine.py).
  vLLM's twin is VLLM_ENGINE_ITERATION_TIMEOUT_S (whole seconds; ours
  takes any number > 0).
- MINIVLLM_TRACE: a JSON Lines path; every engine writes its trace there
  (engine/trace_writer.py, minivllm/tracer/), as if given `trace=PATH`.
- MINIVLLM_USE_V1: "1" runs the V1 engine (minivllm/v1/) wherever no
  `use_v1` option is given, "0" or unset the classic one
  (engine/arg_utils.py). vLLM's twin was VLLM_USE_V1, until V1 became
  the only engine.

And one that is not ours (vLLM's list has such too, CUDA_HOME for one):

- CXX: the host C++ compiler the CUDA emulator builds kernels with
  (cuda_emu/; default g++).

And two minivllm sets, for a library to read:

- OMP_WAIT_POLICY: "PASSIVE" unless already set, as soon as minivllm is
  imported (`minivllm/__init__.py` imports this module before anything
  imports torch; vLLM sets its own such variables in `vllm/env_override.py`).
  See `_prefer_passive_openmp_threads` below.
- NUMBA_NUM_THREADS (`set_numba_num_threads`): the size of Numba's thread
  pool, set in each tensor-parallel worker process
  (executor/multiproc_worker_utils.py, executor/ray_utils.py) to the rank's
  share of the cores before Numba starts the pool, whose idle threads would
  otherwise spin on the cores of the other ranks.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLES = (
    "MINIVLLM_API_KEY",
    "MINIVLLM_ATTENTION_BACKEND",
    "MINIVLLM_CPU_KVCACHE_SPACE",
    "MINIVLLM_ENABLE_V1_MULTIPROCESSING",
    "MINIVLLM_ENGINE_ITERATION_TIMEOUT_S",
    "MINIVLLM_TRACE",
    "MINIVLLM_USE_V1",
    "CXX",
)


def __getattr__(name: str) -> str | None:
    if name in ENVIRONMENT_VARIABLES:
        return os.environ.get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT_VARIABLES)


def positive_number(name: str, default: str, meaning: str) -> float:
    """The variable `name` as a finite number > 0 (`default` when unset);
    anything else, an empty value included, is refused naming the variable,
    what it holds (`meaning`) and the value."""
    raw = os.environ.get(name)
    if raw is None:
        raw = default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ValueError(
            f"The environment variable {name} must be a number of {meaning} > 0, got {raw!r}"
        )
    return value


def set_numba_num_threads(num_threads: int) -> None:
    """Size Numba's thread pool for this process; only before it starts."""
    os.environ["NUMBA_NUM_THREADS"] = str(num_threads)


def _prefer_passive_openmp_threads() -> None:
    """OpenMP threads that sleep between parallel regions instead of spinning.

    A CPU step alternates torch's operators, run by torch's OpenMP threads,
    with the Numba decode-attention kernel, run by Numba's: a second OpenMP
    runtime (Numba links the system's libgomp, torch ships its own). By
    default a thread that finishes its share busy-waits for the next region,
    so while Numba's threads attend torch's spin on the same cores, and the
    other way round while torch multiplies: on 2 cores decode steps ran 2-4x
    slower than with passive waiting, far worse with another job on the
    machine. A passive thread sleeps at once; waking it costs microseconds,
    tens of them on our VMs, paid by every parallel region: small steps run
    on one thread instead (worker/cpu_threads.py).

    libgomp reads the variable once, when it is loaded (torch's at `import
    torch`, Numba's at its first parallel kernel): it takes effect only if
    minivllm is imported before torch. A value already set wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_prefer_passive_openmp_threads()
