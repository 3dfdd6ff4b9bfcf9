// Thin wrappers over the sm_90a instructions the fused kernels use: mbarriers, TMA loads, wgmma,
// setmaxnreg. Every wait is bounded: past the bound it reports which wait stalled and traps, or
// (mbarrier_wait_or_record) records it and lets its caller leave.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/status.h"

namespace lynx::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier -------------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes the initialised barriers visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Scope of a wait's acquire: the CTA (default), or the cluster, to see what another CTA of the cluster
// released with its arrive.
enum class Scope { kCta, kCluster };

template <Scope kScope = Scope::kCta>
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  if constexpr (kScope == Scope::kCluster) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  }
  return done != 0;
}

// Which wait stalled, for the diagnostic of a bounded wait.
enum class Wait : int32_t {
  kFullStage = 1,
  kEmptyStage = 2,
  kUnitPosted = 3,
  kUnitTaken = 4,
  kRowsGathered = 5,  // producer: the rows of its tile's row block, copied by the gather warps (row_gather.cuh)
  kConsumersDone = 6,  // producer thread: every consumer thread finished its last tile (or left after a stall)
  kScheduleBlocks = 7, // schedule builder: every block at a grid barrier (kernels/schedule/schedule_kernel.cu)
  kPeerArrival = 8,    // cross-rank barrier: a peer rank's arrival (kernels/peer/barrier.cu)
};

// NOTES: an mbarrier wait gives up after 10 s of %globaltimer: far beyond any legitimate wait, short
// enough to turn a deadlock into an error, and longer than the gather's 5 s (kCounterWaitNs), so that
// a stalled gather is reported as itself and not as the consumers' wait behind it. It was 2^22
// try_wait rounds, whose time is the hardware's suspend time: ~17 s on the H200 for the consumers,
// 1.3 s once for a producer whose consumers had left (2026-11-29, commit 04d40f6), so the order of the two bounds
// was not guaranteed.
constexpr uint64_t kMbarrierWaitNs = 10'000'000'000ull;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// How long a thread that lost the race to report a stall waits before its own trap, so that the
// winner's report lands before a trap ends the grid (many threads of a stalled CTA reach the bound
// together).
constexpr uint64_t kReportGraceNs = 10'000'000;

// Records the stalled wait in `report` (host-mapped memory, so it survives the trap that kills the
// context) unless another thread has recorded one: true when this thread's record is the report.
__device__ __forceinline__ bool record_stall(DeviceStatus* report, Wait which, int32_t task, int64_t value) {
  if (!report || atomicCAS(&report->code, int32_t(StatusCode::kOk), int32_t(StatusCode::kWaitTimeout)) !=
                     int32_t(StatusCode::kOk)) {
    return false;
  }
  report->rank = static_cast<int32_t>(blockIdx.x);
  report->a = int64_t(which);
  report->b = task;
  report->c = value;
  __threadfence_system();
  return true;
}

// Records the stalled wait and traps. Inlined and call-free: a call inside the wgmma mainloop would
// serialise wgmma.
// NOTES: the code is claimed before the fields are written, so a thread that loses the claim and
// trapped at once could end the grid before the winner's fields reach the host: the report would
// name no wait. The losers wait kReportGraceNs first.
__device__ __forceinline__ void report_stall(DeviceStatus* report, Wait which, int32_t task, int64_t value) {
  if (!record_stall(report, which, task, value) && report) {
    const uint64_t start = globaltimer_ns();
    while (globaltimer_ns() - start < kReportGraceNs) __nanosleep(1 << 16);
  }
  __trap();
}

// A wait on `bar` of at most `bound_ns` of %globaltimer: true once the phase completed.
template <Scope kScope>
__device__ __forceinline__ bool mbarrier_wait_bounded(uint64_t* bar, uint32_t parity, uint64_t bound_ns) {
  if (mbarrier_try_wait<kScope>(bar, parity)) return true;
  const uint64_t start = globaltimer_ns();
  while (!mbarrier_try_wait<kScope>(bar, parity)) {
    if (globaltimer_ns() - start > bound_ns) return false;
  }
  return true;
}

// A bounded wait on `bar`: past the bound it reports the stall and traps.
template <Scope kScope = Scope::kCta>
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity, DeviceStatus* report, Wait which,
                                              int32_t task, uint64_t bound_ns = kMbarrierWaitNs) {
  if (!mbarrier_wait_bounded<kScope>(bar, parity, bound_ns)) report_stall(report, which, task, parity);
}

// A bounded wait on `bar` that never traps, so that the code around it can leave: false, with the
// stall recorded (record_stall), past the bound.
__device__ __forceinline__ bool mbarrier_wait_or_record(uint64_t* bar, uint32_t parity, DeviceStatus* report,
                                                        Wait which, int32_t task) {
  if (mbarrier_wait_bounded<Scope::kCta>(bar, parity, kMbarrierWaitNs)) return true;
  record_stall(report, which, task, parity);
  return false;
}

// ---- global-memory counters (bounded by time: the gather's waits poll device memory) ----------------

