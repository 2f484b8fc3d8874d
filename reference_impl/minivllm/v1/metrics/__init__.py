"""What V1's engine core reports about itself each step (vLLM's `vllm/v1/metrics/`)."""
