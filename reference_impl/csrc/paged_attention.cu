// paged_attention.cu: decode attention that reads K/V through block tables.
//
// At a decode step every running sequence brings one new query token, and
// that token attends to all of its sequence's keys and values. These live
// in the paged KV cache, scattered over fixed-size blocks listed in the
// sequence's block table. The layout is the one contract of
// reference_impl/minivllm/attention/kv_cache.py; here, per layer:
//
//   key_cache, value_cache: [num_blocks][BLOCK_SIZE][num_kv_heads][HEAD_SIZE]
//   (the two halves kv_cache[0] and kv_cache[1] of the layer's tensor)
//
// The token at logical position t of a sequence sits in physical block
// block_table[t / BLOCK_SIZE], row t % BLOCK_SIZE.
//
// Two versions, one shared body (paged_attention_partition):
//
//   v1  grid (num_heads, num_seqs). One thread block computes one query head
//       of one sequence over its whole context.
//   v2  grid (num_heads, num_seqs, max_num_partitions). The context is cut into
//       PARTITION_SIZE-token partitions; each thread block computes one
//       partition's max logit, exp-sum and normalised partial output, and
//       paged_attention_v2_reduce_kernel rescales and combines them. Long
//       contexts with few sequences then still fill the GPU.
//
// The body runs in four stages, marked below:
//   1. the query, pre-scaled, goes to shared memory;
//   2. q.k for every token: each warp takes one KV block at a time, and each
//      *thread group* of the warp one token of that block;
//   3. softmax: max and sum reduced in two levels (warp shuffles, then shared
//      memory across warps);
//   4. the probability-weighted sum of V, reduced across warps.
//
// Preconditions (checked by the Python launcher, minivllm/_custom_ops.py):
// query and out contiguous [num_seqs][num_heads][HEAD_SIZE]; block_tables
// [num_seqs][max_num_blocks_per_seq] and seq_lens [num_seqs] int64, every
// seq_len >= 1; num_heads a multiple of num_kv_heads.
#include "dtypes.cuh"

// Reductions ----------------------------------------------------------------

// Butterfly shuffles: after log2(32) exchanges every lane holds the result.
__device__ __forceinline__ float warp_max(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, offset));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(FULL_MASK, x, offset);
  return x;
}

// Block-wide max (IS_MAX) or sum, in two levels: each warp reduces with
// shuffles, lane 0 posts the warp's result to red_smem, then every thread
// combines the NUM_WARPS posted values. Every thread must call it; the
// barriers also publish any shared-memory writes made before the call.
template <int NUM_WARPS, bool IS_MAX>
__device__ float block_reduce(float x, float* red_smem) {
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  x = IS_MAX ? warp_max(x) : warp_sum(x);
  if (lane == 0) red_smem[warp] = x;
  __syncthreads();
  float result = red_smem[0];
  for (int w = 1; w < NUM_WARPS; ++w)
    result = IS_MAX ? fmaxf(result, red_smem[w]) : result + red_smem[w];
  __syncthreads();  // red_smem is free again for the next reduction
  return result;
}

// The shared body -----------------------------------------------------------

// Attention of query head blockIdx.x of sequence blockIdx.y over the tokens
// of partition blockIdx.z (PARTITION_SIZE == 0: all tokens, for v1). Writes
// the softmax-normalised output row to out_row, and for v2 the partition's
// max logit and exp-sum to *max_logit and *exp_sum.
template <typename scalar_t, typename out_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS,
          int PARTITION_SIZE>