__device__ __forceinline__ int32_t ld_acquire(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_relaxed(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Adds `v`, releasing this thread's earlier writes (and, cumulatively, those ordered before them).
__device__ __forceinline__ void red_release_add(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_relaxed_max(int32_t* p, int32_t v) {
  asm volatile("red.relaxed.gpu.global.max.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Orders this thread's generic-proxy accesses to global memory with its async-proxy (TMA) ones; used on
// both sides of a hand-off from generic writes on one SM to TMA reads on another (row_gather.cuh).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// NOTES: 5 s: a row block is copied in microseconds; compute-sanitizer slows the copies and the wait
// alike. Shorter than the mbarrier waits' bound (kMbarrierWaitNs, 10 s), so that a stalled gather is
// reported as such and not as the consumers' wait behind it.
constexpr uint64_t kCounterWaitNs = 5'000'000'000ull;
static_assert(kCounterWaitNs < kMbarrierWaitNs, "a stalled gather must be reported before the waits behind it");

// Polls until *p >= target (an acquire load when kAcquire), sleeping `sleep_ns` between polls, for at
// most `give_up_ns`: true when it got there. `seen`: the value last read.
template <bool kAcquire>
__device__ __forceinline__ bool poll_counter(const int32_t* p, int32_t target, uint32_t sleep_ns, uint64_t give_up_ns,
                                             int32_t& seen) {
  seen = kAcquire ? ld_acquire(p) : ld_relaxed(p);
  if (seen >= target) return true;
  const uint64_t start = globaltimer_ns();
  for (;;) {
    __nanosleep(sleep_ns);
    seen = kAcquire ? ld_acquire(p) : ld_relaxed(p);
    if (seen >= target) return true;
    if (globaltimer_ns() - start > give_up_ns) return false;
  }
}

// A bounded wait until *p >= target, with acquire: past kCounterWaitNs it reports `which` with the
// value last seen and traps.
__device__ __forceinline__ void wait_counter(const int32_t* p, int32_t target, uint32_t sleep_ns, DeviceStatus* report,
                                             Wait which, int32_t task) {
  int32_t seen;
  if (!poll_counter<true>(p, target, sleep_ns, kCounterWaitNs, seen)) report_stall(report, which, task, seen);
}

// ---- thread-block clusters -------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The address of the same shared-memory location in CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t peer_addr(const void* p, uint32_t rank) {
  uint32_t a;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_addr(p)), "r"(rank));
  return a;
}

// Arrives on the mbarrier at `cluster_addr` (peer_addr) with the default semantics, release at CTA
// scope. NOTES: used to hand a stage back to the other CTA, which then overwrites it with TMA. What
// makes that safe is not the arrive's ordering (a CTA-scope release and the other CTA's CTA-scope
// acquire are not a formal synchronizes-with in the PTX model) but that the stage's reads are already
// complete when the thread arrives: they are wgmma reads, waited on by wgmma.wait_group; CUTLASS's
// cluster pipelines make the same assumption. So no generic-proxy read of stage memory may come
// between the wait and this arrive. `.release.cluster` compiles to a MEMBAR.ALL.GPU before the
// arrive, which in the GEMM's per-stage release cost ~40% of its speed.
__device__ __forceinline__ void mbarrier_arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}

// Arrives on the mbarrier at `bar` in CTA `rank` of the cluster, releasing this thread's earlier
// accesses (e.g. st_peer) at cluster scope: for rare hand-offs, not per stage (see above).
__device__ __forceinline__ void mbarrier_arrive_peer(uint64_t* bar, uint32_t rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_addr(bar, rank)) : "memory");
}

__device__ __forceinline__ void st_peer(int32_t* p, uint32_t rank, int32_t v) {
  asm volatile("st.shared::cluster.s32 [%0], %1;" ::"r"(peer_addr(p, rank)), "r"(v) : "memory");
}

// Every thread of every CTA in the cluster: arrive (release) and wait (acquire). Not `.aligned`, so
// threads of a warp may reach it apart.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// ---- TMA ------------------------------------------------------------------------------------------

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0, int32_t c1,
                                            int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// As tma_load_2d / tma_load_3d, written to the same shared-memory offset in every CTA of `cta_mask`
// (bit i: cluster rank i), each CTA's mbarrier at `bar`'s offset receiving the bytes.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                                                      int32_t c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                                                      int32_t c1, int32_t c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4, %5}], [%2], %6;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// Loads from shared memory by its own address space (a pointer the compiler cannot place, e.g. one
// aligned by integer arithmetic, would otherwise take a generic load), ordered with the other asm.
__device__ __forceinline__ float ld_shared(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)));
  return v;
}
__device__ __forceinline__ float2 ld_shared_x2(const float* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(smem_addr(p)));
  return v;
}

// A store at a shared-memory address (smem_addr): 32-bit addresses, where generic pointers into
// a dynamic shared-memory struct are 64-bit registers that ptxas may keep live across a whole kernel.
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}

