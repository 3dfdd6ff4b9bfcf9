// lynx-fp8-mainloop: what the tensor cores give to each way of issuing the FP8 GEMM's block-scaled
// products, apart from everything else the kernel does. One CTA per SM runs a K-block loop over the
// wide forms' [128, 256] tile (two consumer warpgroups of 64 rows, two 128-column halves, K blocks of
// 128, four stages), the products' values irrelevant (zeros), and reports the tensor rate it reached in
// FLOP per SM clock, so that the power cap's clock swings do not enter (docs/fp8.md says what was
// measured and why).
//
// Loops (Loop): as the wide forms issue them (each half's group waited for, then promoted into its
// accumulator, the two warpgroups issuing independently); with the two warpgroups issuing in turns (as
// the kernel did before 8ca5e11), and so with A read into registers once a K block, and with the row and
// block scales loaded from global memory each K block as the kernel does; [128, 128] tiles with two temporaries (a block's group issued before the one before it is
// promoted, in pairs); with no promotion (both halves straight into accumulators: the issue's ceiling), also
// as one m64n256k32 a k step; and bf16's [128, 256] × 64 products for comparison. Feeds (Feed): how a stage's operands arrive: 16 bytes (the
// loop and its barriers alone), 48 KB from an L2-resident buffer or from DRAM, the L2 one in clusters of
// two CTAs that share B (each loads its A and multicasts half of B into both: 32 KB an SM a stage), or B
// from L2 with A's 128 rows gathered by three warps (16-byte loads and shared-memory stores).
// NOTES: a loop that promotes keeps one accumulator (both halves promoted into it: the same
// instructions, 64 registers fewer), where the kernel keeps one a half: with three 64-register arrays
// ptxas spilled here, the kernel's register budget being shared with its other code.
//   usage: lynx-fp8-mainloop [--k-blocks N] [--rounds N]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/status.h"
#include "device/sm90.cuh"

