"""What V1 reports about itself each step (vLLM's `vllm/v1/metrics/`): the engine
core's `SchedulerStats`, the front end's `IterationStats`, and the stat loggers
that show them (loggers.py)."""
