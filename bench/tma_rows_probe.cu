// lynx-tma-rows-probe: can TMA boxes of one row feed a GEMM's A stages straight from the token rows, with
// no gathered copy? (No: ~2 µs per stage, bench/results/2026-11-29-h200-session10.txt.) One CTA per SM
// streams [128, 64] bf16 A stages (16 KB, 128-byte swizzle) through a 4-stage pipeline to a consumer
// warpgroup that only waits, optionally "computes" for a fixed time, and releases, in three modes:
//   0  one [128, 64] box per stage from a gathered copy (what the expert GEMM does today)
//   1  128 boxes of [1, 64] per stage straight from x, issued by one thread (tried in session 4 on the
//      producer's own path: 1.5-4x slower)
//   2  the same 128 boxes issued by 96 threads (warps 1-3, the producer warpgroup's spare warps)
// Each row block is streamed `passes` times (the gate/up GEMM reads it once per column tile: 6 at
// qwen3-30b-a3b). It prints, per mode, the median time, the A bytes delivered per second, and the time
// per stage; and checks that CTA 0's last stage holds its rows in the swizzled layout a [128, 64] box
// would give (a [1, 64] box lands swizzled by its shared-memory address). Exits 1 on a wrong layout.
// NOTES: mode 0's copy (268 MB) comes from DRAM on a row block's first pass while x (33 MB) stays in L2;
// in the GEMM the copy is L2-hot, written just before by the gather warps. Modes 1 and 2 compare
// directly; mode 0 is the reference for the rate one box per stage reaches.
//   usage: lynx-tma-rows-probe [--consume-ns N] [--passes N]   (qwen3-30b-a3b's sizes)
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "fused/sm90.cuh"
#include "fused/tma.h"

namespace {

using lynx::fused::sm90::Wait;
namespace sm90 = lynx::fused::sm90;

constexpr int kStages = 4;
constexpr int kRows = 128;                        // rows of an A stage
constexpr int kCols = 64;                         // bf16 per row of a stage: one 128-byte swizzle row
constexpr uint32_t kStageBytes = kRows * kCols * 2;  // 16 KB
constexpr int kThreads = 256;                     // warp 0: producer; 1-3: row issuers; 4-7: consumers
constexpr int kIssuerFirst = 32, kIssuers = 96, kConsumerFirst = 128, kConsumers = 128;
constexpr size_t kPinBytes = 120 << 10;           // shared memory that keeps one CTA per SM

struct Smem {
  alignas(1024) uint16_t a[kStages][kRows * kCols];  // [128, 64] bf16, 128B swizzle
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

__global__ void __launch_bounds__(kThreads, 1)
    stream_stages(const __grid_constant__ CUtensorMap block_map, const __grid_constant__ CUtensorMap row_map,
                  const int32_t* token_of_row, int row_blocks, int k_blocks, int passes, int mode, int consume_ns,
                  uint4* check_out) {
  extern __shared__ uint8_t raw[];
  Smem& s = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      sm90::mbarrier_init(&s.full[i], 1);
      sm90::mbarrier_init(&s.empty[i], kConsumers);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();
  const int t = threadIdx.x;
  const bool issuer = mode == 2 ? (t >= kIssuerFirst && t < kIssuerFirst + kIssuers) : t == 0;
  const bool consumer = t >= kConsumerFirst;
  if (!issuer && !consumer) return;
  const int last_rb = blockIdx.x + (row_blocks - 1 - int(blockIdx.x)) / int(gridDim.x) * int(gridDim.x);
  int stage = 0;
  uint32_t phase = 0;
  for (int rb = blockIdx.x; rb < row_blocks; rb += gridDim.x) {
    for (int pass = 0; pass < passes; ++pass) {
      for (int kb = 0; kb < k_blocks; ++kb) {
        uint16_t* a = s.a[stage];
        if (issuer) {
          sm90::mbarrier_wait(&s.empty[stage], phase ^ 1, nullptr, Wait::kEmptyStage, rb);
          if (t == (mode == 2 ? kIssuerFirst : 0)) sm90::mbarrier_arrive_expect_tx(&s.full[stage], kStageBytes);
          if (mode == 0) {
            sm90::tma_load_2d(a, &block_map, &s.full[stage], kb * kCols, rb * kRows);
          } else {
            const int first = mode == 2 ? t - kIssuerFirst : 0, step = mode == 2 ? kIssuers : 1;
            for (int r = first; r < kRows; r += step) {
              sm90::tma_load_2d(a + r * kCols, &row_map, &s.full[stage], kb * kCols, token_of_row[rb * kRows + r]);
            }
          }
        } else {
          sm90::mbarrier_wait(&s.full[stage], phase, nullptr, Wait::kFullStage, rb);
          if (consume_ns > 0) {
            const uint64_t t0 = sm90::globaltimer_ns();
            while (sm90::globaltimer_ns() - t0 < uint64_t(consume_ns)) {
            }
          }
          if (blockIdx.x == 0 && rb == last_rb && pass == passes - 1 && kb == k_blocks - 1) {
            const uint4* from = reinterpret_cast<const uint4*>(a);
            for (int i = t - kConsumerFirst; i < int(kStageBytes / 16); i += kConsumers) check_out[i] = from[i];
          }
          sm90::mbarrier_arrive(&s.empty[stage]);
        }
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
  }
}

uint16_t value_at(int64_t token, int64_t col) { return uint16_t((token * 131 + col * 7) & 0xFFFF); }

}  // namespace

int main(int argc, char** argv) {
  int consume_ns = 0, passes = 6;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--consume-ns" || arg == "--passes") && i + 1 < argc) {
      (arg == "--consume-ns" ? consume_ns : passes) = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: lynx-tma-rows-probe [--consume-ns N] [--passes N]\n");
      return 2;
    }
  }
  constexpr int64_t kTokens = 8192, kHidden = 2048, kTopK = 8, kRowsTotal = kTokens * kTopK;  // qwen3-30b-a3b
  const int row_blocks = int(kRowsTotal / kRows), k_blocks = int(kHidden / kCols);
  int sms = 0;
  LYNX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  // Rows in schedule order name scattered tokens, each token k times.
  std::vector<int32_t> token_of_row(kRowsTotal);
  for (int64_t i = 0; i < kRowsTotal; ++i) token_of_row[i] = int32_t((uint64_t(i) * 2654435761ull) % kTokens);
  std::vector<uint16_t> x(kTokens * kHidden), gathered(kRowsTotal * kHidden);
  for (int64_t tk = 0; tk < kTokens; ++tk)
    for (int64_t c = 0; c < kHidden; ++c) x[tk * kHidden + c] = value_at(tk, c);
  for (int64_t i = 0; i < kRowsTotal; ++i)
    std::memcpy(&gathered[i * kHidden], &x[int64_t(token_of_row[i]) * kHidden], kHidden * 2);

