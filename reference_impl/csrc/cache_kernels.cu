// cache_kernels.cu: the kernels that move K/V into and within the paged cache.
//
// The layout is the contract of reference_impl/minivllm/attention/kv_cache.py:
// per layer kv_cache[2][num_blocks][block_size][num_kv_heads][head_size]. A
// slot s (= block * block_size + offset) is therefore one contiguous row of
// num_kv_heads * head_size elements starting at element s * row_size of the
// key half (kv_cache[0]) or the value half (kv_cache[1]).
//
// Swapping blocks between the GPU and the CPU needs no kernel: it is a plain
// device <-> host copy (minivllm/worker/cache_engine.py).
#include "dtypes.cuh"

// reshape_and_cache: store this step's new K and V at their slots.
// Grid: one thread block per token. A negative slot marks a padding token
// (nothing to store). The PyTorch twin is write_to_kv_cache in kv_cache.py.
template <typename scalar_t>
__global__ void reshape_and_cache_kernel(
    const scalar_t* __restrict__ key,           // [num_tokens, num_kv_heads, head_size], row stride key_stride
    const scalar_t* __restrict__ value,         // [num_tokens, num_kv_heads, head_size], row stride value_stride
    scalar_t* __restrict__ key_cache,           // [num_blocks, block_size, num_kv_heads, head_size]
    scalar_t* __restrict__ value_cache,         // [num_blocks, block_size, num_kv_heads, head_size]
    const long long* __restrict__ slot_mapping, // [num_tokens]
    const int key_stride, const int value_stride,
    const int row_size) {                       // num_kv_heads * head_size
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;
  const scalar_t* k = key + token * key_stride;
  const scalar_t* v = value + token * value_stride;
  scalar_t* k_dst = key_cache + slot * row_size;
  scalar_t* v_dst = value_cache + slot * row_size;
  for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
    k_dst[i] = k[i];
    v_dst[i] = v[i];
  }
}

// copy_blocks: copy-on-write. For every layer and every (src, dst) pair, copy
// block src onto block dst in both the key and the value half.
// Grid: (num_layers, num_pairs). One launch serves all layers, so the layers'
// cache tensors are passed as an array of their addresses.
template <typename scalar_t>
__global__ void copy_blocks_kernel(
    const long long* __restrict__ layer_caches,  // [num_layers]: address of each kv_cache
    const long long* __restrict__ block_mapping, // [num_pairs, 2]: (src, dst)
    const long long num_blocks,                  // blocks per layer (the pool size)
    const int block_numel) {                     // block_size * num_kv_heads * head_size
  scalar_t* cache = reinterpret_cast<scalar_t*>(layer_caches[blockIdx.x]);
  const long long src = block_mapping[2 * blockIdx.y];
  const long long dst = block_mapping[2 * blockIdx.y + 1];
  for (int half = 0; half < 2; ++half) {  // 0: keys, 1: values
    scalar_t* base = cache + half * num_blocks * block_numel;
    for (int i = threadIdx.x; i < block_numel; i += blockDim.x)
      base[dst * block_numel + i] = base[src * block_numel + i];
  }
}
