// cuda_emu.h: just enough of CUDA to run the kernels of reference_impl/csrc on
// a CPU, so that machines without a GPU still *execute* the real sources.
//
// minivllm/cuda_emu/__init__.py force-includes this header in front of a .cu
// file and compiles the result with the host C++ compiler. Then:
//
// - every CUDA thread of a thread block is a fiber (ucontext) with its own
//   stack; the fibers of one block take turns on one OS thread, and thread
//   blocks run one after another in blockIdx order (x fastest);
// - __syncthreads() parks the calling fiber; when every thread of the block
//   is parked there, all resume. __shfl_xor_sync does the same per warp:
//   each lane posts its value, the warp meets, each reads its partner's.
//   A barrier or shuffle that not every thread reaches (divergent control
//   flow, undefined on a GPU) is reported instead of deadlocking;
// - __shared__ arrays become function statics, which all fibers of a block
//   share; dynamic shared memory (extern __shared__) is a buffer of the
//   launch's size, filled with NaN before each block and followed by a NaN
//   canary that must still be intact when the block ends;
// - between barriers the fibers run in an order set by a seed (0: thread
//   0 first; else a fresh shuffle each round), so a kernel whose result
//   depends on that order has a race between its barriers.
//
// What this cannot show: anything about speed, memory coalescing, or the
// GPU's memory model. It checks the algorithm, the indexing and the
// launcher's arguments, not the hardware.
#pragma once
#define MINIVLLM_CUDA_EMULATOR 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <math.h>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

using std::max;
using std::min;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline float __int_as_float(int i) { return __builtin_bit_cast(float, i); }
inline float __uint_as_float(unsigned u) { return __builtin_bit_cast(float, u); }
// CUDA's reciprocal square root: on a GPU an approximation within 2 units in
// the last place, here 1 / sqrt in two correctly rounded steps. Named apart
// because glibc 2.42 declares an rsqrtf of its own.
inline float emu_rsqrtf(float x) { return 1.0f / sqrtf(x); }
#define rsqrtf emu_rsqrtf

