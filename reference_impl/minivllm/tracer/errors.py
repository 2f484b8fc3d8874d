"""The tracer's own errors: input it cannot use, said in one line.

`minivllm-trace` prints a `TracerError` as `error: ...` and exits with 1;
any other exception is a bug in the tracer and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class TracerError(Exception):
    """Something the user can fix: a bad trace, scenario, option or path."""


class TraceError(TracerError, ValueError):
    """A file that is not a valid trace. Names the file and, where one line
    is at fault, its number (1-based), as editors and compilers do:
    `run.jsonl:17: step line has no 'timings'`."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path, self.line, self.message = str(path), line, message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


class NoSuchStep(TracerError, IndexError):
    """A step number the trace does not have."""


class ScenarioError(TracerError, ValueError):
    """A scenario, prompt or engine option that cannot be played."""
