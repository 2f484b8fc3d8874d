"""CUDA graphs of decode steps (worker/cuda_graph_runner.py, ModelRunner.capture_model,
and V1's GPUModelRunner.capture_model).

The oracle is the eager engine on the same checkpoint (`enforce_eager=True`).

On a CPU nothing is captured, so these tests check the decisions around the
graphs: which steps a graph runs (vLLM's `_use_captured_graph`), how many
graphs and of which sizes, and that routing each such step through a graph
runner, with its padded batch, leaves every token as it was. Once with a
stand-in for the whole runner, and once with the real `capture_model` and
`CUDAGraphRunner` over a stand-in for `torch.cuda.CUDAGraph` whose replay
runs the recorded forward again on the same buffers: what a replay computes.

V1 (`use_v1=True`) is checked the same ways, at its own sizes (current
vLLM's list) and by its own rule: a step whose every request computes one
token, prompt or not, is padded and replayed.

On a GPU (marker `cuda`) the graphs are real: the engine's tokens equal the
eager engine's, in both engines, and a replay equals the eager forward of
the same padded batch bit for bit, cache writes included.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.attention.backends.torch_paged import TorchAttentionBackend
from minivllm.compilation import set_forward_context
from minivllm.v1.worker.gpu_model_runner import cudagraph_capture_sizes
from minivllm.worker.cuda_graph_runner import CUDAGraphRunner
from minivllm.worker.model_runner import _BATCH_SIZES_TO_CAPTURE, _get_graph_batch_size
from minivllm.worker.worker import Worker as ClassicWorker
from tests.hf_oracle import poison_kv_cache
from tools.tiny_models import make_tiny_model

# Six requests finishing one after another: decode batches of 6, 5, 4, 3, 2
# and 1 sequences (padded to 8, 8, 4, 4, 2, 1). The 70-token prompt is longer
# than the graphs' contexts in the tests that cap them at 64.
PROMPT_LENS = [1, 17, 70, 5, 33, 9]
MAX_TOKENS = [40, 30, 8, 20, 12, 6]


def prompts() -> list[dict]:
    return [
        {"prompt_token_ids": [(5 * i + 11 * j) % 300 + 2 for j in range(n)]}
        for i, n in enumerate(PROMPT_LENS)
    ]


def greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def is_v1(llm: LLM) -> bool:
    return hasattr(llm.llm_engine, "engine_core")


def runner_of(llm: LLM):
    if is_v1(llm):
        return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    return llm.llm_engine.worker.model_runner


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


class EagerStandIn:
    """A graph runner on a CPU: checks it gets a padded decode batch of its
    size and runs the eager forward on it, recording (size, real rows)."""

    def __init__(self, forward, size: int, calls: list[tuple[int, int]]) -> None:
        self.forward, self.size, self.calls = forward, size, calls

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        assert input_ids.shape == (self.size,) and attn_metadata.num_prefills == 0
        real = int((attn_metadata.slot_mapping >= 0).sum())
        self.calls.append((self.size, real))
        return self.forward(input_ids, positions, kv_caches, attn_metadata)


def install_stand_ins(llm: LLM) -> list[tuple[int, int]]:
    runner, calls = runner_of(llm), []
    sizes = [s for s in _BATCH_SIZES_TO_CAPTURE if s <= runner.max_batchsize_to_capture]
    runner.graph_runners = {s: EagerStandIn(runner.model_forward, s, calls) for s in sizes}
    return calls


# -- on a CPU --------------------------------------------------------------------------------


def test_nothing_is_captured_on_a_cpu(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), attention_backend="torch")
    assert llm.llm_engine.model_config.enforce_eager is False  # vLLM's default
    assert runner_of(llm).graph_runners == {}


def test_graph_sizes_and_context_follow_the_options(tiny_model_dir):
    model = tiny_model_dir("llama")
    for max_num_seqs, largest in ((1, 1), (3, 4), (6, 8), (100, 104), (1000, 256)):
        llm = LLM(model, attention_backend="torch", max_num_seqs=max_num_seqs)
        assert runner_of(llm).max_batchsize_to_capture == largest
    # No graph covers a context the model cannot hold (vLLM caps it too).
    llm = LLM(model, attention_backend="torch", max_model_len=64)
    assert llm.llm_engine.model_config.max_seq_len_to_capture == 64
    llm = LLM(model, attention_backend="torch", max_model_len=64, max_seq_len_to_capture=40)
    assert runner_of(llm).max_seq_len_to_capture == 40


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_decode_steps_a_graph_covers_run_padded_through_it(tiny_model_dir, backend):
    """Decode-only steps of no more than max_num_seqs (padded) sequences and
    no context past max_seq_len_to_capture go through the graph of the next
    captured size; the others (prefills, the 70-token prompt's steps) run
    eagerly; and the tokens are the eager engine's."""
    options = dict(
        attention_backend=backend, max_num_seqs=8, max_seq_len_to_capture=64, block_size=16
    )
    eager = LLM(tiny_model_dir("llama"), enforce_eager=True, **options)
    want = token_ids(eager.generate(prompts(), greedy(), use_tqdm=False))
    llm = LLM(tiny_model_dir("llama"), **options)
    calls = install_stand_ins(llm)
    got = token_ids(llm.generate(prompts(), greedy(), use_tqdm=False))
    assert got == want
    assert calls, "no step went through a graph"
    for size, real in calls:
        assert size == _get_graph_batch_size(real)
    # Steps with the 70-token prompt (6 sequences, then 5) exceed 64 tokens
    # of context: none ran in a graph, though a graph of 8 exists.
    assert {real for _, real in calls} == {4, 3, 2, 1}


class ReplayEager:
    """`torch.cuda.CUDAGraph` on a CPU. Inside `torch.cuda.graph(g)` the
    forward marked by `record` is noted (with its arguments and output), and
    `replay()` runs it again on the same tensors into the same output: what
    replaying the recorded kernels computes."""

    capturing: ReplayEager | None = None
    replays = 0

    def __init__(self) -> None:
        self.call = None

    def replay(self) -> None:
        forward, args, output = self.call
        output.copy_(forward(*args))
        ReplayEager.replays += 1

    @staticmethod
    def record(forward):
        def recorded(*args):
            output = forward(*args)
            if ReplayEager.capturing is not None:
                ReplayEager.capturing.call = (forward, args, output)
            return output

        return recorded


@contextlib.contextmanager
def capturing(graph: ReplayEager, pool=None):
    ReplayEager.capturing = graph
    try:
        yield
    finally:
        ReplayEager.capturing = None


def test_captured_runners_replay_the_eager_forward(tiny_model_dir, monkeypatch):
    """The real capture_model and CUDAGraphRunner, over ReplayEager: every
    buffer a replay reads is filled from the step, even with stale block
    numbers in the block-table columns past each sequence; the tokens are
    the eager engine's."""
    for name, fake in (("CUDAGraph", ReplayEager), ("graph", capturing),
                       ("synchronize", lambda: None), ("graph_pool_handle", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(TorchAttentionBackend, "supports_cuda_graphs", True)
    options = dict(attention_backend="torch", max_num_seqs=8, max_seq_len_to_capture=64)
    eager = LLM(tiny_model_dir("llama"), enforce_eager=True, **options)
    want = token_ids(eager.generate(prompts(), greedy(), use_tqdm=False))

    llm = LLM(tiny_model_dir("llama"), **options)
    runner = runner_of(llm)
    runner.model_forward = ReplayEager.record(runner.model_forward)
    runner.capture_model(llm.llm_engine.worker.gpu_cache)
    assert sorted(runner.graph_runners) == [1, 2, 4, 8]
    tables = runner.graph_runners[8].input_buffers["block_tables"]  # shared by all sizes
    assert tables.shape == (8, 64 // 16)
    num_blocks = llm.llm_engine.cache_config.num_gpu_blocks
    with torch.inference_mode():  # stale block numbers
        tables.copy_(torch.randint(0, num_blocks, tables.shape))
    ReplayEager.replays = 0
    assert token_ids(llm.generate(prompts(), greedy(), use_tqdm=False)) == want
    assert ReplayEager.replays == MAX_TOKENS[0] - MAX_TOKENS[2]  # the steps after the long prompt


def test_enforce_eager_and_prefills_never_use_a_graph(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), attention_backend="torch", max_num_seqs=8)
    runner = runner_of(llm)
    install_stand_ins(llm)
    engine = llm.llm_engine
    engine.add_request("a", prompts()[1], greedy()[1])
    meta, _ = engine.scheduler.schedule()
    assert meta[0].is_prompt
    model_input = runner.prepare_model_input(meta)
    assert not model_input.attn_metadata.use_cuda_graph
    assert model_input.input_ids.shape == (PROMPT_LENS[1],)
    runner.graph_runners = {}  # as with enforce_eager: nothing captured
    assert not runner._use_captured_graph(model_input.batch)


# -- V1 on a CPU -----------------------------------------------------------------------------


def v1_llm(model: str, **options) -> LLM:
    defaults = dict(attention_backend="torch", max_num_seqs=8, max_seq_len_to_capture=64,
                    block_size=16)
    return LLM(model, use_v1=True, **{**defaults, **options})


def test_v1_capture_sizes_are_current_vllms():
    """1, 2, 4, then multiples of 8 below 256, then of 16, up to twice
    max_num_seqs, at most 512 and max_num_batched_tokens (vLLM's default
    cudagraph_capture_sizes)."""
    assert cudagraph_capture_sizes(1, 2048) == [1, 2]
    assert cudagraph_capture_sizes(3, 2048) == [1, 2, 4]
    assert cudagraph_capture_sizes(8, 2048) == [1, 2, 4, 8, 16]
    assert cudagraph_capture_sizes(20, 2048) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cudagraph_capture_sizes(20, 30) == [1, 2, 4, 8, 16, 24]
    sizes = cudagraph_capture_sizes(256, 8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert sizes[sizes.index(248):sizes.index(248) + 3] == [248, 256, 272]
    assert cudagraph_capture_sizes(10_000, 8192) == sizes


@pytest.mark.parametrize(("max_num_seqs", "captured"), [
    (1, [1]), (3, [1, 2]), (8, [1, 2, 4, 8]), (50, [1, 2, 4, 8, 16, 24, 32, 40, 48])])
def test_v1_captures_the_decode_sizes_up_to_max_num_seqs(tiny_model_dir, max_num_seqs, captured):
    """FULL_DECODE_ONLY: a uniform-decode step has one token per request, so
    no graph larger than max_num_seqs could ever be replayed."""
    runner = runner_of(v1_llm(tiny_model_dir("llama"), max_num_seqs=max_num_seqs))
    assert runner.cudagraph_batch_sizes == captured
    assert runner.graph_runners == {}  # nothing is captured on a CPU


def install_v1_stand_ins(llm: LLM) -> list[tuple[int, int]]:
    runner, calls = runner_of(llm), []
    sizes = runner.cudagraph_batch_sizes
    runner.graph_runners = {s: EagerStandIn(runner.model_forward, s, calls) for s in sizes}
    return calls


def padded_v1_size(num_reqs: int) -> int:
    """By hand from the sizes [1, 2, 4, 8]."""
    return {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8}[num_reqs]


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_v1_uniform_decode_steps_run_padded_through_a_graph(tiny_model_dir, backend):
    """The classic workload on V1: its decode steps of 4, 3, 2 and 1 requests
    (after the 70-token prompt, past the 64-token cap, has finished) go
    through the graph of the next captured size with their padding; the
    prefill step does not; the tokens are V1's eager ones."""
    model = tiny_model_dir("llama")
    want = token_ids(v1_llm(model, enforce_eager=True, attention_backend=backend).generate(
        prompts(), greedy(), use_tqdm=False))
    llm = v1_llm(model, attention_backend=backend)
    calls = install_v1_stand_ins(llm)
    assert token_ids(llm.generate(prompts(), greedy(), use_tqdm=False)) == want
    assert {real for _, real in calls} == {4, 3, 2, 1}
    for size, real in calls:
        assert size == padded_v1_size(real)
    assert len(calls) == MAX_TOKENS[0] - MAX_TOKENS[2]


def test_v1_a_one_token_prompt_alone_is_a_uniform_decode_step(tiny_model_dir):
    """vLLM V1 decides by tokens, not by phase: a request whose whole prompt
    is one token computes one token in its first step, which a graph runs;
    its first sampled token is the eager engine's."""
    model = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = prompts()[0]
    assert len(prompt["prompt_token_ids"]) == 1
    want = token_ids(v1_llm(model, enforce_eager=True).generate([prompt], params, use_tqdm=False))
    llm = v1_llm(model)
    calls = install_v1_stand_ins(llm)
    assert token_ids(llm.generate([prompt], params, use_tqdm=False)) == want
    assert calls == [(1, 1)] * 5  # the prompt's step, then four decodes


def test_v1_prefill_and_mixed_steps_run_eagerly(tiny_model_dir):
    """A prompt's step and a step that mixes one request's decode with
    another's prompt never go through a graph; the decodes after do."""
    llm = v1_llm(tiny_model_dir("llama"))
    calls = install_v1_stand_ins(llm)
    engine = llm.llm_engine
    engine.add_request("a", prompts()[1], greedy()[1])
    engine.step()  # a's 17-token prompt
    engine.add_request("b", prompts()[3], greedy()[3])
    engine.step()  # a's decode and b's 5-token prompt
    assert calls == []
    engine.step()  # both decode
    assert calls == [(2, 2)]


def test_v1_graphs_stop_at_the_context_cap_and_the_largest_size(tiny_model_dir):
    """A request with a 60-token prompt decodes through a graph while its
    context, after the step, is at most max_seq_len_to_capture (64): 61 to
    64, four steps; and with max_num_seqs 3 (graphs of 1 and 2) a step of
    three requests runs eagerly."""
    llm = v1_llm(tiny_model_dir("llama"))
    calls = install_v1_stand_ins(llm)
    prompt = {"prompt_token_ids": [(7 * j) % 300 + 2 for j in range(60)]}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                 use_tqdm=False)
    assert calls == [(1, 1)] * 4
    llm = v1_llm(tiny_model_dir("llama"), max_num_seqs=3)
    calls = install_v1_stand_ins(llm)
    llm.generate(prompts()[3:], greedy()[3:], use_tqdm=False)  # 20, 12 and 6 tokens
    assert sorted(set(calls)) == [(1, 1), (2, 2)]
    assert len(calls) == MAX_TOKENS[3] - MAX_TOKENS[5]


def fake_cuda_graphs(monkeypatch) -> None:
    """torch.cuda's graph capture on a CPU: ReplayEager records, and the
    torch backend counts as capturable."""
    for name, fake in (("CUDAGraph", ReplayEager), ("graph", capturing),
                       ("synchronize", lambda: None), ("graph_pool_handle", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(TorchAttentionBackend, "supports_cuda_graphs", True)


def test_v1_worker_captures_over_its_cache_when_graphs_are_on(tiny_model_dir, monkeypatch):
    """The V1 worker's start-up, where the classic worker would capture
    (a GPU, not enforce_eager, one worker: forced here): the runner gets the
    cache first, then captures every size over it; with enforce_eager it
    captures nothing."""
    fake_cuda_graphs(monkeypatch)
    forced = {}

    def captures(worker) -> bool:
        forced["asked"] = True
        return not worker.model_config.enforce_eager

    monkeypatch.setattr(ClassicWorker, "captures_cuda_graphs", captures)
    monkeypatch.setattr(CUDAGraphRunner, "capture", record_and_capture)
    llm = v1_llm(tiny_model_dir("llama"))
    runner = runner_of(llm)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    assert forced["asked"] and sorted(runner.graph_runners) == [1, 2, 4, 8]
    assert runner.kv_caches is worker.gpu_cache
    assert all(g.captured_caches is worker.gpu_cache for g in runner.graph_runners.values())
    assert runner_of(v1_llm(tiny_model_dir("llama"), enforce_eager=True)).graph_runners == {}


_real_capture = CUDAGraphRunner.capture


def record_and_capture(self, input_ids, positions, kv_caches, attn_metadata, memory_pool):
    self.captured_caches = kv_caches
    return _real_capture(self, input_ids, positions, kv_caches, attn_metadata, memory_pool)


def test_v1_captured_runners_replay_the_eager_forward(tiny_model_dir, monkeypatch):
    """V1's real capture_model and the shared CUDAGraphRunner over ReplayEager,
    stale block numbers in the shared block-table buffer included."""
    fake_cuda_graphs(monkeypatch)
    model = tiny_model_dir("llama")
    want = token_ids(v1_llm(model, enforce_eager=True).generate(
        prompts(), greedy(), use_tqdm=False))
    llm = v1_llm(model)
    runner = runner_of(llm)
    runner.model_forward = ReplayEager.record(runner.model_forward)
    runner.capture_model()
    assert sorted(runner.graph_runners) == [1, 2, 4, 8]
    tables = runner.graph_runners[8].input_buffers["block_tables"]  # shared by all sizes
    assert tables.shape == (8, 64 // 16)
    num_blocks = runner.kv_caches[0].shape[1]
    with torch.inference_mode():
        tables.copy_(torch.randint(0, num_blocks, tables.shape))
    ReplayEager.replays = 0
    assert token_ids(llm.generate(prompts(), greedy(), use_tqdm=False)) == want
    assert ReplayEager.replays == MAX_TOKENS[0] - MAX_TOKENS[2]


# -- on a GPU ---------------------------------------------------------------------------------


def gpu_llm(model: str, dtype: str, **options) -> LLM:
    return LLM(
        model, device="cuda", dtype=dtype, attention_backend="cuda", block_size=16,
        max_num_seqs=8, kv_cache_memory_bytes=64 << 20, swap_space=0.01, **options,
    )


def tiny_gpu_model(path, max_position_embeddings: int = 512) -> str:
    """head_size 64 (a kernel size), GQA 4:2, random weights."""
    return make_tiny_model(
        "llama", str(path), hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=max_position_embeddings,
    )


def count_replays(runner) -> list[int]:
    """Wrap each graph so its replays are listed (by batch size)."""
    replays: list[int] = []

    def counted(size: int, graph):
        def replay(*args):
            replays.append(size)
            return graph(*args)

        return replay

    runner.graph_runners = {s: counted(s, g) for s, g in runner.graph_runners.items()}
    return replays


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "options", "positions"),
    [
        pytest.param("float32", {"max_seq_len_to_capture": 64}, 512, id="fp32"),
        pytest.param("float16", {"max_seq_len_to_capture": 64}, 512, id="fp16"),
        # vLLM's default cap (8192, here the model's 4096): the graphs launch
        # paged_attention_v2 with 8 partitions, most of them past every context.
        pytest.param("float32", {}, 4096, id="fp32-default-cap"),
        # Graphs of the compiled forward, which vLLM captures too.
        pytest.param(
            "float32", {"max_seq_len_to_capture": 64, "compilation_level": 3}, 512,
            id="fp32-compiled",
        ),
    ],
)
@pytest.mark.parametrize("use_v1", [False, True], ids=["classic", "v1"])
def test_graphs_give_the_eager_engines_tokens(tmp_path, dtype, options, positions, use_v1):
    model = tiny_gpu_model(tmp_path / "m", positions)
    seeded = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    results = {}
    for enforce_eager in (True, False):
        llm = gpu_llm(model, dtype, enforce_eager=enforce_eager, use_v1=use_v1, **options)
        runner = runner_of(llm)
        assert sorted(runner.graph_runners) == ([] if enforce_eager else [1, 2, 4, 8])
        replays = count_replays(runner)
        results[enforce_eager] = (
            token_ids(llm.generate(prompts(), greedy(), use_tqdm=False)),
            token_ids(llm.generate(prompts()[:3], seeded, use_tqdm=False)),
        )
        assert enforce_eager or replays, "no step replayed a graph"
    assert results[False] == results[True]


@pytest.mark.cuda
def test_a_replay_equals_the_eager_forward_of_its_padded_batch(tmp_path):
    """Bit for bit, the hidden states of the real rows and the whole KV cache
    (NaN-poisoned first, so a padding row writing or reading a stray slot
    would show). One attention partition (max_seq_len_to_capture 512), so
    the replay and the eager step launch the same kernel."""
    llm = gpu_llm(tiny_gpu_model(tmp_path / "m"), "float32", max_seq_len_to_capture=512)
    engine, runner = llm.llm_engine, runner_of(llm)
    poison_kv_cache(llm)
    for i in range(3):
        engine.add_request(str(i), prompts()[i], greedy()[i])
    engine.step()  # the prefills
    meta, _ = engine.scheduler.schedule()
    model_input = runner.prepare_model_input(meta)
    assert model_input.attn_metadata.use_cuda_graph and model_input.input_ids.shape == (4,)

    cache = engine.worker.gpu_cache
    eager_cache = [layer.clone() for layer in cache]
    args = (model_input.input_ids, model_input.positions)
    with torch.inference_mode(), set_forward_context(
        model_input.attn_metadata, eager_cache, runner.attn_layers, runner.packed_layers
    ):
        want = runner.model_forward(*args, eager_cache, model_input.attn_metadata)
    with torch.inference_mode():
        got = runner.graph_runners[4](*args, cache, model_input.attn_metadata).clone()
    torch.cuda.synchronize()
    assert torch.equal(got[:3], want[:3])
    for layer, eager_layer in zip(cache, eager_cache, strict=True):
        assert torch.equal(layer.view(torch.int32), eager_layer.view(torch.int32))


@pytest.mark.cuda
def test_a_v1_replay_equals_the_eager_forward_of_its_padded_batch(tmp_path):
    """V1's twin of the test above: the step after three prefills, as
    `execute_model` prepares it (3 requests padded to 4), replayed and run
    eagerly over copies of the NaN-poisoned cache, V1's null block included."""
    llm = gpu_llm(tiny_gpu_model(tmp_path / "m"), "float32", max_seq_len_to_capture=512,
                  use_v1=True)
    engine, runner = llm.llm_engine, runner_of(llm)
    cache = runner.kv_caches
    with torch.inference_mode():
        for layer in cache:
            layer.fill_(float("nan"))
    for i in range(3):
        engine.add_request(str(i), prompts()[i], greedy()[i])
    engine.step()  # the prefills
    scheduler_output = engine.engine_core.engine_core.scheduler.schedule()
    runner._update_states(scheduler_output)
    input_ids, positions, attn_metadata, _, _, graph_size = runner._prepare_inputs(
        scheduler_output
    )
    assert graph_size == 4 and input_ids.shape == (4,) and attn_metadata.use_cuda_graph

    eager_cache = [layer.clone() for layer in cache]
    with torch.inference_mode(), set_forward_context(
        attn_metadata, eager_cache, runner.attn_layers, runner.packed_layers
    ):
        want = runner.model_forward(input_ids, positions, eager_cache, attn_metadata)
    with torch.inference_mode():
        got = runner.graph_runners[4](input_ids, positions, cache, attn_metadata).clone()
    torch.cuda.synchronize()
    assert torch.equal(got[:3], want[:3])
    for layer, eager_layer in zip(cache, eager_cache, strict=True):
        assert torch.equal(layer.view(torch.int32), eager_layer.view(torch.int32))