namespace {

using namespace lynx;

constexpr int kStages = 4;
constexpr int kStageA = 128 * 128;  // [128 rows, 128 bytes of K]: E4M3 K = 128, bf16 K = 64
constexpr int kStageB = 256 * 128;  // [256 columns, 128 bytes of K]
constexpr int kThreads = 384;       // the producer warpgroup, then two consumer warpgroups
constexpr int kScaleBlocks = 64;    // the scale arrays' K blocks (taken modulo)
constexpr int kTurnBarrier = 3;     // named barriers 3 and 4, as the kernel's turns were (until 8ca5e11)

enum class Loop { kPromoteTurns, kPromote, kRegsA, kScales, kPipelined128, kNoPromote, kNoPromote256, kBf16 };
enum class Feed { kNone, kL2, kL2Pairs, kDram, kGather };
// kL2Pairs: clusters of two CTAs that share B (the same source stage), each loading its own A and half
// of B into both CTAs' shared memory (bulk copy multicast): 32 KB from L2 a stage an SM, not 48.
template <Feed kFeed>
constexpr bool kPairs = kFeed == Feed::kL2Pairs;

struct Smem {
  alignas(1024) uint8_t a[kStages][kStageA];
  alignas(1024) uint8_t b[kStages][kStageB];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
static_assert(sizeof(Smem) + 1024 <= 227 * 1024, "shared memory");

struct Args {
  const uint8_t* src;        // source stages, [src_stages][kStageA + kStageB]
  int64_t src_stages;
  const int32_t* rows;       // kGather: the source row of each gathered row, [row_mask + 1]
  uint32_t row_mask;         // a power of two less one
  const float* scales_a;     // kScales: [gridDim.x * 128 rows, kScaleBlocks]
  const float* scales_b;     // kScales: [kScaleBlocks]
  int32_t k_blocks;
  long long* cycles;         // [gridDim.x]: the consumers' clocks from start to end
  float* sink;               // never written in practice: keeps the accumulators alive
  DeviceStatus* status;      // host-mapped: a stalled wait's report
};

// acc[64, 128] (+)= A · Bᵀ with A's [64, 32] E4M3 fragment in registers (a warp's 16 rows: a0 rows
// 0-7 and a1 rows 8-15 of bytes 4(l%4).., a2 and a3 the same 16 bytes on) and B from shared memory.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                         bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      LYNX_WGMMA_ACC64_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : LYNX_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int32_t(accumulate)));
}

// acc[64, 256] (+)= A[64, 32] · B[256, 32]ᵀ, E4M3 from shared memory (the widest FP8 wgmma: A read once
// for 256 columns).
__device__ __forceinline__ void wgmma_m64n256k32_e4m3(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// `bytes` from global memory into the same shared-memory offset of both CTAs of the pair, each CTA's
// mbarrier at `bar`'s offset receiving them.
__device__ __forceinline__ void bulk_load_both(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::
          "r"(sm90::smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(sm90::smem_addr(bar)), "h"(uint16_t(0b11))
      : "memory");
}

template <Feed kFeed>
constexpr uint32_t kFullArrivals = kFeed == Feed::kGather ? 4 : 1;  // the producer thread (and 3 gather warps)

// ---- producer warpgroup: thread 0 loads (bulk copies), warps 1-3 gather A (kGather) ----
template <Feed kFeed>
__device__ __forceinline__ void produce(Smem& s, const Args& p) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const bool gather = kFeed == Feed::kGather && warp > 0;
  if (threadIdx.x != 0 && !gather) return;
  for (int32_t it = 0; it < p.k_blocks; ++it) {
    const int st = it % kStages;
    if (it >= kStages) {
      sm90::mbarrier_wait(&s.empty[st], uint32_t(it / kStages + 1) & 1, p.status, sm90::Wait::kEmptyStage, it);
    }
    const int64_t k = (int64_t(blockIdx.x) * 7919 + it) % p.src_stages;
    const uint8_t* stage = p.src + k * (kStageA + kStageB);
    if constexpr (kPairs<kFeed>) {  // A from this CTA's stage, B's half `rank` of the pair's into both
      const uint32_t rank = sm90::cluster_rank();
      const int64_t shared_k = (int64_t(blockIdx.x / 2) * 7919 + it) % p.src_stages;
      sm90::mbarrier_arrive_expect_tx(&s.full[st], kStageA + kStageB);
      sm90::bulk_load(s.a[st], stage, kStageA, &s.full[st]);
      bulk_load_both(s.b[st] + rank * (kStageB / 2), p.src + shared_k * (kStageA + kStageB) + kStageA + rank * (kStageB / 2),
                     kStageB / 2, &s.full[st]);
      continue;
    }
    if (gather) {
      // A's 128 rows of 128 bytes from random rows of the source, 16-byte chunk c of row r at chunk
      // c ^ (r % 8) (the 128-byte swizzle the wgmma descriptors read).
      // Four 16-byte loads in flight a lane, as the kernel's gather (kFp8GatherVecsPerLane).
#pragma unroll 1
      for (int first = (warp - 1) * 32 + lane; first < 128 * 8; first += 4 * 96) {
        uint4 x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = first + 96 * j, r = v / 8, c = v % 8;
          const int32_t from = v < 128 * 8 ? p.rows[(blockIdx.x * 131u + uint32_t(it) * 128u + uint32_t(r)) & p.row_mask] : 0;
          if (v < 128 * 8) x[j] = *reinterpret_cast<const uint4*>(p.src + uint32_t(from) * 128u + uint32_t(c) * 16u);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = first + 96 * j, r = v / 8, c = v % 8;
          if (v < 128 * 8) *reinterpret_cast<uint4*>(&s.a[st][r * 128 + ((c ^ (r % 8)) * 16)]) = x[j];
        }
      }
      sm90::fence_proxy_async_shared();
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(&s.full[st]);
      continue;
    }
    const uint32_t bytes_a = kFeed == Feed::kNone ? 16 : kFeed == Feed::kGather ? 0 : kStageA;
    const uint32_t bytes_b = kFeed == Feed::kNone ? 16 : kStageB;
    sm90::mbarrier_arrive_expect_tx(&s.full[st], bytes_a + bytes_b);
    if (bytes_a > 0) sm90::bulk_load(s.a[st], stage, bytes_a, &s.full[st]);
    sm90::bulk_load(s.b[st], stage + kStageA, bytes_b, &s.full[st]);
  }
}