// `bytes` contiguous bytes from global to shared memory, completing on `bar` as the tensor loads do
// (bytes a multiple of 16; both addresses 16-byte aligned).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Stores of a [box] tile from shared memory, tracked by bulk groups (commit / wait below).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int32_t c0, int32_t c1,
                                             int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N committed store groups are still reading their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Waits until at most N committed store groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices into shared memory: lane t gives the address of row t % 8 of matrix t / 8,
// and register i holds the lane's two values of matrix i (row t / 4, columns 2(t % 4) + {0, 1}).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// stmatrix_x4 transposed: matrix i's element (row t / 4, column 2(t % 4) + e) of lane t lands in row
// 2(t % 4) + e, column t / 4 of the stored matrix, whose row t % 8 lane t addresses (matrix t / 8).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Two 8x8 b16 matrices, transposed as in stmatrix_x4_trans: lanes 0-15 give the row addresses.
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (TMA) reads.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Synchronises the `threads` threads that use named barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` without waiting: the other threads of its `threads` wait there in bar.sync.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void prefetch_tma_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// ---- wgmma ----------------------------------------------------------------------------------------

// Shared-memory matrix descriptor of a K-major tile whose rows are 128 bytes, stored with the 128-byte
// swizzle in 8-row (1024-byte) atoms: stride between atoms 1024 bytes, leading offset unused.
__device__ __forceinline__ uint64_t smem_desc_k_major_sw128(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// The descriptor of the operand `bytes` (a multiple of 16) past `desc`'s. Exact while the address stays
// below 256 KB, as every shared-memory address of a CTA does (at most 227 KB): the start-address field
// is the address's bits 4-17, the descriptor's lowest, so adding to the descriptor cannot carry out of it.
__device__ __forceinline__ uint64_t smem_desc_offset(uint64_t desc, int bytes) {
  return desc + uint64_t(uint32_t(bytes) >> 4);
}

// Shared-memory matrix descriptor of an MN-major tile stored as [K rows][64 MN] boxes of 128-byte rows
// (TMA boxes of 64 × 64 bf16, 8 KB each, 128-byte swizzle): 8 K rows make a 1024-byte atom (stride
// between atoms along K), consecutive 64-wide MN chunks are one box (8192 bytes) apart.
__device__ __forceinline__ uint64_t smem_desc_mn_major_sw128(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(8192 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins registers d here: the compiler sees them written, so their reads stay after a wgmma_wait before
// this (otherwise nothing orders a read of a wgmma's result after the wait that completes it).
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]));
}

// acc[64, 256] (+)= A[64, 16] · B[256, 16]ᵀ, bf16 operands from shared memory, fp32 accumulators.
// `accumulate` = false overwrites acc. Fragment of thread t (warp w = t/32, lane l): acc[4j + r]
// holds row 16w + l/4 + 8(r/2), column 8j + 2(l%4) + r%2, j in [0, 32).
// kTransA / kTransB: the operand is MN-major in shared memory (see smem_desc_mn_major_sw128).
template <bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(int32_t(accumulate)), "n"(int32_t(kTransA)), "n"(int32_t(kTransB)));
}

// A 64-float accumulator fragment d[0 .. 63] (an m64n128 wgmma's) as asm operands %0 .. %63: the
// placeholders and the read-write operands, for the wgmma wrappers that take one.
#define LYNX_WGMMA_ACC64_REGS                                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "      \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, "  \
  "%43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define LYNX_WGMMA_ACC64(d)                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),    \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),   \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),   \
      "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),   \
      "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),   \
      "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),   \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// acc[64, 128] (+)= A[64, 32] · B[128, 32]ᵀ, E4M3 operands from shared memory, both K-major (FP8 wgmma
// has no transposed form), fp32 accumulators. Fragment as wgmma_m64n256k16's, j in [0, 16).
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      LYNX_WGMMA_ACC64_REGS ", %64, %65, p, 1, 1;\n}\n"
      : LYNX_WGMMA_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(int32_t(accumulate)));
}

// d[64, 16] (+)= A[64, 16] · B[16, 16]ᵀ, as wgmma_m64n256k16 with N = 16, into d[0 .. 7] (a slice of a
// larger accumulator array): d[4j + r] holds row 16w + l/4 + 8(r/2), column 8j + 2(l%4) + r%2, j in [0, 2).
template <bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n16k16(float* d, uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(int32_t(accumulate)), "n"(int32_t(kTransA)), "n"(int32_t(kTransB)));
}

// d[64, 8] (+)= A[64, 16] · B[8, 16]ᵀ, as wgmma_m64n256k16 with N = 8, into d[0 .. 3]: d[r] holds row
// 16w + l/4 + 8(r/2), column 2(l%4) + r%2.
template <bool kTransA = false, bool kTransB = false>
__device__ __forceinline__ void wgmma_m64n8k16(float* d, uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, %8;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(desc_a), "l"(desc_b), "r"(int32_t(accumulate)), "n"(int32_t(kTransA)), "n"(int32_t(kTransB)));
}

// ---- register reallocation between warpgroups ------------------------------------------------------

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace lynx::sm90
