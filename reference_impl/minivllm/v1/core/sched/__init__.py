"""V1's scheduler (vLLM's `vllm/v1/core/sched/`)."""
