"""V1's sampler (vLLM's `vllm/v1/sample/`)."""
