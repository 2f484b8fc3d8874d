"""A plain `pip install .` works anywhere: the wheel, installed into a fresh
venv outside the checkout, runs the demo, the `cuda` backend's sources and
`minivllm-trace`, with nothing of the repository on the path.

The fresh venv gets its dependencies (torch, transformers, ...) from this
test's own environment through a path entry, so the test installs only the
wheel (no network) while importing minivllm from the wheel alone: the
editable install's hooks live in `.pth` files, which Python reads only in
site directories, never in a directory added by a path entry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from minivllm import LLM, SamplingParams
from tests.server_utils import RemoteOpenAIServer

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run(args: list, cwd: Path, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin/ directory of a fresh venv holding only the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", tmp / "dist", REPO],
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("minivllm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # minivllm and its metadata, nothing else: no top-level `tools` or `tests`.
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"minivllm", dist_info}
    run([sys.executable, "-m", "venv", tmp / "venv"], cwd=tmp)
    bin_dir = tmp / "venv" / "bin"
    purelib = run(
        [bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=tmp,
    ).strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp)
    return bin_dir


def test_the_wheel_holds_the_package_alone(installed):
    out = run(
        [installed / "python", "-c", textwrap.dedent(
            """
            import importlib.util, minivllm
            print(minivllm.__file__)
            print(importlib.util.find_spec("tools"), importlib.util.find_spec("tests"))
            """
        )],
        cwd=installed.parent.parent,
    )
    where, missing = out.splitlines()
    assert Path(where).is_relative_to(installed.parent.parent), where
    assert missing == "None None"


def test_the_demo_runs_from_the_wheel(installed, tmp_path):
    out = run([installed / "python", REPO / "tools" / "demo.py"], cwd=tmp_path)
    # The oracle: the same greedy completion from the checkout's engine.
    expected = LLM().generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=256))
    assert "Once upon a time" + expected[0].outputs[0].text in out
    assert "finish_reason=stop" in out


def test_the_cuda_sources_ship_and_run_emulated(installed, tmp_path):
    """The `cuda` backend's sources are package data: the CPU emulator (also
    in the package) compiles them from the install and they agree with the
    PyTorch reference."""
    script = textwrap.dedent(
        """
        import torch
        from minivllm import _custom_ops as ops, cuda_emu
        from minivllm.attention.backends.torch_paged import TorchPagedAttention

        print(ops.CSRC_DIR)
        if cuda_emu.compiler() is None:
            raise SystemExit(0)
        gen = torch.Generator().manual_seed(0)
        seq_lens = torch.tensor([5, 17, 32])
        kv = torch.randn(2, 8, 16, 2, 64, generator=gen)  # [2, blocks, block_size, kv_heads, head]
        tables = torch.tensor([[3, 0], [1, 6], [7, 2]])
        query = torch.randn(3, 4, 64, generator=gen)
        impl = TorchPagedAttention(4, 64, 0.125, 2)
        expected = impl.forward_decode(query, kv, tables, seq_lens, 32)
        out = torch.empty_like(query)
        with cuda_emu.emulated_custom_ops():
            ops.paged_attention_v1(out, query, kv[0], kv[1], tables, seq_lens, 0.125, 32)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        print("agree")
        """
    )
    out = run([installed / "python", "-c", script], cwd=tmp_path).splitlines()
    csrc = Path(out[0])
    assert csrc.is_relative_to(installed.parent.parent), csrc
    assert {p.name for p in csrc.iterdir()} >= {"paged_attention.cu", "cache_kernels.cu"}
    if len(out) == 1:
        pytest.skip("the CUDA emulator needs a C++ compiler (g++, or $CXX)")
    assert out[1] == "agree"


def test_minivllm_serve_runs_from_the_wheel(installed, tmp_path):
    """`minivllm serve` from the wheel alone: the story model and its chat
    template ship, and the server answers as the checkout's engine does."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = [str(installed / "minivllm"), "serve"]
    with RemoteOpenAIServer([], command=command, env=env) as server:
        client = server.get_client()
        (card,) = client.models.list().data
        chat = client.chat.completions.create(
            model="minivllm-stories",
            messages=[{"role": "user", "content": "Once upon a time"}],
            temperature=0,
            max_tokens=20,
        )
    assert Path(card.root).is_relative_to(installed.parent.parent), card.root
    expected = LLM().generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20))
    assert chat.choices[0].message.content == expected[0].outputs[0].text


def test_minivllm_trace_runs_a_scenario_from_the_wheel(installed, tmp_path):
    trace = installed / "minivllm-trace"
    run([trace, "run", "admission_blocked", "--dry-run", "-o", "run.jsonl"], cwd=tmp_path)
    assert "admission_blocked" in run([trace, "scenarios"], cwd=tmp_path)
    run([trace, "validate", "run.jsonl"], cwd=tmp_path)
    shown = run([trace, "show", "run.jsonl"], cwd=tmp_path)
    assert "step" in shown.lower()
    summary = run([trace, "summary", "run.jsonl"], cwd=tmp_path)
    assert "TTFT" in summary or "ttft" in summary.lower()
