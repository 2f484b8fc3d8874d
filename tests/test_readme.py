"""The README's example runs as written, with only the model path swapped."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tiny_model_dir):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert 'LLM(model="path/to/hf/checkpoint")' in block
    code = block.replace("path/to/hf/checkpoint", tiny_model_dir("llama"))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, str(README), "exec"), {})
    printed = stdout.getvalue()
    # Each output prints "prompt text [token ids] finish_reason" (the random
    # model's text may itself contain newlines).
    assert printed.startswith("Hello, my name is")
    assert "The capital of France is" in printed
    assert re.findall(r"\] (length|stop)$", printed, re.M) == ["length", "length"]
