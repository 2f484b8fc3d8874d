"""vLLM's V1 engine (`vllm/v1/`), beside the classic one.

`LLM(..., use_v1=True)` or MINIVLLM_USE_V1=1 runs it. It shares the classic
engine's models, attention backends and detokenizer; what is V1's is here:
the request and its computed-token count (`request.py`), the KV cache with
its block pool and free queue (`core/`), the one-budget scheduler
(`core/sched/`), the engine core and its clients, in-process or in a process
of its own (`engine/`), the persistent-batch worker (`worker/`), and the
sampler, the classic sampler's stages in V1's order (`sample/`). The classic
engine imports nothing from here.
"""