__device__ void paged_attention_partition(
    out_t* __restrict__ out_row,                // [HEAD_SIZE]
    float* __restrict__ max_logit,              // v2 only, else nullptr
    float* __restrict__ exp_sum_out,            // v2 only, else nullptr
    const scalar_t* __restrict__ query,         // [num_seqs, num_heads, HEAD_SIZE]
    const scalar_t* __restrict__ key_cache,     // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    const scalar_t* __restrict__ value_cache,   // same layout as key_cache
    const long long* __restrict__ block_tables, // [num_seqs, max_num_blocks_per_seq]
    const long long* __restrict__ seq_lens,     // [num_seqs]
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  // A warp covers one KV block per iteration: BLOCK_SIZE thread groups of
  // THREAD_GROUP_SIZE lanes, one group per token (block 8 -> 4 lanes a token,
  // 16 -> 2, 32 -> 1).
  constexpr int THREAD_GROUP_SIZE = WARP_SIZE / BLOCK_SIZE;
  // Each lane loads VEC_SIZE neighbouring elements at once, so a group reads
  // 16 contiguous bytes of a key row per load.
  constexpr int GROUP_BYTES = THREAD_GROUP_SIZE * static_cast<int>(sizeof(scalar_t));
  constexpr int VEC_SIZE = GROUP_BYTES >= 16 ? 1 : 16 / GROUP_BYTES;
  constexpr int GROUP_CHUNK = THREAD_GROUP_SIZE * VEC_SIZE;  // elements per group load
  // In stage 4 lane l owns output dimensions l, l + 32, l + 64, ...
  constexpr int DIMS_PER_LANE = (HEAD_SIZE + WARP_SIZE - 1) / WARP_SIZE;
  static_assert(NUM_THREADS % WARP_SIZE == 0, "whole warps only");
  static_assert(BLOCK_SIZE * THREAD_GROUP_SIZE == WARP_SIZE, "BLOCK_SIZE must divide 32");
  static_assert(HEAD_SIZE % GROUP_CHUNK == 0, "a group's loads must tile the head");
  static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "partitions are whole blocks");

  const int head = blockIdx.x;
  const int num_heads = gridDim.x;
  const int seq = blockIdx.y;
  const int seq_len = static_cast<int>(seq_lens[seq]);
  // Grouped-query attention: consecutive query heads share one KV head.
  const int kv_head = head / (num_heads / num_kv_heads);

  // The tokens this thread block owns: [token_start, token_end).
  const int token_start = PARTITION_SIZE > 0 ? blockIdx.z * PARTITION_SIZE : 0;
  if (token_start >= seq_len) return;  // a v2 partition past this sequence's end
  const int token_end = PARTITION_SIZE > 0 ? min(token_start + PARTITION_SIZE, seq_len) : seq_len;
  const int num_tokens = token_end - token_start;
  const int block_start = token_start / BLOCK_SIZE;
  const int block_end = (token_end + BLOCK_SIZE - 1) / BLOCK_SIZE;

  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const long long* block_table = block_tables + static_cast<long long>(seq) * max_num_blocks_per_seq;
  // Elements between one cache row (token) and the next.
  const long long token_stride = static_cast<long long>(num_kv_heads) * HEAD_SIZE;

  __shared__ float q_smem[HEAD_SIZE];
  __shared__ float red_smem[NUM_WARPS];
  __shared__ float out_smem[NUM_WARPS][HEAD_SIZE];
  extern __shared__ float logits[];  // [num_tokens]: q.k, then softmax numerators

  // 1. The query row, times the softmax scale, into shared memory: every
  //    warp reads all of it in stage 2.
  const scalar_t* q = query + (static_cast<long long>(seq) * num_heads + head) * HEAD_SIZE;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) q_smem[d] = to_float(q[d]) * scale;
  __syncthreads();

  // 2. q.k. Warp w takes blocks block_start + w, + w + NUM_WARPS, ...; in
  //    each, group g computes the dot product for the block's token g, each
  //    lane summing every GROUP_CHUNK-th run of VEC_SIZE elements, then the
  //    group's lanes add their partial sums by shuffles.
  const int group = lane / THREAD_GROUP_SIZE;
  const int rank = lane % THREAD_GROUP_SIZE;
  float qk_max = neg_infinity();
  for (int b = block_start + warp; b < block_end; b += NUM_WARPS) {
    const long long physical_block = block_table[b];
    const int token = b * BLOCK_SIZE + group;
    // Rows past the sequence's end hold stale data: they are never loaded.
    const bool valid = token < token_end;
    float dot = 0.f;
    if (valid) {
      const scalar_t* k =
          key_cache + (physical_block * BLOCK_SIZE + group) * token_stride + kv_head * HEAD_SIZE;
      for (int base = rank * VEC_SIZE; base < HEAD_SIZE; base += GROUP_CHUNK) {
        const Vec<scalar_t, VEC_SIZE> kv = *reinterpret_cast<const Vec<scalar_t, VEC_SIZE>*>(k + base);
#pragma unroll
        for (int j = 0; j < VEC_SIZE; ++j) dot += q_smem[base + j] * to_float(kv.v[j]);
      }
    }
    // All 32 lanes take part in the shuffles, valid or not.
#pragma unroll
    for (int offset = THREAD_GROUP_SIZE / 2; offset > 0; offset /= 2)
      dot += __shfl_xor_sync(FULL_MASK, dot, offset);
    if (valid && rank == 0) {
      logits[token - token_start] = dot;
      qk_max = fmaxf(qk_max, dot);
    }
  }

  // 3. Softmax over this block's tokens. The first reduction's barrier also
  //    makes every warp's logits visible to every thread.
  qk_max = block_reduce<NUM_WARPS, true>(qk_max, red_smem);
  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - qk_max);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = block_reduce<NUM_WARPS, false>(exp_sum, red_smem);

  // 4. Weighted sum of V. The warps take the same blocks as in stage 2; for
  //    each valid token, lane l accumulates p * v[d] for its dimensions d, so
  //    the 32 lanes read one V row with coalesced loads.
  float acc[DIMS_PER_LANE];