// ---- consumer warpgroups: warpgroup c's rows [64c, 64c + 64) of the tile ----
template <Loop kLoop, Feed kFeed>
__device__ __forceinline__ void consume(Smem& s, const Args& p, long long start) {
  // Broadcast from lane 0: uniform in ptxas's eyes, as the kernel's (its A descriptors in uniform registers).
  const int c = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0) - 1;
  const int lane = int(threadIdx.x) % 32, warp = (int(threadIdx.x) % 128) / 32;
  float acc[2][64], pa[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) acc[0][e] = acc[1][e] = 0.0f;
  int32_t groups = 0;
  // The partner's empty[0] in the cluster's window (pairs): its stages' barriers follow at 8 bytes each.
  const uint32_t partner_empty = kPairs<kFeed> ? sm90::peer_addr(&s.empty[0], sm90::cluster_rank() ^ 1) : 0;
  const auto take_turn = [&] {
    if (c == 1 || groups > 0) sm90::named_barrier_sync(kTurnBarrier + c, 256);
  };
  const auto pass_turn = [&] {
    sm90::named_barrier_arrive(kTurnBarrier + 1 - c, 256);
    ++groups;
  };
  constexpr bool kTurns = kLoop == Loop::kPromoteTurns || kLoop == Loop::kRegsA || kLoop == Loop::kScales;
  // As the kernel issues them: stage 0's descriptors plus the operands' offsets.
  const uint64_t desc_a = sm90::smem_desc_k_major_sw128(&s.a[0][64 * c * 128]);
  const uint64_t desc_b = sm90::smem_desc_k_major_sw128(&s.b[0][0]);
  const auto issue_half = [&](float(&d)[64], int st, int h) {
    const uint64_t da = sm90::smem_desc_offset(desc_a, st * int(sizeof(s.a[0])));
    const uint64_t db = sm90::smem_desc_offset(desc_b, st * int(sizeof(s.b[0])) + h * 128 * 128);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      sm90::wgmma_m64n128k32_e4m3(d, sm90::smem_desc_offset(da, kk * 32), sm90::smem_desc_offset(db, kk * 32), kk > 0);
    }
    sm90::wgmma_commit();
  };
  const auto promote = [&](float s0, float s1) {
    sm90::fence_registers(pa);
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[0][e] = fmaf(pa[e], (e % 4) < 2 ? s0 : s1, acc[0][e]);
  };
  const int32_t row0 = (int32_t(blockIdx.x) * 128 + 64 * c + 16 * warp + lane / 4) * kScaleBlocks;
  const auto scale_a = [&](int32_t i, int r) { return p.scales_a[row0 + 8 * r * kScaleBlocks + i % kScaleBlocks]; };
  float next_a0 = 1.0f, next_a1 = 1.0f, next_b = 1.0f;
  if constexpr (kLoop == Loop::kScales) next_a0 = scale_a(0, 0), next_a1 = scale_a(0, 1), next_b = p.scales_b[0];
  const float s0 = 1.0f + float(threadIdx.x) * 1e-7f, s1 = 1.0f - float(threadIdx.x) * 1e-7f;
  if constexpr (kLoop == Loop::kPipelined128) {
    // The dense form's idea: [128, 128] tiles, two temporaries, a block's group issued before the one
    // before it is promoted (wait_group 1), no turns. NOTES: in pairs of blocks, so that no group is in
    // flight across the loop's back edge: carried across it, ptxas waited for it at the loop head
    // (C7517), serialising the groups.
    float(&pb)[64] = acc[1];
    const auto issue = [&](float(&d)[64], int32_t i) {
      const int st = i % kStages;
      sm90::mbarrier_wait(&s.full[st], uint32_t(i / kStages) & 1, p.status, sm90::Wait::kFullStage, i);
      issue_half(d, st, 0);
    };
    const auto finish = [&](float(&d)[64], int32_t i) {
      sm90::mbarrier_arrive(&s.empty[i % kStages]);
      sm90::fence_registers(d);
#pragma unroll
      for (int e = 0; e < 64; ++e) acc[0][e] = fmaf(d[e], (e % 4) < 2 ? s0 : s1, acc[0][e]);
    };
    const int32_t n = p.k_blocks;
#pragma unroll 1
    for (int32_t i = 0; i < n; i += 2) {
      issue(pa, i);
      if (i + 1 < n) {
        issue(pb, i + 1);
        sm90::wgmma_wait<1>();
        finish(pa, i);
        sm90::wgmma_wait<0>();
        finish(pb, i + 1);
      } else {
        sm90::wgmma_wait<0>();
        finish(pa, i);
      }
    }
  } else {
#pragma unroll 1
  for (int32_t i = 0; i < p.k_blocks; ++i) {
    const int st = i % kStages;
    sm90::mbarrier_wait(&s.full[st], uint32_t(i / kStages) & 1, p.status, sm90::Wait::kFullStage, i);
    if constexpr (kLoop == Loop::kNoPromote || kLoop == Loop::kNoPromote256 || kLoop == Loop::kBf16) {
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = sm90::smem_desc_k_major_sw128(&s.a[st][64 * c * 128 + kk * 32]);
        float(&wide)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
        if constexpr (kLoop == Loop::kBf16) {
          sm90::wgmma_m64n256k16(wide, da, sm90::smem_desc_k_major_sw128(&s.b[st][kk * 32]), true);
        } else if constexpr (kLoop == Loop::kNoPromote256) {
          wgmma_m64n256k32_e4m3(wide, da, sm90::smem_desc_k_major_sw128(&s.b[st][kk * 32]));
        } else {
          sm90::wgmma_m64n128k32_e4m3(acc[0], da, sm90::smem_desc_k_major_sw128(&s.b[st][kk * 32]), true);
          sm90::wgmma_m64n128k32_e4m3(acc[1], da, sm90::smem_desc_k_major_sw128(&s.b[st][128 * 128 + kk * 32]), true);
        }
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
    } else if constexpr (kLoop == Loop::kRegsA) {
      // A's fragments of the four k32 steps, once for both halves: lane l addresses row 16w + l % 16,
      // 16-byte chunk 2kk + l / 16 (the x4's matrices: rows 0-7 and 8-15, bytes 0-15 then 16-31).
      uint32_t a[4][4];
      const int row = 16 * warp + lane % 16;
      const uint32_t base = sm90::smem_addr(&s.a[st][64 * c * 128]) + uint32_t(row * 128);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) ldmatrix_x4(a[kk], base + uint32_t(((2 * kk + lane / 16) ^ (row % 8)) * 16));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        take_turn();
        sm90::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n128k32_e4m3_rs(pa, a[kk], sm90::smem_desc_k_major_sw128(&s.b[st][h * 128 * 128 + kk * 32]), kk > 0);
        }
        sm90::wgmma_commit();
        pass_turn();
        sm90::wgmma_wait<0>();
        promote(s0, s1);
      }
    } else {
      float a0 = s0, a1 = s1, b = 1.0f;
      if constexpr (kLoop == Loop::kScales) {  // this block's scales, the next block's loaded now
        a0 = next_a0, a1 = next_a1, b = next_b;
        if (i + 1 < p.k_blocks) next_a0 = scale_a(i + 1, 0), next_a1 = scale_a(i + 1, 1), next_b = p.scales_b[(i + 1) % kScaleBlocks];
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kTurns) take_turn();
        issue_half(pa, st, h);
        if constexpr (kTurns) pass_turn();
        sm90::wgmma_wait<0>();
        promote(a0 * b, a1 * b);
      }
    }
    sm90::mbarrier_arrive(&s.empty[st]);
    if constexpr (kPairs<kFeed>) {  // the partner multicasts into this stage too: its empty barrier, once a warp
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive_remote(partner_empty + uint32_t(st) * uint32_t(sizeof(uint64_t)));
    }
  }
  }
  if (kTurns && c == 0 && groups > 0) sm90::named_barrier_sync(kTurnBarrier, 256);
  sm90::fence_registers(acc[0]);
  sm90::fence_registers(acc[1]);
  float v = 0.0f;
