"""`python -m minivllm.tracer` from the repository root: the same as `minivllm-trace`."""

from minivllm.tracer.cli import main

raise SystemExit(main())
