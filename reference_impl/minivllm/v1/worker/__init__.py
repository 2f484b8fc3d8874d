"""V1's worker side: the persistent batch and its model runner (vLLM's `vllm/v1/worker/`)."""
