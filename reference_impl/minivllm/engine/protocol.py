"""`EngineClient`: what the OpenAI server needs of an engine (vLLM's
`vllm/engine/protocol.py`).

The serving classes (entrypoints/openai/) talk to this interface only, so
the server runs on either engine without knowing which:

    AsyncLLMEngine  (engine/async_llm_engine.py)   the classic engine, stepped
                    by a background task in the server's process
    AsyncLLM        (v1/engine/async_llm.py)       V1: the engine core steps
                    in its own process; the server's process tokenizes,
                    detokenizes and serves HTTP

`api_server.build_async_engine_client` picks one (`--use-v1`, or
MINIVLLM_USE_V1=1), as vLLM's api_server does.

    generate(prompt, params, request_id)  an async generator of the request's
                                          cumulative RequestOutputs; closing it
                                          early aborts the request
    abort(request_id)                     the same, by id
    get_model_config(), get_tokenizer()   what the handlers check and encode with
    is_running, is_stopped, errored,      the engine's life: `errored` once it
    dead_error, check_health()            failed (dead_error: why), is_stopped
                                          also after a shutdown; check_health
                                          raises if it cannot serve
    add_logger(name, logger)              a `StepStatLogger` shown every step's
    do_log_stats()                        classic `Stats` and outputs (the
                                          server's Prometheus one); do_log_stats
                                          shows them the current stats now
    shutdown()                            stop for good (the server's exit)

How a request fails, on both engines: a request the engine refuses raises
ValueError from `generate` before any output (the server's 400); a new
request on a stopped engine raises at once (503); a request in flight when
the engine dies raises the failure (500).

Where ours differs from vLLM's: `get_model_config` and `get_tokenizer` are
plain methods (vLLM's are coroutines: its tokenizer can live in another
process); no LoRA, profiling, tracing or decoding-config methods; stat
loggers are added here (vLLM builds them inside each engine from its
options, and serves prometheus_client's global registry).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

from minivllm.engine.metrics import Stats
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.config import ModelConfig
    from minivllm.inputs import PromptType


class StepStatLogger(Protocol):
    """What `EngineClient.add_logger` takes: shown every step's `Stats` and
    the `RequestOutput`s it made (the Prometheus logger in metrics.py)."""

    def log(self, stats: Stats, request_outputs: list[RequestOutput]) -> None: ...


class EngineClient(ABC):
    """The engine behind the server (see the module's docstring)."""

    # -- the engine's life -----------------------------------------------------------

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """Its loop (classic) or output handler (V1) runs, or has not started yet (V1)."""

    @property
    @abstractmethod
    def is_stopped(self) -> bool:
        """It can no longer serve: it failed, or it was shut down."""

    @property
    @abstractmethod
    def errored(self) -> bool:
        """It failed (V1: its engine core is gone, for any reason)."""

    @property
    @abstractmethod
    def dead_error(self) -> BaseException | None:
        """Why it failed (None while it has not)."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raises (the engine's dead error) if it can no longer serve."""

    # -- requests ------------------------------------------------------------------------

    @abstractmethod
    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request: its outputs (as its `output_kind` asks), the last `finished`.
        Closing the generator early (or cancelling its reader) aborts it."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are ignored."""

    # -- what the handlers need ----------------------------------------------------------

    @abstractmethod
    def get_model_config(self) -> ModelConfig: ...

    @abstractmethod
    def get_tokenizer(self): ...

    # -- statistics ----------------------------------------------------------------------

    @abstractmethod
    def add_logger(self, name: str, stat_logger: StepStatLogger) -> None:
        """Show `stat_logger` every step's `Stats` and outputs from now on."""

    @abstractmethod
    async def do_log_stats(self) -> None:
        """Show every added logger the current `Stats` now, with no outputs
        (the server does at startup, so every gauge is there from the start)."""

    # -- the end -------------------------------------------------------------------------

    @abstractmethod
    def shutdown(self) -> None:
        """Stop for good; requests still in flight raise the engine's dead error."""
