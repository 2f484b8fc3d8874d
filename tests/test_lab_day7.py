"""Day 7's checkers (tools/labs/checks/day7.py) reject every catalogued mistake with the
message that names it, and pass the solution and a differently written correct answer.

The answers are written here (tests never import notebooks): exercise 1 as a Python
function with one flag per mistake, exercises 2-4 as the lab's CUDA sources, each mistake
the solution with one thing changed. Every CUDA variant the tests launch is compiled once,
together, by the module fixture (one compiler start; the checker's own build then finds it).
"""

from __future__ import annotations

import re

import pytest
import torch

from minivllm import cuda_emu
from tools.labs.checks import day7

pytestmark = pytest.mark.skipif(
    cuda_emu.compiler() is None, reason="the CUDA emulator needs a C++ compiler (g++, or $CXX)"
)

# -- exercise 1: the launch configuration --------------------------------------------------


def _config(num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len, dtype, *,
            swapped_grid=False, kv_grid=False, unpadded=False, floats=False, tgs_block=False,
            vec_fp32=False, vec_lane=False, no_out_smem=False, name_order=False, grid_1d=False,
            cache_bytes=False, floor_dims=False):
    tgs = block_size if tgs_block else 32 // block_size
    size = 4 if vec_fp32 else dtype.itemsize
    vec = 16 // size if vec_lane else max(16 // (tgs * size), 1)
    padded = -(-max_seq_len // block_size) * block_size
    smem = (max_seq_len if unpadded else padded) * (1 if floats else 4)
    if cache_bytes:
        smem = padded * dtype.itemsize
    grid = (num_kv_heads if kv_grid else num_heads, num_seqs)
    t = {torch.float32: "float", torch.float16: "fp16_t", torch.bfloat16: "bf16_t"}[dtype]
    sizes = f"{block_size}, {head_size}" if name_order else f"{head_size}, {block_size}"
    return {
        "kernel": f"paged_attention_v1_kernel<{t}, {sizes}, 128>",
        "grid": num_heads * num_seqs if grid_1d else grid[::-1] if swapped_grid else grid,
        "threads": 128,
        "num_warps": 4,
        "thread_group_size": tgs,
        "vec_size": vec,
        "dims_per_lane": head_size // 32 if floor_dims else -(-head_size // 32),
        "static_smem_bytes": 4 * (head_size + 4 + (0 if no_out_smem else 4 * head_size)),
        "dynamic_smem_bytes": smem,
    }


def _config_other(num_seqs, num_heads, num_kv_heads, head_size, block_size, max_seq_len, dtype):
    """Correct, written otherwise: from the launcher's own helpers and bytes per load."""
    from minivllm import _custom_ops as ops

    warps = ops.NUM_THREADS // 32
    lanes = 32 // block_size
    load_bytes = 16
    return dict(
        kernel=ops.paged_attention_kernel_names(dtype, head_size, block_size)[0],
        grid=[num_heads, num_seqs],
        threads=ops.NUM_THREADS,
        num_warps=warps,
        thread_group_size=lanes,
        vec_size=max(1, load_bytes // lanes // dtype.itemsize),
        dims_per_lane=(head_size + 31) // 32,
        static_smem_bytes=torch.empty(head_size * (1 + warps) + warps).nbytes,
        dynamic_smem_bytes=torch.empty(-(-max_seq_len // block_size), block_size).nbytes,
    )


@pytest.mark.parametrize("mistake, message", [
    ("swapped_grid", "the grid is (num_heads, num_seqs)"),
    ("kv_grid", "one thread block per *query* head"),
    ("unpadded", "rounds max_seq_len up to whole blocks"),
    ("floats", "shared memory is given in bytes"),
    ("tgs_block", "a thread group is the lanes that share one token"),
    ("vec_fp32", "VEC_SIZE depends on the dtype"),
    ("vec_lane", "16 bytes is what a whole thread *group* loads"),
    ("no_out_smem", "count out_smem too"),
    ("name_order", "the instantiation is paged_attention_v1_kernel<dtype, HEAD_SIZE, BLOCK_SIZE"),
    ("grid_1d", "v1's grid has two dimensions"),
    ("cache_bytes", "the logits are float32 whatever the cache's dtype"),
    ("floor_dims", "a lane owns ceil(HEAD_SIZE / WARP_SIZE) dimensions"),
])
def test_exercise_1_rejects(mistake, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        day7.exercise_1(lambda *a: _config(*a, **{mistake: True}))


def test_exercise_1_wants_a_dict_with_every_key():
    with pytest.raises(AssertionError, match="return a dict"):
        day7.exercise_1(lambda *a: list(_config(*a).values()))
    with pytest.raises(AssertionError, match="your dict has no vec_size"):
        day7.exercise_1(lambda *a: {k: v for k, v in _config(*a).items() if k != "vec_size"})


@pytest.mark.parametrize("answer", [_config, _config_other], ids=["solution", "other"])
def test_exercise_1_passes(answer, capsys):
    day7.exercise_1(answer)
    assert capsys.readouterr().out == "Day 7, exercise 1: passed\n"


# -- the CUDA answers ----------------------------------------------------------------------

# The solutions, as in the lab's exercise cells.
QK_LOGIT = r"""
// Stage 2 for one KV block: scale * q.k for the token that this lane's thread group owns in
// logical block b, i.e. token b * BLOCK_SIZE + group. Every lane of the warp calls it; the first
// lane of each group must return the group's whole (scaled) dot product.
// key_cache: [num_blocks][BLOCK_SIZE][num_kv_heads][HEAD_SIZE], the layout of Day 4.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
__device__ float qk_logit(const float* q_smem,           // [HEAD_SIZE]: the query row
                          float scale,                   // 1 / sqrt(HEAD_SIZE)
                          const scalar_t* key_cache,     // one layer's keys (layout above)
                          const long long* block_table,  // this sequence's row of block_tables
                          int b,                         // the logical block this warp is on
                          int seq_len, int head, int num_heads, int num_kv_heads) {
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;  // lanes per token
  constexpr int GROUP_BYTES = THREAD_GROUP_SIZE * static_cast<int>(sizeof(scalar_t));
  constexpr int VEC_SIZE = GROUP_BYTES >= 16 ? 1 : 16 / GROUP_BYTES;  // elements per lane load
  constexpr int GROUP_CHUNK = THREAD_GROUP_SIZE * VEC_SIZE;           // elements per group load
  const int lane = threadIdx.x % WARP_SIZE;
  const int group = lane / THREAD_GROUP_SIZE;  // the token of the block this group owns
  const int rank = lane % THREAD_GROUP_SIZE;   // this lane's place in its group
  ### BEGIN SOLUTION
  const int kv_head = head / (num_heads / num_kv_heads);
  float dot = 0.f;
  if (b * BLOCK_SIZE + group < seq_len) {
    const long long physical_block = block_table[b];
    const scalar_t* k =
        key_cache + ((physical_block * BLOCK_SIZE + group) * num_kv_heads + kv_head) * HEAD_SIZE;
    for (int base = rank * VEC_SIZE; base < HEAD_SIZE; base += GROUP_CHUNK)
      for (int j = 0; j < VEC_SIZE; ++j) dot += q_smem[base + j] * to_float(k[base + j]);
  }
  for (int offset = THREAD_GROUP_SIZE / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(FULL_MASK, dot, offset);
  return dot * scale;
  ### END SOLUTION
}
"""

# Correct, written otherwise: vector loads, a row pointer from the token's slot, the
# butterfly as a while loop.
QK_LOGIT_OTHER = r"""
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE>
__device__ float qk_logit(const float* q_smem, float scale, const scalar_t* key_cache,
                          const long long* block_table, int b, int seq_len, int head,
                          int num_heads, int num_kv_heads) {
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  constexpr int GROUP_BYTES = THREAD_GROUP_SIZE * static_cast<int>(sizeof(scalar_t));
  constexpr int VEC_SIZE = GROUP_BYTES >= 16 ? 1 : 16 / GROUP_BYTES;
  const int lane = threadIdx.x % WARP_SIZE;
  const int group = lane / THREAD_GROUP_SIZE;
  const int rank = lane % THREAD_GROUP_SIZE;
  const int queries_per_kv = num_heads / num_kv_heads;
  const int token = b * BLOCK_SIZE + group;
  float partial = 0.f;
  if (token < seq_len) {
    const long long slot = block_table[token / BLOCK_SIZE] * BLOCK_SIZE + token % BLOCK_SIZE;
    const scalar_t* row = key_cache + slot * num_kv_heads * HEAD_SIZE;
    const scalar_t* k = row + (head / queries_per_kv) * HEAD_SIZE;
    for (int v = rank; v * VEC_SIZE < HEAD_SIZE; v += THREAD_GROUP_SIZE) {
      const Vec<scalar_t, VEC_SIZE> kv = *reinterpret_cast<const Vec<scalar_t, VEC_SIZE>*>(
          k + v * VEC_SIZE);
      for (int j = 0; j < VEC_SIZE; ++j) partial += q_smem[v * VEC_SIZE + j] * to_float(kv.v[j]);
    }
  }
  partial *= scale;
  int mask = THREAD_GROUP_SIZE >> 1;
  while (mask >= 1) {
    partial = partial + __shfl_xor_sync(0xffffffffu, partial, mask);
    mask >>= 1;
  }
  return partial;
}
"""

SOFTMAX = r"""
// Stage 3. logits[0 .. num_tokens): q.k of every token, written by stage 2. qk_max: on entry the
// max of the logits this thread wrote (-inf if none); on return the block-wide max, in every
// thread. Turn each logit into expf(logit - max) in place; return their sum, in every thread.
template <int NUM_THREADS>
__device__ float softmax_numerators(float* logits, int num_tokens, float& qk_max,
                                    float* red_smem) {  // [NUM_WARPS] floats of shared memory
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  ### BEGIN SOLUTION
  qk_max = block_reduce<NUM_WARPS, true>(qk_max, red_smem);
  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  return block_reduce<NUM_WARPS, false>(exp_sum, red_smem);
  ### END SOLUTION
}
"""

# Correct, written otherwise: both levels of each reduction by hand.
SOFTMAX_OTHER = r"""
template <int NUM_THREADS>
__device__ float softmax_numerators(float* logits, int num_tokens, float& qk_max,
                                    float* red_smem) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  float m = qk_max;
  for (int o = 16; o >= 1; o /= 2) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
  if (lane == 0) red_smem[warp] = m;
  __syncthreads();
  m = red_smem[0];
  for (int w = 1; w < NUM_WARPS; ++w) m = fmaxf(m, red_smem[w]);
  __syncthreads();
  qk_max = m;
  float total = 0.f;
  int i = threadIdx.x;
  while (i < num_tokens) {
    logits[i] = expf(logits[i] - m);
    total += logits[i];
    i += NUM_THREADS;
  }
  for (int o = 16; o >= 1; o /= 2) total += __shfl_xor_sync(FULL_MASK, total, o);
  if (lane == 0) red_smem[warp] = total;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < NUM_WARPS; ++w) sum += red_smem[w];
  __syncthreads();
  return sum;
}
"""

VALUES = r"""
// Stage 4. out_row[d] = sum over tokens t < seq_len of probs[t] * v_t[d] / exp_sum, where v_t is
// token t's value row for kv_head. Warp w takes logical blocks w, w + NUM_WARPS, ...; lane l owns
// dimensions l, l + WARP_SIZE, ...; the warps' partial sums meet in out_smem.
template <typename scalar_t, typename out_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ void weighted_values(out_t* out_row,              // [HEAD_SIZE]
                                const float* probs,          // [seq_len]: stage 3's numerators
                                float exp_sum,               // their sum
                                const scalar_t* value_cache, // same layout as the key cache
                                const long long* block_table, int seq_len, int kv_head,
                                int num_kv_heads) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int DIMS_PER_LANE = (HEAD_SIZE + WARP_SIZE - 1) / WARP_SIZE;
  __shared__ float out_smem[NUM_WARPS][HEAD_SIZE];
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const int num_blocks = (seq_len + BLOCK_SIZE - 1) / BLOCK_SIZE;
  ### BEGIN SOLUTION
  float acc[DIMS_PER_LANE];
  for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.f;
  for (int b = warp; b < num_blocks; b += NUM_WARPS) {
    const long long physical_block = block_table[b];
    const int count = min(BLOCK_SIZE, seq_len - b * BLOCK_SIZE);  // the last block may be partial
    for (int t = 0; t < count; ++t) {
      const float p = probs[b * BLOCK_SIZE + t];
      const scalar_t* v =
          value_cache + ((physical_block * BLOCK_SIZE + t) * num_kv_heads + kv_head) * HEAD_SIZE;
      for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + i * WARP_SIZE;
        if (d < HEAD_SIZE) acc[i] += p * to_float(v[d]);
      }
    }
  }
  for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = lane + i * WARP_SIZE;
    if (d < HEAD_SIZE) out_smem[warp][d] = acc[i];
  }
  __syncthreads();  // every warp's partial row is in out_smem before anyone adds them up
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float sum = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w][d];
    out_row[d] = from_float<out_t>(sum / exp_sum);
  }
  ### END SOLUTION
}
"""

# Correct, written otherwise: each lane owns a contiguous run of dimensions, the weights
# are normalised as they are read, one loop over the warp's tokens.
VALUES_OTHER = r"""
template <typename scalar_t, typename out_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__device__ void weighted_values(out_t* out_row, const float* probs, float exp_sum,
                                const scalar_t* value_cache, const long long* block_table,
                                int seq_len, int kv_head, int num_kv_heads) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  constexpr int DIMS_PER_LANE = (HEAD_SIZE + WARP_SIZE - 1) / WARP_SIZE;
  __shared__ float out_smem[NUM_WARPS][HEAD_SIZE];
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  float acc[DIMS_PER_LANE] = {};
  const float inv = 1.f / exp_sum;
  for (int t = warp * BLOCK_SIZE; t < seq_len; ++t) {
    if ((t / BLOCK_SIZE) % NUM_WARPS != warp) {
      t += (NUM_WARPS - 1) * BLOCK_SIZE - 1;
      continue;
    }
    const long long row = block_table[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE;
    const scalar_t* v = value_cache + (row * num_kv_heads + kv_head) * HEAD_SIZE;
    for (int i = 0; i < DIMS_PER_LANE && lane * DIMS_PER_LANE + i < HEAD_SIZE; ++i)
      acc[i] += probs[t] * inv * to_float(v[lane * DIMS_PER_LANE + i]);
  }
  for (int i = 0; i < DIMS_PER_LANE && lane * DIMS_PER_LANE + i < HEAD_SIZE; ++i)
    out_smem[warp][lane * DIMS_PER_LANE + i] = acc[i];
  __syncthreads();
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS)
    out_row[d] = from_float<out_t>(out_smem[0][d] + out_smem[1][d] + out_smem[2][d]
                                   + out_smem[3][d]);
}
"""


def _changed(source: str, *edits: tuple[str, str]) -> str:
    """The source with each (old, new) replaced; the old text must be there."""
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    return source


QK_MISTAKES = {  # name: (edits, what the checker says)
    "no_scale": ([("return dot * scale;", "return dot;")], "without the scale"),
    "logical": ([("block_table[b];", "b;")], "you read logical block b"),
    "round_robin": ([("head / (num_heads / num_kv_heads)", "head % num_kv_heads")],
                    "(round-robin)"),
    "no_gqa": ([("head / (num_heads / num_kv_heads)", "head")], "query head h read KV head h"),
    "row_stride": ([("((physical_block * BLOCK_SIZE + group) * num_kv_heads + kv_head)",
                     "(physical_block * BLOCK_SIZE + group + kv_head)")],
                   "a row holds every KV head of its token"),
    "whole_warp": ([("THREAD_GROUP_SIZE / 2; offset > 0", "WARP_SIZE / 2; offset > 0")],
                   "the shuffles ran over the whole warp"),
    "no_reduce": ([("    dot += __shfl_xor_sync(FULL_MASK, dot, offset);", "    ;")],
                  "the logit is lane rank 0's partial sum alone"),
    "every_lane_all": ([("base = rank * VEC_SIZE; base < HEAD_SIZE; base += GROUP_CHUNK",
                         "base = 0; base < HEAD_SIZE; base += VEC_SIZE")],
                       "every lane summed the whole row"),
    "shuffle_in_if": ([("""  }
  for (int offset = THREAD_GROUP_SIZE / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(FULL_MASK, dot, offset);""",
                        """    for (int offset = THREAD_GROUP_SIZE / 2; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(FULL_MASK, dot, offset);
  }""")], "a shuffle inside `if (token < seq_len)`"),
}
SOFTMAX_MISTAKES = {
    "no_max": ([("expf(logits[i] - qk_max)", "expf(logits[i])")],
               "without subtracting the max"),
    "thread_max": ([("  qk_max = block_reduce<NUM_WARPS, true>(qk_max, red_smem);\n", "")],
                   "qk_max came back as each thread's own max"),
    "warp_max": ([("block_reduce<NUM_WARPS, true>(qk_max, red_smem)", "warp_max(qk_max)")],
                 "each warp held its own max"),
    "no_write_back": ([("    logits[i] = e;\n", "")], "the logits came back unchanged"),
    "thread_sum": ([("return block_reduce<NUM_WARPS, false>(exp_sum, red_smem);",
                     "return exp_sum;")], "the sum you returned is thread 0's own share"),
    "warp_stride": ([("i += NUM_THREADS", "i += WARP_SIZE"),
                     ("int i = threadIdx.x;", "int i = threadIdx.x % WARP_SIZE;")],
                    "two threads handled the same logits[i]"),
    "past_the_end": ([("i < num_tokens", "i <= num_tokens")],
                     "Shared memory past the sequence's tokens holds garbage"),
}
SOFTMAX_OTHER_MISTAKES = {  # on the hand-written reductions
    "no_barrier": ([("  if (lane == 0) red_smem[warp] = m;\n  __syncthreads();\n",
                     "  if (lane == 0) red_smem[warp] = m;\n")], "__syncthreads()"),
}
VALUES_MISTAKES = {
    "past_the_end": ([("min(BLOCK_SIZE, seq_len - b * BLOCK_SIZE)", "BLOCK_SIZE")],
                     "you read value rows past seq_len"),
    "logical": ([("block_table[b];", "b;")], "logical block b of the value cache"),
    "no_divide": ([("sum / exp_sum", "sum")], "you did not divide by exp_sum"),
    "no_barrier": ([("  __syncthreads();  // every warp's", "  // every warp's")], "a race"),
    "warp0_only": ([("for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w][d];",
                     "sum = out_smem[0][d];")], "only warp 0's blocks reached the output"),
    "block0_weights": ([("probs[b * BLOCK_SIZE + t]", "probs[t]")],
                       "every block used the weights of block 0"),
    "row_stride": ([("((physical_block * BLOCK_SIZE + t) * num_kv_heads + kv_head)",
                     "(physical_block * BLOCK_SIZE + t + kv_head)")],
                   "rows are num_kv_heads * HEAD_SIZE = 128 elements apart"),
}


def _mistaken(source: str, table: dict, name: str) -> str:
    return _changed(source, *table[name][0])


@pytest.fixture(scope="module", autouse=True)
def built():
    """Compile every variant the tests below launch, in one translation unit."""
    variants = [day7._qk_variant(day7._fragment(s, 2)) for s in
                [QK_LOGIT, QK_LOGIT_OTHER, *(_mistaken(QK_LOGIT, QK_MISTAKES, m)
                                             for m in QK_MISTAKES)]]
    variants += [day7._softmax_variant(day7._fragment(s, 3)) for s in
                 [SOFTMAX, SOFTMAX_OTHER, *(_mistaken(SOFTMAX, SOFTMAX_MISTAKES, m)
                                            for m in SOFTMAX_MISTAKES),
                  *(_mistaken(SOFTMAX_OTHER, SOFTMAX_OTHER_MISTAKES, m)
                    for m in SOFTMAX_OTHER_MISTAKES)]]
    for values in [VALUES, VALUES_OTHER, *(_mistaken(VALUES, VALUES_MISTAKES, m)
                                           for m in VALUES_MISTAKES)]:
        variants += day7._values_variants(day7._fragment(values, 4), None, None)
    variants += day7._values_variants(
        day7._fragment(VALUES, 4), day7._fragment(_mistaken(QK_LOGIT, QK_MISTAKES, "logical"), 2),
        None)
    variants.append(day7._qk_variant(day7._fragment(ENDLESS, 2)))
    day7.build(variants)


# -- exercise 2: q.k -------------------------------------------------------------------


@pytest.mark.parametrize("mistake", list(QK_MISTAKES))
def test_exercise_2_rejects(mistake):
    with pytest.raises(AssertionError, match=re.escape(QK_MISTAKES[mistake][1])):
        day7.exercise_2(_mistaken(QK_LOGIT, QK_MISTAKES, mistake))


@pytest.mark.parametrize("answer", [QK_LOGIT, QK_LOGIT_OTHER], ids=["solution", "other"])
def test_exercise_2_passes(answer, capsys):
    day7.exercise_2(answer)
    assert capsys.readouterr().out == "Day 7, exercise 2: passed\n"


def test_exercise_2_waits_for_the_learner():
    lab = QK_LOGIT.split("  ### BEGIN")[0] + '  raise NotImplementedError("Day 7, exercise 2")\n}'
    with pytest.raises(NotImplementedError, match="Day 7, exercise 2"):
        day7.exercise_2(lab)


def test_exercise_2_shows_compiler_errors_with_a_hint():
    """float16 keys are raw 16-bit patterns: multiplying one is a compile error."""
    with pytest.raises(AssertionError, match=r"does not compile(.|\n)*exercise 2 \(qk_logit\):"
                       r"(.|\n)*Hint: an fp16_t is a raw 16-bit pattern"):
        day7.exercise_2(_changed(QK_LOGIT, ("to_float(k[base + j])", "k[base + j]")))


ENDLESS = _changed(QK_LOGIT, ("base < HEAD_SIZE; base += GROUP_CHUNK", "base < HEAD_SIZE;"))


def test_exercise_2_stops_an_endless_loop(monkeypatch):
    monkeypatch.setattr(day7, "TIME_LIMIT_S", 1.0)
    with pytest.raises(AssertionError, match="did not finish in 1 s"):
        day7.exercise_2(ENDLESS)


# -- exercise 3: the softmax -----------------------------------------------------------


@pytest.mark.parametrize("source, mistake", [
    *((SOFTMAX, m) for m in SOFTMAX_MISTAKES),
    *((SOFTMAX_OTHER, m) for m in SOFTMAX_OTHER_MISTAKES),
])
def test_exercise_3_rejects(source, mistake):
    table = SOFTMAX_MISTAKES if source is SOFTMAX else SOFTMAX_OTHER_MISTAKES
    with pytest.raises(AssertionError, match=re.escape(table[mistake][1])):
        day7.exercise_3(_mistaken(source, table, mistake))


@pytest.mark.parametrize("answer", [SOFTMAX, SOFTMAX_OTHER], ids=["solution", "other"])
def test_exercise_3_passes(answer, capsys):
    day7.exercise_3(answer)
    assert capsys.readouterr().out == "Day 7, exercise 3: passed\n"


def test_compiler_messages_keep_the_learners_lines_and_hint():
    stderr = (
        "In file included from unit.cpp:1:\n"
        "exercise 3 (softmax_numerators):7:21: error: '__expf' was not declared in this scope\n"
        "paged_attention.cu:180:3: note: in instantiation of ...\n"
    )
    message = day7._compile_message(stderr)
    assert "exercise 3 (softmax_numerators):7:21: error: '__expf'" in message
    assert "paged_attention.cu:180" not in message
    assert message.endswith("Hint: the emulator has no __expf (a GPU intrinsic): use expf.")


# -- exercise 4: the values, then the engine ------------------------------------------------


@pytest.mark.parametrize("mistake", list(VALUES_MISTAKES))
def test_exercise_4_rejects(mistake):
    with pytest.raises(AssertionError, match=re.escape(VALUES_MISTAKES[mistake][1])):
        day7.exercise_4(_mistaken(VALUES, VALUES_MISTAKES, mistake))


@pytest.mark.parametrize("answer", [VALUES, VALUES_OTHER], ids=["solution", "other"])
def test_exercise_4_passes(answer, capsys):
    day7.exercise_4(answer)
    assert capsys.readouterr().out == "Day 7, exercise 4: passed\n"
    lines = day7.engine_texts()
    assert lines[0] == "decode attention: the v1 kernel with your weighted_values"
    assert all("(same tokens and log-probabilities as the PyTorch backend)" in line
               for line in lines[1:])


def test_exercise_4_runs_the_earlier_functions_in_the_engine(capsys):
    """A qk_logit that reads logical blocks: its stage is spliced only into the engine's
    kernel, whose tokens then differ; an unfinished exercise 3 runs the reference stage."""
    lab_softmax = SOFTMAX.split("  ### BEGIN")[0] + (
        '  raise NotImplementedError("Day 7, exercise 3")\n}')
    with pytest.raises(AssertionError, match=r"inside the engine \(the shipped model, greedy\), "
                       r"with your qk_logit, weighted_values in the kernel"):
        day7.exercise_4(VALUES, _mistaken(QK_LOGIT, QK_MISTAKES, "logical"), lab_softmax)
    assert "(exercise 3 is not done yet" in capsys.readouterr().out
