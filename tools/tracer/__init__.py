"""The tracer's views: what the engine did, step by step.

The engine writes the trace (minivllm/engine/trace_writer.py); this package
reads it back and shows it: `minivllm-trace` (cli.py) on the command line,
`load_trace(path)` in Python and Jupyter. The format: SCHEMA.md. A file that
is not a valid trace raises `TraceError`, naming the file and the line.
"""

from tools.tracer.errors import TraceError, TracerError
from tools.tracer.trace import Trace, load_trace

__all__ = ["Trace", "TraceError", "TracerError", "load_trace"]
