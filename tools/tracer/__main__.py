"""`python -m tools.tracer` from the repository root: the same as `minivllm-trace`."""

from tools.tracer.cli import main

raise SystemExit(main())