#pragma unroll
  for (int e = 0; e < 64; ++e) v += acc[0][e] + acc[1][e];
  if (v == 12345.0f) p.sink[threadIdx.x] = v;
  sm90::named_barrier_sync(1, 256);
  if (threadIdx.x == 128) p.cycles[blockIdx.x] = clock64() - start;
}

template <Loop kLoop, Feed kFeed>
__device__ __forceinline__ void run(const Args& p) {
  static_assert(!kPairs<kFeed> || kLoop != Loop::kPipelined128, "pairs release their stages in the general loop");
  extern __shared__ uint8_t raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbarrier_init(&s.full[i], kFullArrivals<kFeed>);
      sm90::mbarrier_init(&s.empty[i], 256 + (kPairs<kFeed> ? 8 : 0));  // and the partner's 8 consumer warps
    }
    sm90::fence_barrier_init();
  }
  // Zeros, for a feed that leaves most of a stage unwritten (their values do not change the timing).
  for (int i = int(threadIdx.x) * 16; i < int(sizeof(s.a) + sizeof(s.b)); i += kThreads * 16) {
    *reinterpret_cast<uint4*>(&s.a[0][0] + i) = make_uint4(0, 0, 0, 0);
  }
  sm90::fence_proxy_async_shared();
  // A pair: the partner's barriers initialised before any arrive on them or multicast into them.
  if constexpr (kPairs<kFeed>) {
    sm90::cluster_sync();
  } else {
    __syncthreads();
  }
  const long long start = clock64();
  if (threadIdx.x < 128) {
    sm90::setmaxnreg_dec<40>();
    produce<kFeed>(s, p);
  } else {
    sm90::setmaxnreg_inc<232>();
    consume<kLoop, kFeed>(s, p, start);
  }
  // NOTES: no CTA of a pair leaves while its partner may still multicast into it or arrive on it.
  if constexpr (kPairs<kFeed>) sm90::cluster_sync();
}

