// dtypes.cuh: the storage types the kernels read and write, and small helpers
// shared by paged_attention.cu and cache_kernels.cu.
//
// Every kernel computes in float32 and only *stores* in the cache's dtype.
// fp16 and bf16 are kept as raw 16-bit patterns converted with one PTX
// instruction each, so these sources need no CUDA headers: NVRTC (through
// CuPy, at run time) and nvcc (in CI) compile them exactly as they are.
// cvt.rn.bf16.f32 needs sm_80 or newer, which is what we target.
//
// The CPU emulator (minivllm/cuda_emu/) compiles these same sources with a host
// C++ compiler, which has no PTX: under MINIVLLM_CUDA_EMULATOR the three
// conversions below are written in plain C++ with the same rounding
// (round to nearest, ties to even).
#pragma once

struct fp16_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(bf16_t x) {
  // A bf16 is the upper half of a float32.
  return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);

template <>
__device__ __forceinline__ float from_float<float>(float f) {
  return f;
}

#ifndef MINIVLLM_CUDA_EMULATOR

__device__ __forceinline__ float to_float(fp16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <>
__device__ __forceinline__ fp16_t from_float<fp16_t>(float f) {
  fp16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  bf16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));
  return b;
}

#else  // the CPU emulator: the host compiler's _Float16, and bf16 by rounding bits

inline float to_float(fp16_t x) { return static_cast<float>(__builtin_bit_cast(_Float16, x.bits)); }

template <>
inline fp16_t from_float<fp16_t>(float f) {
  return {__builtin_bit_cast(unsigned short, static_cast<_Float16>(f))};
}

template <>
inline bf16_t from_float<bf16_t>(float f) {
  const unsigned int u = __builtin_bit_cast(unsigned int, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};  // NaN, as cvt.rn.bf16.f32 gives
  const unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);  // ties to even
  return {static_cast<unsigned short>((u + rounding) >> 16)};
}

#endif

// N consecutive elements loaded or stored as one aligned memory transaction.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

__device__ __forceinline__ float neg_infinity() { return __int_as_float(0xff800000); }

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;