  void *d_x = nullptr, *d_gathered = nullptr, *d_check = nullptr;
  int32_t* d_tokens = nullptr;
  LYNX_CUDA(cudaMalloc(&d_x, x.size() * 2));
  LYNX_CUDA(cudaMalloc(&d_gathered, gathered.size() * 2));
  LYNX_CUDA(cudaMalloc(&d_tokens, token_of_row.size() * 4));
  LYNX_CUDA(cudaMalloc(&d_check, kStageBytes));
  LYNX_CUDA(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  LYNX_CUDA(cudaMemcpy(d_gathered, gathered.data(), gathered.size() * 2, cudaMemcpyHostToDevice));
  LYNX_CUDA(cudaMemcpy(d_tokens, token_of_row.data(), token_of_row.size() * 4, cudaMemcpyHostToDevice));
  const CUtensorMap block_map = lynx::fused::make_tma_2d(d_gathered, kRowsTotal, kHidden, kRows, kCols);
  const CUtensorMap row_map = lynx::fused::make_tma_2d(d_x, kTokens, kHidden, 1, kCols);
  const size_t smem = std::max(sizeof(Smem) + 1024, kPinBytes);
  LYNX_CUDA(cudaFuncSetAttribute(stream_stages, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));

  // The stage CTA 0 consumes last, as a [128, 64] box with 128-byte swizzle lays it out: the 16-byte
  // chunk c of row r at chunk c ^ (r % 8).
  const int last_rb = (row_blocks - 1) / sms * sms;
  std::vector<uint16_t> expected(kRows * kCols);
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) {
      const int chunk = c / 8, at = ((chunk ^ (r % 8)) * 8) + c % 8;
      expected[r * kCols + at] = value_at(token_of_row[last_rb * kRows + r], (k_blocks - 1) * kCols + c);
    }

  const double stage_count = double(row_blocks) * passes * k_blocks;
  const double bytes = stage_count * kStageBytes;
  std::printf("qwen3-30b-a3b A stages: %d row blocks x %d passes x %d K blocks on %d SMs, consume %d ns per stage\n",
              row_blocks, passes, k_blocks, sms, consume_ns);
  std::printf("%-36s %10s %12s %16s %8s\n", "mode", "ms", "A TB/s", "us/stage/CTA", "layout");
  const char* names[] = {"0 one [128,64] box (gathered copy)", "1 128 [1,64] boxes, one thread",
                         "2 128 [1,64] boxes, 96 threads"};
  cudaEvent_t e0, e1;
  LYNX_CUDA(cudaEventCreate(&e0));
  LYNX_CUDA(cudaEventCreate(&e1));
  int failed = 0;
  for (int mode = 0; mode < 3; ++mode) {
    std::vector<float> ms;
    for (int rep = 0; rep < 12; ++rep) {
      LYNX_CUDA(cudaMemset(d_check, 0xFF, kStageBytes));
      LYNX_CUDA(cudaEventRecord(e0));
      stream_stages<<<sms, kThreads, smem>>>(block_map, row_map, d_tokens, row_blocks, k_blocks, passes, mode,
                                            consume_ns, static_cast<uint4*>(d_check));
      LYNX_CUDA(cudaGetLastError());
      LYNX_CUDA(cudaEventRecord(e1));
      LYNX_CUDA(cudaEventSynchronize(e1));
      float t = 0;
      LYNX_CUDA(cudaEventElapsedTime(&t, e0, e1));
      if (rep >= 2) ms.push_back(t);  // two warm-ups
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    std::vector<uint16_t> got(kRows * kCols);
    LYNX_CUDA(cudaMemcpy(got.data(), d_check, kStageBytes, cudaMemcpyDeviceToHost));
    const bool ok = got == expected;
    failed |= !ok;
    std::printf("%-36s %10.3f %12.2f %16.3f %8s\n", names[mode], med, bytes / (med * 1e-3) / 1e12,
                med * 1e3 / (stage_count / sms), ok ? "ok" : "WRONG");
  }
  LYNX_CUDA(cudaFree(d_x));
  LYNX_CUDA(cudaFree(d_gathered));
  LYNX_CUDA(cudaFree(d_tokens));
  LYNX_CUDA(cudaFree(d_check));
  return failed;
}