template <Loop kLoop, Feed kFeed>
__global__ void __launch_bounds__(kThreads, 1) mainloop_kernel(const Args p) {
  run<kLoop, kFeed>(p);
}
template <Loop kLoop, Feed kFeed>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) mainloop_pairs_kernel(const Args p) {
  run<kLoop, kFeed>(p);
}

struct Case {
  const char* loop;
  const char* feed;
  void (*kernel)(Args);
  double flop_per_block;  // per CTA and K block
  double peak;            // dense FLOP per SM clock of the loop's type
};

constexpr double kFp8Block = 128.0 * 256 * 128 * 2, kBf16Block = 128.0 * 256 * 64 * 2;
template <Loop kLoop, Feed kFeed>
Case make_case(const char* loop, const char* feed) {
  const bool bf16 = kLoop == Loop::kBf16;
  const double flop = bf16 ? kBf16Block : kLoop == Loop::kPipelined128 ? kFp8Block / 2 : kFp8Block;
  if constexpr (kPairs<kFeed>) return {loop, feed, mainloop_pairs_kernel<kLoop, kFeed>, flop, bf16 ? 4096.0 : 8192.0};
  return {loop, feed, mainloop_kernel<kLoop, kFeed>, flop, bf16 ? 4096.0 : 8192.0};
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "lynx-fp8-mainloop: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

int parse(int argc, char** argv, int i, const char* name) {
  const int v = i + 1 < argc ? std::atoi(argv[i + 1]) : 0;
  if (v <= 0) {
    std::fprintf(stderr, "lynx-fp8-mainloop: %s takes a positive number\n", name);
    std::exit(2);
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  int k_blocks = 2048, rounds = 5;
  for (int i = 1; i < argc; i += 2) {
    if (!std::strcmp(argv[i], "--k-blocks")) {
      k_blocks = parse(argc, argv, i, "--k-blocks");
    } else if (!std::strcmp(argv[i], "--rounds")) {
      rounds = parse(argc, argv, i, "--rounds");
    } else {
      std::fprintf(stderr, "usage: lynx-fp8-mainloop [--k-blocks N] [--rounds N]\n");
      return 2;
    }
  }
  int sms = 0, major = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "device attributes");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), "device attributes");
  if (major != 9) {
    std::fprintf(stderr, "lynx-fp8-mainloop: needs a Hopper GPU (sm_90)\n");
    return 2;
  }
  // Source stages: 512 (24 MB, L2-resident) or 20000 (~980 MB, from DRAM); gathered rows drawn from
  // the first 24 MB (the rows of x a gate/up GEMM gathers are in L2 too).
  const int64_t l2_stages = 512, dram_stages = 20000, stage_bytes = kStageA + kStageB;
  const int32_t src_rows = int32_t(l2_stages * stage_bytes / 128);
  uint8_t* src = nullptr;
  check(cudaMalloc(&src, dram_stages * stage_bytes), "cudaMalloc");
  check(cudaMemset(src, 0, dram_stages * stage_bytes), "cudaMemset");
  std::vector<int32_t> rows(1 << 16);
  uint32_t x = 12345;
  for (auto& r : rows) x = x * 1664525u + 1013904223u, r = int32_t(x % uint32_t(src_rows));
  int32_t* d_rows = nullptr;
  check(cudaMalloc(&d_rows, rows.size() * sizeof(int32_t)), "cudaMalloc");
  check(cudaMemcpy(d_rows, rows.data(), rows.size() * sizeof(int32_t), cudaMemcpyHostToDevice), "cudaMemcpy");
  std::vector<float> ones(size_t(sms) * 128 * kScaleBlocks, 1.0f);
  float *scales_a = nullptr, *scales_b = nullptr, *sink = nullptr;
  check(cudaMalloc(&scales_a, ones.size() * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(scales_a, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMalloc(&scales_b, kScaleBlocks * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(scales_b, ones.data(), kScaleBlocks * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMalloc(&sink, kThreads * sizeof(float)), "cudaMalloc");
  long long* cycles = nullptr;
  check(cudaMalloc(&cycles, sms * sizeof(long long)), "cudaMalloc");
  DeviceStatus* status = nullptr;
  check(cudaHostAlloc(&status, sizeof(DeviceStatus), cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(status, 0, sizeof(DeviceStatus));

  const std::vector<Case> cases = {
      make_case<Loop::kPromote, Feed::kNone>("promote (as built)", "none"),
      make_case<Loop::kPromoteTurns, Feed::kNone>("promote, turns", "none"),
      make_case<Loop::kRegsA, Feed::kNone>("promote, turns, A in registers", "none"),
      make_case<Loop::kScales, Feed::kNone>("promote, turns, scales loaded", "none"),
      make_case<Loop::kPipelined128, Feed::kNone>("[128,128], two groups in flight", "none"),
      make_case<Loop::kNoPromote, Feed::kNone>("no promotion", "none"),
      make_case<Loop::kNoPromote256, Feed::kNone>("no promotion, m64n256k32", "none"),
      make_case<Loop::kBf16, Feed::kNone>("bf16 m64n256k16", "none"),
      make_case<Loop::kPromote, Feed::kL2>("promote (as built)", "L2"),
      make_case<Loop::kPromoteTurns, Feed::kL2>("promote, turns", "L2"),
      make_case<Loop::kRegsA, Feed::kL2>("promote, turns, A in registers", "L2"),
      make_case<Loop::kPipelined128, Feed::kL2>("[128,128], two groups in flight", "L2"),
      make_case<Loop::kNoPromote, Feed::kL2>("no promotion", "L2"),
      make_case<Loop::kBf16, Feed::kL2>("bf16 m64n256k16", "L2"),
      make_case<Loop::kPromote, Feed::kL2Pairs>("promote (as built)", "L2 pairs"),
      make_case<Loop::kNoPromote, Feed::kL2Pairs>("no promotion", "L2 pairs"),
      make_case<Loop::kBf16, Feed::kL2Pairs>("bf16 m64n256k16", "L2 pairs"),
      make_case<Loop::kPromote, Feed::kGather>("promote (as built)", "gather A"),
      make_case<Loop::kNoPromote, Feed::kGather>("no promotion", "gather A"),
      make_case<Loop::kPromote, Feed::kDram>("promote (as built)", "DRAM"),
      make_case<Loop::kNoPromote, Feed::kDram>("no promotion", "DRAM"),
  };
  const int smem = int(sizeof(Smem)) + 1024;
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  std::printf("lynx-fp8-mainloop: %d CTAs (one an SM), %d K blocks each, median of %d rounds after one warm-up\n",
              sms, k_blocks, rounds);
  std::printf("%-34s %-9s %9s %10s %13s %8s\n", "loop", "feed", "ms", "TFLOP/s", "FLOP/clk/SM", "of peak");
  bool pairs_note = true;
  for (const Case& c : cases) {
    check(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
    const bool dram = !std::strcmp(c.feed, "DRAM");
    const bool pairs = !std::strcmp(c.feed, "L2 pairs");
    int grid = sms;
    if (pairs) {  // as many pairs as run at once, so that every CTA's loop meets the others'
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(unsigned(sms / 2 * 2));
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = size_t(smem);
      int clusters = 0;
      check(cudaOccupancyMaxActiveClusters(&clusters, c.kernel, &config), "cudaOccupancyMaxActiveClusters");
      grid = 2 * std::min(sms / 2, clusters);
      if (grid == 0) {
        std::printf("%-34s %-9s no cluster of two fits: not run\n", c.loop, c.feed);
        continue;
      }
      if (pairs_note) std::printf("(L2 pairs: %d CTAs, in %d clusters of two)\n", grid, grid / 2);
      pairs_note = false;
    }
    const Args args{src, dram ? dram_stages : l2_stages, d_rows, uint32_t(rows.size() - 1), scales_a, scales_b,
                    k_blocks, cycles, sink, status};
    std::vector<double> ms, per_clock;
    for (int r = 0; r <= rounds; ++r) {
      check(cudaEventRecord(e0), "cudaEventRecord");
      c.kernel<<<grid, kThreads, smem>>>(args);
      check(cudaEventRecord(e1), "cudaEventRecord");
      const cudaError_t e = cudaEventSynchronize(e1);
      if (e != cudaSuccess || status->code != 0) {
        std::fprintf(stderr, "lynx-fp8-mainloop: %s / %s: %s%s\n", c.loop, c.feed, cudaGetErrorString(e),
                     status->code ? (" " + describe_status(*status, 1)).c_str() : "");
        return 1;
      }
      float t = 0.0f;
      check(cudaEventElapsedTime(&t, e0, e1), "cudaEventElapsedTime");
      std::vector<long long> clocks(grid);
      check(cudaMemcpy(clocks.data(), cycles, grid * sizeof(long long), cudaMemcpyDeviceToHost), "cudaMemcpy");
      const long long slowest = *std::max_element(clocks.begin(), clocks.end());
      if (r == 0) continue;  // warm-up
      ms.push_back(t);
      per_clock.push_back(c.flop_per_block * k_blocks / double(slowest));
    }
    std::sort(ms.begin(), ms.end());
    std::sort(per_clock.begin(), per_clock.end());
    const double t = ms[ms.size() / 2], f = per_clock[per_clock.size() / 2];
    std::printf("%-34s %-9s %9.3f %10.1f %13.0f %7.1f%%\n", c.loop, c.feed, t,
                c.flop_per_block * k_blocks * grid / (t * 1e9), f, 100.0 * f / c.peak);
  }
  return 0;
}
