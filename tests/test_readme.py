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


def test_readme_trace_sample_is_what_the_tracer_prints(tmp_path, monkeypatch, capsys):
    """The `minivllm-trace show run.jsonl --step 3` sample is today's output
    of the command above it, except the measured times and the size of the
    CPU pool, which depend on the machine."""
    from minivllm.tracer.cli import main

    text = README.read_text()
    sample = re.search(r"\$ minivllm-trace show run\.jsonl --step 3\n(.*?)```", text, re.S)
    assert "minivllm-trace run admission_blocked --dry-run -o run.jsonl" in text
    trace = str(tmp_path / "run.jsonl")
    assert main(["run", "admission_blocked", "--dry-run", "-o", trace]) == 0
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "104")
    assert main(["show", trace, "--step", "3"]) == 0
    printed = capsys.readouterr().out

    def machine_free(block: str) -> list[str]:
        block = re.sub(r"\d+\.\d+ ms", "T ms", block)
        block = re.sub(r"cpu \d+/\d+", "cpu N/N", block)
        return [line.rstrip() for line in block.strip().splitlines()]

    assert machine_free(printed) == machine_free(sample.group(1))
