"""Swapping in one's own component: `block_manager_cls`, `scheduler_cls` and
an `attention_backend` class, the labs' way of running a learner's code
inside the real engine (no monkey-patching)."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.abstract import AttentionBackend
from minivllm.attention.backends.torch_paged import TorchAttentionBackend, TorchPagedAttention
from minivllm.attention.selector import get_attn_backend
from minivllm.core.block_manager import BlockSpaceManager
from tests.engine_spies import RecordingScheduler

PROMPTS = [[(3 * i + j) % 200 + 2 for j in range(n)] for i, n in enumerate([5, 20, 37])]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class CountingBlockManager(BlockSpaceManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"allocate": 0, "append_slots": 0, "free": 0}

    def allocate(self, seq_group):
        self.calls["allocate"] += 1
        return super().allocate(seq_group)

    def append_slots(self, seq):
        self.calls["append_slots"] += 1
        return super().append_slots(seq)

    def free(self, seq):
        self.calls["free"] += 1
        return super().free(seq)


class RecordingAttention(TorchPagedAttention):
    decodes = 0

    def forward_decode(self, query, kv_cache, block_tables, seq_lens, max_seq_len):
        RecordingAttention.decodes += 1
        return super().forward_decode(query, kv_cache, block_tables, seq_lens, max_seq_len)


def token_ids(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return token_ids(LLM(tiny_model_dir("llama"), attention_backend="torch"))


def test_block_manager_class(tiny_model_dir, reference):
    llm = LLM(
        tiny_model_dir("llama"), attention_backend="torch", block_manager_cls=CountingBlockManager
    )
    assert token_ids(llm) == reference
    calls = llm.llm_engine.scheduler.block_manager.calls
    # One allocation and one free per request; one append per decode step
    # of each sequence (12 tokens: the first comes from the prefill).
    assert calls == {"allocate": 3, "append_slots": 3 * 11, "free": 3}


def test_scheduler_class_by_name(tiny_model_dir, reference):
    RecordingScheduler.steps = 0
    llm = LLM(
        tiny_model_dir("llama"),
        attention_backend="torch",
        scheduler_cls="tests.engine_spies.RecordingScheduler",
    )
    assert token_ids(llm) == reference
    assert type(llm.llm_engine.scheduler) is RecordingScheduler
    assert RecordingScheduler.steps == 12  # one prefill step, then 11 decode steps


def test_attention_backend_class(tiny_model_dir, reference):
    RecordingAttention.decodes = 0
    llm = LLM(tiny_model_dir("llama"), attention_backend=RecordingAttention)
    assert token_ids(llm) == reference
    assert RecordingAttention.decodes == 11 * 2  # 11 decode steps x 2 layers


class RecordingBackend(TorchAttentionBackend):
    copies: list[list[tuple[int, int]]] = []

    @staticmethod
    def get_impl_cls():
        return RecordingAttention

    @staticmethod
    def copy_blocks(kv_caches, pairs):
        RecordingBackend.copies.append(list(pairs))
        TorchAttentionBackend.copy_blocks(kv_caches, pairs)


def test_attention_backend_names_impl_and_cache_operations():
    from minivllm.attention.backends.cuda_paged import CudaAttentionBackend

    def select(choice):
        return get_attn_backend(choice, "cpu", torch.float32, 64, 16)

    for name in ("torch", "numba"):
        backend = select(name)
        assert issubclass(backend, AttentionBackend) and backend.get_name() == name
    assert CudaAttentionBackend.get_name() == "cuda"
    # An implementation class gets the torch backend's cache operations, one wrapper per class.
    wrapped = select(RecordingAttention)
    assert issubclass(wrapped, TorchAttentionBackend)
    assert wrapped.get_impl_cls() is RecordingAttention
    assert select(RecordingAttention) is wrapped
    assert select(RecordingBackend) is RecordingBackend


def test_attention_backend_subclass_runs_impl_and_copy_blocks(tiny_model_dir, reference):
    RecordingAttention.decodes = 0
    RecordingBackend.copies = []
    llm = LLM(tiny_model_dir("llama"), attention_backend=RecordingBackend)
    assert token_ids(llm) == reference
    assert RecordingAttention.decodes == 11 * 2
    assert not RecordingBackend.copies  # n=1: no block is shared, nothing copied
    # n=2 after a 5-token prompt in blocks of 16: both samples write into the
    # shared last block, so the engine copies it on write through the backend.
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert RecordingBackend.copies


def test_bad_component_names_the_option(tiny_model_dir):
    with pytest.raises(ValueError, match=r"block_manager_cls='no.such.Manager' names no"):
        LLM(tiny_model_dir("llama"), block_manager_cls="no.such.Manager")
    with pytest.raises(ValueError, match=r"scheduler_cls must be a class"):
        LLM(tiny_model_dir("llama"), scheduler_cls="minivllm.config.default_cpu_kv_cache_bytes")