#pragma unroll
  for (int i = 0; i < DIMS_PER_LANE; ++i) acc[i] = 0.f;
  for (int b = block_start + warp; b < block_end; b += NUM_WARPS) {
    const long long physical_block = block_table[b];
    const int first_token = b * BLOCK_SIZE;
    const int count = min(BLOCK_SIZE, token_end - first_token);  // last block may be partial
    for (int t = 0; t < count; ++t) {
      const float p = logits[first_token + t - token_start];
      const scalar_t* v =
          value_cache + (physical_block * BLOCK_SIZE + t) * token_stride + kv_head * HEAD_SIZE;
#pragma unroll
      for (int i = 0; i < DIMS_PER_LANE; ++i) {
        const int d = lane + i * WARP_SIZE;
        if (d < HEAD_SIZE) acc[i] += p * to_float(v[d]);
      }
    }
  }
  // Each warp has summed a different subset of the blocks: add them up.
#pragma unroll
  for (int i = 0; i < DIMS_PER_LANE; ++i) {
    const int d = lane + i * WARP_SIZE;
    if (d < HEAD_SIZE) out_smem[warp][d] = acc[i];
  }
  __syncthreads();
  const float inv_sum = 1.f / exp_sum;  // exp_sum >= 1: the max term is exp(0)
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float sum = 0.f;
    for (int w = 0; w < NUM_WARPS; ++w) sum += out_smem[w][d];
    out_row[d] = from_float<out_t>(sum * inv_sum);
  }
  if (PARTITION_SIZE > 0 && threadIdx.x == 0) {
    *max_logit = qk_max;
    *exp_sum_out = exp_sum;
  }
}

// Kernels -------------------------------------------------------------------

// v1. Dynamic shared memory: max_seq_len floats (rounded up to whole blocks).
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v1_kernel(
    scalar_t* __restrict__ out,                 // [num_seqs, num_heads, HEAD_SIZE]
    const scalar_t* __restrict__ query,         // [num_seqs, num_heads, HEAD_SIZE]
    const scalar_t* __restrict__ key_cache,     // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    const scalar_t* __restrict__ value_cache,   // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    const long long* __restrict__ block_tables, // [num_seqs, max_num_blocks_per_seq]
    const long long* __restrict__ seq_lens,     // [num_seqs]
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  paged_attention_partition<scalar_t, scalar_t, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, 0>(
      out + row * HEAD_SIZE, nullptr, nullptr, query, key_cache, value_cache, block_tables,
      seq_lens, num_kv_heads, max_num_blocks_per_seq, scale);
}

