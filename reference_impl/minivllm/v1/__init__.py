"""vLLM's V1 engine (`vllm/v1/`), beside the classic one, being built.

So far: the KV-cache core (`core/kv_cache_utils.py`, `core/block_pool.py`).
The scheduler, the engine core and the persistent-batch worker come next
(issue 20); until they exist nothing in the classic engine imports this.
"""
