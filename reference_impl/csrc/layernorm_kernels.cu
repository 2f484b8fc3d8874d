// layernorm_kernels.cu: RMSNorm, alone and fused with the residual add before it
// (vLLM's csrc/layernorm_kernels.cu does the same two jobs).
//
// Eagerly, PyTorch runs an RMSNorm as about seven kernels (square, mean, add eps,
// rsqrt, two multiplies, a cast), each a launch and a pass over the row. Here one
// warp owns one token's row: its 32 lanes read the row once to sum the squares,
// a butterfly of shuffles gives every lane the sum, and a second pass writes
// weight * (x * rsqrt(mean + eps)). A block of NUM_THREADS threads handles
// NUM_THREADS / 32 rows; grid = ceil(num_tokens / rows per block).
//
// Rounding follows the PyTorch reference (RMSNorm.forward_native): the sum of
// squares and the scaling in float32, the scaled row rounded to the activations'
// dtype, then multiplied by the weight and rounded again. Only the order of the
// sum differs, so results agree to a unit or so in the last place.
#include "dtypes.cuh"

// The sum of x over the 32 lanes of a warp, in every lane.
__device__ __forceinline__ float lane_sum(float x) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(FULL_MASK, x, offset);
  return x;
}

// out[row] = RMSNorm(x[row]); the row's 1 / rms is returned to every lane.
template <typename scalar_t>
__device__ void rms_norm_row(scalar_t* __restrict__ out, const scalar_t* __restrict__ x,
                             const scalar_t* __restrict__ weight, const float epsilon,
                             const int hidden_size, const int lane) {
  float sum_sq = 0.0f;
  for (int i = lane; i < hidden_size; i += WARP_SIZE) {
    const float v = to_float(x[i]);
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(lane_sum(sum_sq) / hidden_size + epsilon);
  for (int i = lane; i < hidden_size; i += WARP_SIZE) {
    const scalar_t scaled = from_float<scalar_t>(to_float(x[i]) * inv_rms);
    out[i] = from_float<scalar_t>(to_float(weight[i]) * to_float(scaled));
  }
}

// rms_norm: out = RMSNorm(input), row by row.
template <typename scalar_t>
__global__ void rms_norm_kernel(
    scalar_t* __restrict__ out,           // [num_tokens, hidden_size]
    const scalar_t* __restrict__ input,   // [num_tokens, hidden_size]
    const scalar_t* __restrict__ weight,  // [hidden_size]
    const float epsilon, const int num_tokens, const int hidden_size) {
  const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  if (row >= num_tokens) return;  // a whole warp leaves together
  const long long offset = static_cast<long long>(row) * hidden_size;
  rms_norm_row(out + offset, input + offset, weight, epsilon, hidden_size,
               threadIdx.x % WARP_SIZE);
}

// fused_add_rms_norm, in place as vLLM's: residual = input + residual (rounded
// to the dtype, as PyTorch's add), then input = RMSNorm(residual). Each lane
// reads back only the elements it wrote itself, so no barrier is needed between
// the add and the norm; the sum of squares reaches every lane by the shuffles.
template <typename scalar_t>
__global__ void fused_add_rms_norm_kernel(
    scalar_t* __restrict__ input,         // [num_tokens, hidden_size]: out, the norm
    scalar_t* __restrict__ residual,      // [num_tokens, hidden_size]: out, the sum
    const scalar_t* __restrict__ weight,  // [hidden_size]
    const float epsilon, const int num_tokens, const int hidden_size) {
  const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  if (row >= num_tokens) return;
  const int lane = threadIdx.x % WARP_SIZE;
  const long long offset = static_cast<long long>(row) * hidden_size;
  scalar_t* x = input + offset;
  scalar_t* r = residual + offset;
  for (int i = lane; i < hidden_size; i += WARP_SIZE)
    r[i] = from_float<scalar_t>(to_float(x[i]) + to_float(r[i]));
  rms_norm_row(x, r, weight, epsilon, hidden_size, lane);
}