// v2, first pass: one partial result per partition, kept in float32.
// Dynamic shared memory: PARTITION_SIZE floats.
template <typename scalar_t, int HEAD_SIZE, int BLOCK_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_kernel(
    float* __restrict__ exp_sums,               // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ max_logits,             // [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ tmp_out,                // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    const scalar_t* __restrict__ query,         // [num_seqs, num_heads, HEAD_SIZE]
    const scalar_t* __restrict__ key_cache,     // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    const scalar_t* __restrict__ value_cache,   // [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    const long long* __restrict__ block_tables, // [num_seqs, max_num_blocks_per_seq]
    const long long* __restrict__ seq_lens,     // [num_seqs]
    const int num_kv_heads, const int max_num_blocks_per_seq, const float scale) {
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const long long part = row * gridDim.z + blockIdx.z;
  paged_attention_partition<scalar_t, float, HEAD_SIZE, BLOCK_SIZE, NUM_THREADS, PARTITION_SIZE>(
      tmp_out + part * HEAD_SIZE, max_logits + part, exp_sums + part, query, key_cache,
      value_cache, block_tables, seq_lens, num_kv_heads, max_num_blocks_per_seq, scale);
}

// v2, second pass: grid (num_heads, num_seqs). Partition p's output is
// normalised by its own exp-sum s_p taken relative to its own max m_p. With
// M the max over partitions, the true softmax weight of partition p is
// w_p = s_p * exp(m_p - M) / sum_q(s_q * exp(m_q - M)), and
// out = sum_p w_p * tmp_out_p. Dynamic shared memory: max_num_partitions floats.
template <typename scalar_t, int HEAD_SIZE, int NUM_THREADS, int PARTITION_SIZE>
__global__ void __launch_bounds__(NUM_THREADS) paged_attention_v2_reduce_kernel(
    scalar_t* __restrict__ out,                 // [num_seqs, num_heads, HEAD_SIZE]
    const float* __restrict__ exp_sums,         // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,       // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ tmp_out,          // [num_seqs, num_heads, max_num_partitions, HEAD_SIZE]
    const long long* __restrict__ seq_lens,     // [num_seqs]
    const int max_num_partitions) {
  constexpr int NUM_WARPS = NUM_THREADS / WARP_SIZE;
  const long long row = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int seq_len = static_cast<int>(seq_lens[blockIdx.y]);
  const int num_partitions = (seq_len + PARTITION_SIZE - 1) / PARTITION_SIZE;
  const float* part_max = max_logits + row * max_num_partitions;
  const float* part_sum = exp_sums + row * max_num_partitions;
  const float* part_out = tmp_out + row * max_num_partitions * HEAD_SIZE;

  __shared__ float red_smem[NUM_WARPS];
  extern __shared__ float weights[];  // [num_partitions]

  float global_max = neg_infinity();
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS)
    global_max = fmaxf(global_max, part_max[p]);
  global_max = block_reduce<NUM_WARPS, true>(global_max, red_smem);

  float total = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += NUM_THREADS) {
    const float w = part_sum[p] * expf(part_max[p] - global_max);
    weights[p] = w;
    total += w;
  }
  total = block_reduce<NUM_WARPS, false>(total, red_smem);  // also publishes weights[]

  const float inv_total = 1.f / total;
  for (int d = threadIdx.x; d < HEAD_SIZE; d += NUM_THREADS) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) acc += weights[p] * part_out[p * HEAD_SIZE + d];
    out[row * HEAD_SIZE + d] = from_float<scalar_t>(acc * inv_total);
  }
}
