"""The tracer's views: what the engine did, step by step.

The engines write the trace (minivllm/engine/trace_writer.py, and V1's
minivllm/v1/engine/trace_writer.py; the header's `engine` says which); this package
reads it back and shows it: `minivllm-trace` (cli.py) on the command line,
`load_trace(path)` in Python and Jupyter. The format: SCHEMA.md. A file that
is not a valid trace raises `TraceError`, naming the file and the line.

Two layers, imported one way: the facts (errors.py, schema.py, trace.py,
facts.py) import no view; the views (show.py, summary.py, notebook.py,
render.py, timeline.py, cli.py, scenario.py) import the facts. The one link
upward is made here: how Jupyter displays a `Trace` and a `StepView` is
registered with `trace.set_display` (see trace.py).
"""

from minivllm.tracer.errors import TraceError, TracerError
from minivllm.tracer.notebook import trace_html
from minivllm.tracer.trace import Trace, load_trace, set_display


def _step_svg(trace: Trace, n: int) -> str:
    # render.py needs the graphviz package (the `trace` extra), so it is
    # imported when a step is first drawn, not with the package.
    from minivllm.tracer.render import step_svg

    return step_svg(trace, n)


set_display(trace_html=trace_html, step_svg=_step_svg)

__all__ = ["Trace", "TraceError", "TracerError", "load_trace"]
