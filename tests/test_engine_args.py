"""Engine options: one declaration each (`EngineArgs`), every one a command-line
flag with its default, and one module naming every environment variable."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from minivllm import envs
from minivllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from minivllm.engine.arg_utils import EngineArgs, v1_default_max_num_batched_tokens

PACKAGE = pathlib.Path(envs.__file__).parent


def parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(prog="test"))


def test_no_flags_give_the_default_options():
    assert EngineArgs.from_cli_args(parser().parse_args([])) == EngineArgs()


def test_every_option_is_a_flag_of_its_type():
    argv = [
        "--model", "/ckpt", "--dtype", "bfloat16", "--seed", "7", "--max-model-len", "100",
        "--device", "cpu", "--dry-run", "--attention-backend", "torch", "--block-size", "8",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1000000",
        "--swap-space", "0.5", "--num-gpu-blocks-override", "12", "--enable-prefix-caching",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--preemption-mode", "swap",
        "--enable-chunked-prefill", "--scheduling-policy", "priority",
        "--scheduler-cls", "tests.engine_spies.RecordingScheduler", "--no-disable-log-stats",
        "--tokenizer", "/tok", "--trust-remote-code", "--block-manager-cls", "a.B",
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--enforce-eager", "--max-seq-len-to-capture", "512", "--use-v1",
        "--compilation-level", "3", "--long-prefill-token-threshold", "5",
        "--no-scheduler-reserve-full-isl", "--max-logprobs", "50",
        "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv"}',
    ]
    args = EngineArgs.from_cli_args(parser().parse_args(argv))
    given = {a.lstrip("-").replace("-", "_").removeprefix("no_") for a in argv if a[:2] == "--"}
    assert given == {f.name for f in dataclasses.fields(EngineArgs)}, "a flag is missing"
    assert args == EngineArgs(
        model="/ckpt", tokenizer="/tok", trust_remote_code=True, dtype="bfloat16", seed=7,
        max_model_len=100, device="cpu", dry_run=True, attention_backend="torch", block_size=8,
        gpu_memory_utilization=0.5, kv_cache_memory_bytes=1000000, swap_space=0.5,
        num_gpu_blocks_override=12, enable_prefix_caching=True, max_num_seqs=4,
        max_num_batched_tokens=64, preemption_mode="swap", enable_chunked_prefill=True,
        scheduling_policy="priority", scheduler_cls="tests.engine_spies.RecordingScheduler",
        block_manager_cls="a.B", disable_log_stats=False, tensor_parallel_size=2,
        distributed_executor_backend="ray", enforce_eager=True, max_seq_len_to_capture=512,
        use_v1=True, compilation_level=3, long_prefill_token_threshold=5,
        scheduler_reserve_full_isl=False, max_logprobs=50,
        kv_events_config={"enable_kv_cache_events": True, "topic": "kv"},
    )


@pytest.mark.parametrize(
    "argv",
    [["--block-size", "eight"], ["--preemption-mode", "later"], ["--swap-space", "x"]],
)
def test_bad_flag_values_are_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_option_defaults_are_the_configs_defaults():
    """One default per option: EngineArgs takes it from the config class
    that owns the option (device included: it used to differ)."""
    owners = [ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig]
    defaults, checked = EngineArgs(), {"model"}  # no default model: the shipped one
    # These depend on the engine (None: on with V1, the config's default,
    # off, with the classic engine): checked in the next test.
    checked |= {"enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs"}
    for config in owners:  # the first config to hold a name owns it
        for f in dataclasses.fields(config):
            if f.init and hasattr(defaults, f.name) and f.name not in checked:
                assert getattr(defaults, f.name) == f.default, (config.__name__, f.name)
                checked.add(f.name)
    assert len(checked) > 20


@pytest.mark.parametrize("use_v1", [False, True])
def test_engine_dependent_defaults(tiny_model_dir, monkeypatch, use_v1):
    """Classic: prefix caching and chunked prefill off (the configs'
    defaults); V1: both on, and on a CPU 4096 tokens a step, as vLLM V1."""
    monkeypatch.delenv("MINIVLLM_USE_V1", raising=False)
    config = EngineArgs(model=tiny_model_dir("llama"), use_v1=use_v1).create_engine_config()
    assert config.use_v1 is use_v1
    assert config.cache_config.enable_prefix_caching is use_v1
    assert config.scheduler_config.enable_chunked_prefill is use_v1
    if use_v1:
        assert config.scheduler_config.max_num_batched_tokens == 4096
    else:
        assert not CacheConfig.enable_prefix_caching and not SchedulerConfig.enable_chunked_prefill


@pytest.mark.parametrize(
    "device, tensor_parallel_size, expected",
    [("cpu", 1, 4096), ("cpu", 2, 8192), ("cuda", 1, 8192), ("cuda", 2, 8192)],
)
def test_v1_token_budget_follows_vllms_defaults(device, tensor_parallel_size, expected):
    """vLLM's `get_batch_defaults` for its `LLM` class: 4096 per worker on a
    CPU, 8192 on a GPU (below 70 GiB; vllm_differences row 61)."""
    assert v1_default_max_num_batched_tokens(device, tensor_parallel_size) == expected


def test_v1_token_budget_is_at_least_max_num_seqs(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir("llama"), use_v1=True,
                        max_num_seqs=5000).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 5000


def test_v1_batch_defaults_follow_vllms_rules(tiny_model_dir):
    """vLLM's `_set_default_max_num_seqs_and_batched_tokens_args`: without
    chunked prefill the budget is the device's but at least max_model_len;
    a default max_num_seqs is cut to a smaller budget given. The classic
    engine keeps v0.6's: max(max_model_len, 2048), and 256 sequences, so a
    budget of 64 is refused there."""
    model = tiny_model_dir("llama")

    def limits(**kwargs) -> tuple[int, int]:
        config = EngineArgs(model=model, device="cpu", **kwargs).create_engine_config()
        return config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens

    assert limits(use_v1=True, enable_chunked_prefill=False) == (256, 4096)
    # (A context longer than the device's budget: the tiny model has 512.)
    assert EngineArgs(use_v1=True)._batch_limits(True, False, "cpu", 5000) == (256, 5000)
    assert limits(use_v1=False, max_model_len=500) == (256, 2048)
    assert limits(use_v1=True, max_num_batched_tokens=64) == (64, 64)
    assert limits(use_v1=True, max_num_batched_tokens=64, max_num_seqs=8) == (8, 64)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs"):
        limits(use_v1=True, max_num_batched_tokens=64, max_num_seqs=100)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs"):
        limits(use_v1=False, max_num_batched_tokens=64, enable_chunked_prefill=True)


def test_long_prefill_token_threshold_is_v1s(tiny_model_dir):
    def config(use_v1: bool, threshold: int):
        args = EngineArgs(model=tiny_model_dir("llama"), use_v1=use_v1,
                          long_prefill_token_threshold=threshold)
        return args.create_engine_config()

    assert config(True, 32).scheduler_config.long_prefill_token_threshold == 32
    with pytest.raises(ValueError, match="long_prefill_token_threshold=32 is an option of the V1"):
        config(False, 32)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        config(True, -1)


def test_scheduler_reserve_full_isl_can_be_turned_off_on_v1_only(tiny_model_dir):
    def config(use_v1: bool, reserve: bool):
        args = EngineArgs(model=tiny_model_dir("llama"), use_v1=use_v1,
                          scheduler_reserve_full_isl=reserve)
        return args.create_engine_config().scheduler_config

    assert config(True, True).scheduler_reserve_full_isl is True  # vLLM's default
    assert config(True, False).scheduler_reserve_full_isl is False
    assert config(False, True).scheduler_reserve_full_isl is True
    with pytest.raises(ValueError, match="scheduler_reserve_full_isl=False is an option of the V1"):
        config(False, False)


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True)])
def test_minivllm_use_v1_selects_the_engine(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("MINIVLLM_USE_V1", raising=False)
    else:
        monkeypatch.setenv("MINIVLLM_USE_V1", value)
    assert EngineArgs().resolve_use_v1() is expected
    assert EngineArgs(use_v1=not expected).resolve_use_v1() is (not expected)  # the option wins


def test_a_bad_minivllm_use_v1_is_refused(monkeypatch):
    monkeypatch.setenv("MINIVLLM_USE_V1", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_USE_V1 must be 0 or 1, got 'yes'"):
        EngineArgs().resolve_use_v1()


def test_a_flag_reaches_the_engine(tiny_model_dir):
    args = parser().parse_args(["--model", tiny_model_dir("llama"), "--block-size", "8",
                                "--num-gpu-blocks-override", "20", "--enable-prefix-caching"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.cache_config.block_size, config.cache_config.num_gpu_blocks_override) == (8, 20)
    assert config.cache_config.enable_prefix_caching


def test_environment_variables_are_read_when_used(monkeypatch):
    monkeypatch.delenv("MINIVLLM_TRACE", raising=False)
    assert envs.MINIVLLM_TRACE is None
    monkeypatch.setenv("MINIVLLM_TRACE", "run.jsonl")
    assert envs.MINIVLLM_TRACE == "run.jsonl"
    with pytest.raises(AttributeError):
        envs.MINIVLLM_NO_SUCH_VARIABLE  # noqa: B018


def reads_environment(tree: ast.AST) -> bool:
    """Whether code (not a docstring) touches os.environ or os.getenv."""
    return any(
        isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")
        and isinstance(node.value, ast.Name) and node.value.id == "os"
        for node in ast.walk(tree)
    )


def test_every_environment_variable_is_named_in_envs_only():
    """envs.py is the one place: every MINIVLLM_ name the package mentions is
    listed there, and no other module of the engine reads the environment."""
    mentioned, readers = set(), []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        mentioned |= set(re.findall(r"\bMINIVLLM_[A-Z0-9_]+\b", text))
        if path.name != "envs.py" and reads_environment(ast.parse(text)):
            readers.append(str(path.relative_to(PACKAGE)))
    assert mentioned == {name for name in envs.ENVIRONMENT_VARIABLES if "MINIVLLM_" in name}
    assert readers == []


def test_a_variable_set_but_empty_is_refused_not_taken_as_unset(monkeypatch):
    from minivllm.attention.selector import get_attn_backend

    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "")
    with pytest.raises(ValueError, match="MINIVLLM_ATTENTION_BACKEND"):
        get_attn_backend(None, "cpu", torch.float32, 16, 16)


WAIT_POLICY_WHEN_TORCH_LOADS = """
import os, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Spy())
import minivllm
print(seen[0], os.environ["OMP_WAIT_POLICY"])
"""


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_are_passive_before_torch_loads(given, expected):
    """envs.py sets OMP_WAIT_POLICY before torch (and its libgomp, which reads
    it once at load) is imported by `import minivllm`; a user's value wins."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    run = subprocess.run(
        [sys.executable, "-c", WAIT_POLICY_WHEN_TORCH_LOADS],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [expected, expected]
