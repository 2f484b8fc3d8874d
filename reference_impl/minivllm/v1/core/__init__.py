"""V1's scheduling side: the KV-cache manager and its block pool (vLLM's `vllm/v1/core/`)."""
