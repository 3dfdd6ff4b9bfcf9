// Every access a kernel makes to another rank's memory (R > 1) goes through these: the gathers' and
// combines' row reads, the SwiGLU backward's weight reads, the schedule's slot_row stores and the
// barriers' signals. On one GPU, over NVLink peer access and through CUDA IPC they are plain accesses; a
// transport whose ranks are not load/store-reachable (NVSHMEM, NCCL's device API) would replace them
// here (docs/expert-parallel.md).
#pragma once

#include <cstdint>

namespace lynx::remote {

template <class T>
__device__ __forceinline__ T load(const T* p) {
  return *p;
}

// The same, through the read-only data cache: for a buffer no rank writes while the kernel runs (the
// token rows the GEMM's gather pulls, written before the barrier that precedes the kernel).
template <class T>
__device__ __forceinline__ T load_nc(const T* p) {
  return __ldg(p);
}

template <class T>
__device__ __forceinline__ void store(T* p, const T& v) {
  *p = v;
}

// Adds `v` to a signal word, releasing this thread's earlier writes to every rank (system scope).
__device__ __forceinline__ void signal_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Reads a signal word with acquire at system scope.
__device__ __forceinline__ uint32_t signal_load(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace lynx::remote
