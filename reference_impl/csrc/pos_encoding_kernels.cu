// pos_encoding_kernels.cu: the rotary position embedding of q and k (vLLM's
// csrc/pos_encoding_kernels.cu), in the "neox" layout: dimension j of a head is
// paired with j + head_size / 2 and the pair is rotated by position * inv_freq[j].
//
// Eagerly, PyTorch runs it as a dozen kernels (two gathers of cos and sin, two
// casts, chunks, four multiplies, a subtract, an add, a concatenation) for q and
// again for k. Here one thread block rotates one token: every thread takes pairs
// (head, j) of q, then of k, reading cos and sin of the token's position once
// from the float32 caches. q and k are read through their row strides (they are
// views of the fused qkv projection) and written to new contiguous rows, which
// the attention kernels take as they are (vLLM rotates in place, and its
// attention then reads the strided rows).
//
// Rounding follows the PyTorch reference (RotaryEmbedding.forward_native): cos
// and sin rounded to the activations' dtype, each product and the sum rounded
// to it as PyTorch's elementwise operators do.
#include "dtypes.cuh"

template <typename scalar_t>
__device__ void rotate_heads(scalar_t* __restrict__ out,  // [num_heads * head_size], contiguous
                             const scalar_t* __restrict__ x, const float* __restrict__ cos_row,
                             const float* __restrict__ sin_row, const int num_heads,
                             const int head_size) {
  const int half = head_size / 2;
  for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
    const int head = i / half, j = i % half;
    const int first = head * head_size + j, second = first + half;
    const float c = to_float(from_float<scalar_t>(cos_row[j]));
    const float s = to_float(from_float<scalar_t>(sin_row[j]));
    const float x1 = to_float(x[first]), x2 = to_float(x[second]);
    const float x1c = to_float(from_float<scalar_t>(x1 * c));
    const float x2s = to_float(from_float<scalar_t>(x2 * s));
    const float x2c = to_float(from_float<scalar_t>(x2 * c));
    const float x1s = to_float(from_float<scalar_t>(x1 * s));
    out[first] = from_float<scalar_t>(x1c - x2s);
    out[second] = from_float<scalar_t>(x2c + x1s);
  }
}

// Grid: one thread block per token.
template <typename scalar_t>
__global__ void rotary_embedding_kernel(
    scalar_t* __restrict__ query_out,        // [num_tokens, num_heads * head_size]
    scalar_t* __restrict__ key_out,          // [num_tokens, num_kv_heads * head_size]
    const scalar_t* __restrict__ query,      // [num_tokens, num_heads * head_size], row stride query_stride
    const scalar_t* __restrict__ key,        // [num_tokens, num_kv_heads * head_size], row stride key_stride
    const long long* __restrict__ positions, // [num_tokens]
    const float* __restrict__ cos_cache,     // [max_position, head_size / 2]
    const float* __restrict__ sin_cache,     // [max_position, head_size / 2]
    const int query_stride, const int key_stride, const int num_heads, const int num_kv_heads,
    const int head_size) {
  const long long token = blockIdx.x;
  const long long pos = positions[token];
  const float* cos_row = cos_cache + pos * (head_size / 2);
  const float* sin_row = sin_cache + pos * (head_size / 2);
  rotate_heads(query_out + token * num_heads * head_size, query + token * query_stride, cos_row,
               sin_row, num_heads, head_size);
  rotate_heads(key_out + token * num_kv_heads * head_size, key + token * key_stride, cos_row,
               sin_row, num_kv_heads, head_size);
}
