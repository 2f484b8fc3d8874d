"""V1's executors (vLLM's `vllm/v1/executor/`): here one, in-process."""
