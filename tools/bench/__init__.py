"""The benchmarks (README, "Benchmarks"; their figures: RESULTS.md).
minivllm's environment overrides come first, before any benchmark imports
torch: see minivllm/envs.py (OpenMP threads that sleep instead of spinning)."""

import minivllm.envs  # noqa: F401