namespace emu {

constexpr int kWarpSize = 32;
constexpr std::size_t kStackBytes = 256 * 1024;
constexpr std::size_t kCanaryBytes = 4096;

enum class State { Runnable, AtSyncthreads, AtShuffle, Done };

struct Thread {
  ucontext_t context;
  dim3 idx;
  State state = State::Done;
  std::vector<char> stack;
};

// The thread block being run, and the launch it belongs to.
struct Launch {
  dim3 grid, block, block_idx;
  std::vector<Thread> threads;
  int current = 0;  // the fiber now running
  ucontext_t scheduler;
  std::function<void()> body;      // one CUDA thread's work: the kernel call
  std::vector<float> shuffle;      // [block threads]: values posted for a shuffle
  std::vector<unsigned char> smem; // dynamic shared memory, then the canary
  std::size_t smem_bytes = 0;
  std::string error;
};

inline Launch& launch_state() {
  static Launch launch;
  return launch;
}

inline Thread& current_thread() {
  Launch& l = launch_state();
  return l.threads[l.current];
}

// Park the running fiber in `state` and return to the scheduler.
inline void park(State state) {
  Thread& t = current_thread();
  t.state = state;
  swapcontext(&t.context, &launch_state().scheduler);
}

// Record the first error of the launch; the fiber never runs again.
[[noreturn]] inline void fail(const std::string& message) {
  Launch& l = launch_state();
  if (l.error.empty()) l.error = message;
  park(State::Done);
  __builtin_unreachable();
}

inline void fiber_entry() {
  launch_state().body();
  current_thread().state = State::Done;
  // returning resumes uc_link: the scheduler
}

inline void* dynamic_smem() { return launch_state().smem.data(); }

inline std::string where(const Launch& l) {
  return "block (" + std::to_string(l.block_idx.x) + ", " + std::to_string(l.block_idx.y) + ", " +
         std::to_string(l.block_idx.z) + ")";
}

// After a round in which every fiber ran until it parked or finished: wake
// the fibers whose barrier is complete. False when none can be woken.
inline bool release_barriers(Launch& l) {
  const int n = static_cast<int>(l.threads.size());
  bool woke = false;
  for (int w = 0; w < n / kWarpSize; ++w) {
    const auto lane = l.threads.begin() + w * kWarpSize;
    if (std::all_of(lane, lane + kWarpSize, [](const Thread& t) { return t.state == State::AtShuffle; })) {
      for (auto t = lane; t != lane + kWarpSize; ++t) t->state = State::Runnable;
      woke = true;
    }
  }
  if (woke) return true;
  const auto count = [&](State s) {
    return std::count_if(l.threads.begin(), l.threads.end(), [s](const Thread& t) { return t.state == s; });
  };
  if (count(State::AtSyncthreads) == n) {
    for (Thread& t : l.threads) t.state = State::Runnable;
    return true;
  }
  if (count(State::Done) == n) return false;
  if (l.error.empty()) {
    l.error = where(l) + ": divergent barrier: " + std::to_string(count(State::AtSyncthreads)) +
              " threads wait in __syncthreads, " + std::to_string(count(State::AtShuffle)) +
              " in __shfl_xor_sync (whose warp is incomplete), " +
              std::to_string(count(State::Done)) + " have returned";
  }
  return false;
}

inline void run_block(unsigned seed) {
  Launch& l = launch_state();
  const int n = static_cast<int>(l.threads.size());
  std::memset(l.smem.data(), 0xff, l.smem.size());  // all-ones bits: a float NaN
  for (int i = 0; i < n; ++i) {
    Thread& t = l.threads[i];
    t.idx = {static_cast<unsigned>(i), 0, 0};
    t.state = State::Runnable;
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack.data();
    t.context.uc_stack.ss_size = t.stack.size();
    t.context.uc_link = &l.scheduler;
    makecontext(&t.context, fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  std::mt19937 rng(seed);
  do {
    if (seed != 0) std::shuffle(order.begin(), order.end(), rng);
    for (int i : order) {
      if (l.threads[i].state != State::Runnable) continue;
      l.current = i;
      swapcontext(&l.scheduler, &l.threads[i].context);
      if (!l.error.empty()) return;
    }
  } while (release_barriers(l));
  for (std::size_t i = l.smem_bytes; i < l.smem.size(); ++i) {
    if (l.smem[i] != 0xff) {
      l.error = where(l) + ": wrote past the " + std::to_string(l.smem_bytes) +
                " bytes of dynamic shared memory it was launched with";
      return;
    }
  }
}

// One kernel parameter as the launcher must pass it.
struct ArgInfo {
  int size;            // bytes of the parameter
  int is_pointer;
  int is_integral;     // of the parameter, or of what it points to
  int is_floating;     // likewise (fp16_t / bf16_t count as floating)
  int pointee_size;    // bytes per element behind a pointer, else 0
};

template <typename T>
constexpr bool floating_v = std::is_floating_point_v<T> || (sizeof(T) == 2 && std::is_class_v<T>);

template <typename P>
ArgInfo describe() {
  if constexpr (std::is_pointer_v<P>) {
    using T = std::remove_cv_t<std::remove_pointer_t<P>>;
    return {sizeof(P), 1, std::is_integral_v<T>, floating_v<T>, static_cast<int>(sizeof(T))};
  } else {
    return {sizeof(P), 0, std::is_integral_v<P>, floating_v<P>, 0};
  }
}

template <typename... Args>
int signature(void (*)(Args...), ArgInfo* out) {
  int i = 0;
  ((out[i++] = describe<Args>()), ...);
  return static_cast<int>(sizeof...(Args));
}

// Run `kernel` over the grid. args[i] points at the value of parameter i, as
// for cuLaunchKernel. Returns 0, or 1 with the reason in launch_state().error.
template <typename... Args, std::size_t... I>
int launch(void (*kernel)(Args...), const unsigned* grid, const unsigned* block, std::size_t smem_bytes,
           void** args, unsigned seed, std::index_sequence<I...>) {
  Launch& l = launch_state();
  l.error.clear();
  l.grid = {grid[0], grid[1], grid[2]};
  l.block = {block[0], block[1], block[2]};
  if (l.block.y != 1 || l.block.z != 1 || l.block.x % kWarpSize != 0) {
    l.error = "the emulator runs 1-D thread blocks of whole warps only";
    return 1;
  }
  l.threads.resize(l.block.x);
  for (Thread& t : l.threads) t.stack.resize(kStackBytes);
  l.shuffle.assign(l.block.x, 0.f);
  l.smem_bytes = smem_bytes;
  l.smem.assign(smem_bytes + kCanaryBytes, 0xff);
  l.body = [&] { kernel(*static_cast<std::remove_cv_t<Args>*>(args[I])...); };
  for (unsigned z = 0; z < l.grid.z; ++z)
    for (unsigned y = 0; y < l.grid.y; ++y)
      for (unsigned x = 0; x < l.grid.x; ++x) {
        l.block_idx = {x, y, z};
        run_block(seed);
        if (!l.error.empty()) return 1;
      }
  return 0;
}

template <typename... Args>
int launch(void (*kernel)(Args...), const unsigned* grid, const unsigned* block, std::size_t smem_bytes,
           void** args, unsigned seed) {
  return launch(kernel, grid, block, smem_bytes, args, seed, std::index_sequence_for<Args...>{});
}

}  // namespace emu

#define threadIdx (emu::current_thread().idx)
#define blockIdx (emu::launch_state().block_idx)
#define blockDim (emu::launch_state().block)
#define gridDim (emu::launch_state().grid)

inline void __syncthreads() { emu::park(emu::State::AtSyncthreads); }

// The lanes of a warp exchange 32-bit floats: post, meet, read the partner's
// value, meet again (so that the next shuffle cannot overwrite it early).
inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  if (mask != 0xffffffffu) emu::fail("__shfl_xor_sync: only full-warp masks are emulated");
  emu::Launch& l = emu::launch_state();
  const int tid = l.current;
  const int partner = (tid / emu::kWarpSize) * emu::kWarpSize + ((tid % emu::kWarpSize) ^ lane_mask);
  l.shuffle[tid] = value;
  emu::park(emu::State::AtShuffle);
  const float result = l.shuffle[partner];
  emu::park(emu::State::AtShuffle);
  return result;
}

extern "C" const char* emu_error() { return emu::launch_state().error.c_str(); }
