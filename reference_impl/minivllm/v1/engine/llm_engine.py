"""V1's `LLMEngine` (vLLM's `vllm/v1/engine/llm_engine.py`): the classic
engine's interface (`add_request`, `step`, `abort_request`) over V1's split:

    add_request: InputProcessor (tokenize, check) -> EngineCoreRequest
                 -> OutputProcessor (a RequestState) and the engine core
    step:        engine core step (schedule, execute, update) -> token ids
                 -> OutputProcessor (text, stop strings) -> RequestOutputs

`LLM(..., use_v1=True)` (or MINIVLLM_USE_V1=1) runs on it. As the classic
engine, it dies with a step that fails part-way: every later call raises
`EngineDeadError` rather than serve tokens from a half-updated state.

The engine core runs in this process (`InprocClient`: `step` runs one
step) or, with `multiprocess_mode=True` or
MINIVLLM_ENABLE_V1_MULTIPROCESSING=1, in a process of its own
(`SyncMPClient`: it steps on its own and `step` takes the next outputs;
its death, a SIGKILL say, is an `EngineDeadError` here).
"""

from __future__ import annotations

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.engine.llm_engine import EngineDeadError
from minivllm.inputs import PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.transformers_utils.tokenizer import get_tokenizer
from minivllm.utils import check_bool
from minivllm.v1.engine.core import get_scheduler_cls
from minivllm.v1.engine.core_client import EngineCoreClient
from minivllm.v1.engine.input_processor import InputProcessor
from minivllm.v1.engine.output_processor import OutputProcessor, ParentRequest


def check_v1_config(engine_config: EngineConfig) -> None:
    """Refuse, naming the option, what only the classic engine has."""
    model_config, scheduler_config = engine_config.model_config, engine_config.scheduler_config
    if model_config.dry_run:
        raise ValueError("dry_run=True runs on the classic engine only (use_v1=False)")
    if scheduler_config.preemption_mode is not None and (
        scheduler_config.preemption_mode.value == "swap"
    ):
        raise ValueError(
            "preemption_mode='swap': V1 preempts by recompute only (prefix caching makes "
            "recomputing cheap); leave preemption_mode unset, or use the classic engine"
        )
    get_scheduler_cls(scheduler_config)  # refuses a classic replacement
    block_manager_cls = scheduler_config.block_manager_cls
    if not block_manager_cls.__module__.startswith("minivllm.core."):
        raise ValueError(
            f"block_manager_cls={block_manager_cls.__qualname__} replaces the classic engine's "
            "block manager; V1 has its KVCacheManager (minivllm/v1/core/)"
        )


def resolve_multiprocess_mode(multiprocess_mode: bool | None) -> bool:
    """Where the engine core runs: `multiprocess_mode` if given, else
    $MINIVLLM_ENABLE_V1_MULTIPROCESSING ("1" or "0"), else in this process
    (vLLM's default is a process of its own: see envs.py for why ours is not)."""
    if multiprocess_mode is not None:
        return check_bool("multiprocess_mode", multiprocess_mode, "None, True or False")
    raw = envs.MINIVLLM_ENABLE_V1_MULTIPROCESSING
    if raw in (None, "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(
        f"The environment variable MINIVLLM_ENABLE_V1_MULTIPROCESSING must be 0 or 1, got {raw!r}"
    )


class LLMEngine:
    def __init__(
        self,
        engine_config: EngineConfig,
        log_stats: bool = False,
        multiprocess_mode: bool | None = None,
    ) -> None:
        check_v1_config(engine_config)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.log_stats = log_stats
        self.tokenizer = get_tokenizer(
            self.model_config.tokenizer, self.model_config.trust_remote_code
        )
        self.input_processor = InputProcessor(engine_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCoreClient.make_client(
            multiprocess_mode=resolve_multiprocess_mode(multiprocess_mode),
            asyncio_mode=False,
            engine_config=engine_config,
        )
        self._live_request_ids: set[str] = set()
        self.dead_error: BaseException | None = None
        # Totals over the engine's life, from each step's SchedulerStats
        # (the benchmarks read them; vLLM's stat loggers keep the like).
        self.total_scheduled_tokens = 0
        self.total_preemptions = 0

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        trace: str | None = None,
        multiprocess_mode: bool | None = None,
    ) -> LLMEngine:
        if trace is not None:
            raise ValueError("trace= records the classic engine's steps; V1 is not traced yet")
        return cls(
            engine_args.create_engine_config(),
            log_stats=not engine_args.disable_log_stats,
            multiprocess_mode=multiprocess_mode,
        )

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests -----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Check and queue a request; `n > 1` becomes n child requests."""
        self._check_alive()
        prompt_text, request = self.input_processor.process_inputs(
            request_id, prompt, params, arrival_time, priority, self._live_request_ids
        )
        self._live_request_ids.add(request_id)
        params = request.sampling_params
        if params.n == 1:
            self._add_one(request, prompt_text, None, 0)
            return
        parent = ParentRequest(request_id, params)
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            child = type(request)(
                **{**vars(request), "request_id": child_id, "sampling_params": child_params}
            )
            self._add_one(child, prompt_text, parent, index)

    def _add_one(self, request, prompt_text, parent, index) -> None:
        self.output_processor.add_request(
            request.request_id,
            prompt_text,
            request.prompt_token_ids,
            request.sampling_params,
            request.arrival_time,
            parent,
            index,
        )
        try:
            self.engine_core.add_request(request)
        except EngineDeadError as exc:  # the engine core's process is gone
            self.dead_error = exc
            raise

    def abort_request(self, request_id: str | list[str]) -> None:
        """Drop requests now (no final output, as vLLM V1). Ids unknown or
        finished are ignored; on a dead engine this does nothing."""
        if self.dead_error is not None:
            return
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))
        self._live_request_ids.difference_update(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._live_request_ids)

    # -- the step -------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            cause = self.dead_error
            if isinstance(cause, EngineDeadError):  # the engine core's process died
                raise EngineDeadError(str(cause)) from cause
            raise EngineDeadError(
                f"engine is dead: {type(cause).__name__}: {cause}. A step failed part-way, "
                "so its queues and KV cache can no longer be trusted; create a new engine."
            ) from cause

    def step(self) -> list[RequestOutput]:
        self._check_alive()
        try:
            outputs = self.engine_core.get_output()
            processed = self.output_processor.process_outputs(outputs.outputs)
            if outputs.scheduler_stats is not None:
                self.total_scheduled_tokens += outputs.scheduler_stats.num_scheduled_tokens
                self.total_preemptions += outputs.scheduler_stats.num_preempted_reqs
            self.engine_core.abort_requests(processed.reqs_to_abort)
        except BaseException as exc:
            self.dead_error = exc
            self.engine_core.shutdown()
            raise
        for output in processed.request_outputs:
            if output.finished:
                self._live_request_ids.discard(output.request_id)
        return processed.request_outputs

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine core (its process, if it has one); also done when
        the engine is garbage collected or the interpreter exits."""
        self.engine_core.shutdown()
