// The expert GEMM's host side: tensor maps, launch configurations (clusters, shared memory) and the
// kernel parameters of each mode, from the arguments the runtime fills in (api.h) with the plan's
// launch choices.
#include <cuda.h>

#include <algorithm>
#include <string>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "common/per_device.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/expert_gemm/kernel.cuh"
#include "kernels/expert_gemm/tma.h"

namespace lynx::gemm {
namespace {

using namespace impl;

// The operand maps (OperandMaps) and the output maps (C0, C1, C2) of one launch.
struct Maps {
  CUtensorMap a, a_half, a_quarter, a_fold, b0, b1, b_half, c0, c1, c2;
};

cudaLaunchConfig_t launch_config(int grid, size_t smem, cudaStream_t stream, cudaLaunchAttribute* cluster) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = cluster;
  config.numAttrs = cluster ? 1 : 0;
  return config;
}

cudaLaunchAttribute pair_attribute() {
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterTiles;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  return cluster;
}

// Once per device and mode: the kernel's shared-memory limit (a per-device attribute) and, for the
// modes that may pair, how many clusters can be resident at once (the GPCs may leave an SM without a
// partner). Returns that count (0 for the weight gradient). prepare_expert_gemm_kernels runs it when a
// fused workspace is made, so that no launch, captured in a graph or not, is the first to.
template <Mode kMode, bool kFold, bool kRemote = false>
int prepare(int sm_count) {
  constexpr size_t kSmem = sizeof(SharedStorage<kMode, kFold>) + 1024;
  static detail::PerDeviceCache resident_clusters;  // -1: prepared, never pairs
  const int clusters = detail::per_device(resident_clusters, [&](int) {
    LYNX_CUDA(cudaFuncSetAttribute(expert_gemm_kernel<kMode, kFold, kRemote>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
    int n = -1;
    if (Config<kMode>::kMayPair) {
      cudaLaunchAttribute pair = pair_attribute();
      const cudaLaunchConfig_t config =
          launch_config(std::max(sm_count / kClusterTiles, 1) * kClusterTiles, kSmem, nullptr, &pair);
      LYNX_CUDA(cudaOccupancyMaxActiveClusters(&n, expert_gemm_kernel<kMode, kFold, kRemote>, &config));
      if (n < 1) throw Error("", "internal: no cluster of two expert GEMM CTAs fits the GPU");
    }
    return n;
  });
  return std::max(clusters, 0);
}

template <Mode kMode, bool kFold, bool kRemote>
void launch_as(const Maps& m, const Params& p, int sm_count, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(SharedStorage<kMode, kFold>) + 1024;
  const int resident = prepare<kMode, kFold, kRemote>(sm_count);
  cudaLaunchAttribute pair = pair_attribute();
  const cudaLaunchConfig_t config =
      p.cluster > 1 ? launch_config(std::max(1, std::min(sm_count / kClusterTiles, resident)) * kClusterTiles, kSmem,
                                    stream, &pair)
                    : launch_config(sm_count, kSmem, stream, nullptr);
  LYNX_CUDA(cudaLaunchKernelEx(&config, expert_gemm_kernel<kMode, kFold, kRemote>, m.a, m.a_half, m.a_quarter, m.a_fold, m.b0,
                               m.b1, m.b_half, m.c0, m.c1, m.c2, p));
  LYNX_CHECK_LAUNCH();
}

// The mode with kernels that gather from other ranks: gate/up. NOTES: not `da` (kRowsMnB): ptxas
// serialised the wgmma of its remote kernel with 8 or 4 loads in flight per gather lane, in one build
// or the other (2 kept it pipelined, too few for the ~0.8 TB/s of rows `da` reads at qwen3-30b-a3b);
// at R > 1 the backward pulls its dy rows with the row-major kernel (plan/layer_plan.cpp).
constexpr bool gathers_remote(Mode mode) { return mode == Mode::kRowsSwiGLU; }

// The kernel that folds tails when the launch does (Params::grid.block_offset), else the one that does
// not; of those, the one gathering from other ranks when the launch does (Params::sources).
template <Mode kMode>
void launch(const Maps& m, const Params& p, int sm_count, cudaStream_t stream) {
  if (p.sources.remote()) {
    if constexpr (gathers_remote(kMode)) {
      if (p.grid.block_offset) return launch_as<kMode, true, true>(m, p, sm_count, stream);
      return launch_as<kMode, false, true>(m, p, sm_count, stream);
    } else {
      throw Error("", "internal: only the gate/up GEMM gathers rows from other ranks");
    }
  }
  if constexpr (kMode != Mode::kWeightGrad) {
    if (p.grid.block_offset) return launch_as<kMode, true, false>(m, p, sm_count, stream);
  }
  launch_as<kMode, false, false>(m, p, sm_count, stream);
}

void check(bool ok, const char* what) {
  if (!ok) throw Error("", std::string("internal: expert GEMM sizes not supported: ") + what);
}

// What the L2 fetches for each line of the weights (B) a row mode misses: the 256-byte block for
// gate/up, the line alone for the others. NOTES: the row launches other than gate/up run at 94-98% of
// L2 throughput at deepseek-v3, and a 256-byte fetch there costs more L2 work than it saves. In
// `da` and `dx_row` (N-major B, 4 adjacent [64, 64] blocks per stage) its second half is a block the
// same stage asks for anyway; in down (K-major) it is the next K block, asked for one stage later.
// Measured on the H200 (2026-12-01, commit eb77a83; Nsight Compute,
// deepseek-v3): down 2.27 -> 2.16 ms, `da` 2.41 -> 2.26, `dx_row` 4.17 -> 4.13, with 20% fewer L2
// bytes and the same DRAM reads; gate/up 1% slower without it, and the rows (A) of every mode gained
// nothing from fetching lines.
constexpr L2Fetch weights_fetch(Mode mode) { return mode == Mode::kRowsSwiGLU ? L2Fetch::k256B : L2Fetch::kLine; }

// The Params every row mode shares.
Params rows_params(const ExpertGemmArgs& args, int block_n) {
  check(args.tickets != nullptr, "tile tickets");
  check(args.capacity % kBlockM == 0 && args.k % kBlockK == 0 && args.n % 64 == 0 && args.capacity <= INT32_MAX,
        "capacity % 128, K % 64, N % 64");
  check(args.k > 0 && args.n > 0, "K > 0 and N > 0 (a padding tile passes K / 64 stages)");
  const RowLaunch& l = args.launch;
  check(l.order.group_rows >= 1 && l.order.group_rows <= 64, "group rows in [1, 64]");
  Params p{};
  p.grid.expert_offset = args.expert_offset;
  p.grid.expert_rows = l.half_tiles ? args.expert_rows : nullptr;
  p.swapped = l.swapped;
  p.grid.block_offset = l.fold && p.grid.expert_rows ? args.block_offset : nullptr;
  p.grid.experts = static_cast<int32_t>(args.experts);
  p.grid.tiles_m = static_cast<int32_t>(args.capacity / kBlockM);
  p.grid.tiles_n = static_cast<int32_t>((args.n + block_n - 1) / block_n);
  p.grid.block_n = block_n;
  p.grid.k_blocks = static_cast<int32_t>(args.k / kBlockK);
  p.grid.capacity = static_cast<int32_t>(args.capacity);
  p.grid.weight_grad = false;
  p.grid.group_rows = l.order.group_rows;
  p.grid.expert_groups = l.order.expert_groups;
  p.in_order = l.order.in_order;
  p.cluster = l.clusters ? kClusterTiles : 1;
  p.n = static_cast<int32_t>(args.n);
  p.out_split = INT32_MAX;
  p.status = args.status;
  p.tickets = args.tickets;
#if LYNX_EXPERIMENTS
  p.stall_task = args.stall_task;
#endif
  check(!args.gather_sources.remote() || (args.gather_src && args.gather_sources.row_src_rank),
        "gather from other ranks: gather_src set and the rows' source ranks");
  if (args.gather_src) {
    check(args.row_token_slot != nullptr && args.gather_sync != nullptr && args.top_k > 0, "gather: slots, sync, top_k");
    check(l.gather_lookahead >= 1, "gather lookahead >= 1 row block");
    check(!args.gather_dst || !args.gather_sources.remote(), "a gather beside the GEMM reads this rank's rows");
    // NOTES: the kernel writes A (args.a, the workspace's gathered-rows buffer) when it gathers into A.
    p.gather.src = reinterpret_cast<const uint4*>(args.gather_src);
    p.gather.dst = reinterpret_cast<uint4*>(args.gather_dst ? args.gather_dst : const_cast<bf16_t*>(args.a));
    p.gather.awaited = args.gather_dst == nullptr;
    p.gather.row_token_slot = args.row_token_slot;
    p.gather.top_k = static_cast<int32_t>(args.top_k);
    const int64_t width = args.gather_dst && args.gather_width > 0 ? args.gather_width : args.k;
    check(width > 0 && width % 8 == 0, "gather: rows of whole 16-byte vectors");
    p.gather.vecs = static_cast<int32_t>(width / 8);
    // Rows no tile reads need not stay in L2 for it: no throttle.
    p.gather.lookahead = p.gather.awaited ? l.gather_lookahead : INT32_MAX;
    p.gather.sync = args.gather_sync;
    p.sources = args.gather_sources;
#if LYNX_EXPERIMENTS
    p.gather.stall_block = args.gather_stall_block;
#endif
  }
  return p;
}

template <Mode kMode>
void launch_rows(const ExpertGemmArgs& args, cudaStream_t stream) {
  constexpr int kBlockN = Config<kMode>::kBlockN;
  Params p = rows_params(args, kBlockN);
  check((args.out_gate == nullptr) == (args.out_up == nullptr), "gate and up products both stored or neither");
  check(args.out_gate == nullptr || args.gate_up_slot != nullptr, "gate and up products: where each row goes");
  Maps m;
  m.a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  m.a_half = make_tma_2d(args.a, args.capacity, args.k, 64, kBlockK);
  m.a_quarter = make_tma_2d(args.a, args.capacity, args.k, kQuarterRows, kBlockK);
  m.a_fold = make_tma_2d(args.a, args.capacity, args.k, kFoldRows, kBlockK);
  constexpr L2Fetch fb = weights_fetch(kMode);
  m.b0 = make_tma_3d(args.b0, args.experts, args.n, args.k, kBlockN, kBlockK, fb, args.b0_stride);
  m.b1 = Config<kMode>::kSwiGLU
             ? make_tma_3d(args.b1, args.experts, args.n, args.k, kBlockN, kBlockK, fb, args.b1_stride)
             : m.b0;
  m.b_half = make_tma_3d(args.b0, args.experts, args.n, args.k, 128, kBlockK, fb, args.b0_stride);
  m.c0 = make_tma_2d(args.out, args.capacity, args.n, 64, 64);
  p.out_gate_up = Config<kMode>::kSwiGLU && args.out_gate != nullptr;
  m.c1 = m.c2 = m.c0;
  if (p.out_gate_up) {  // row by row (epilogue.cuh)
    p.gate_rows = SlotRows{args.out_gate, args.gate_up_slot, static_cast<int32_t>(args.n)};
    p.up_rows = SlotRows{args.out_up, args.gate_up_slot, static_cast<int32_t>(args.n)};
  }
  launch<kMode>(m, p, args.sm_count, stream);
}

template <>
void launch_rows<Mode::kRowsMnB>(const ExpertGemmArgs& args, cudaStream_t stream) {
  check(args.k_split % kBlockK == 0 && args.k_split >= 0 && args.k_split <= args.k, "K split % 64");
  Params p = rows_params(args, Config<Mode::kRowsMnB>::kBlockN);
  const int64_t k0 = args.b1 ? args.k_split : args.k;
  Maps m;
  m.a = make_tma_2d(args.a, args.capacity, args.k, kBlockM, kBlockK);
  m.a_half = make_tma_2d(args.a, args.capacity, args.k, 64, kBlockK);
  m.a_quarter = make_tma_2d(args.a, args.capacity, args.k, kQuarterRows, kBlockK);
  m.a_fold = make_tma_2d(args.a, args.capacity, args.k, kFoldRows, kBlockK);
  constexpr L2Fetch fb = weights_fetch(Mode::kRowsMnB);
  m.b0 = m.b_half = make_tma_3d(args.b0, args.experts, k0, args.n, 64, 64, fb, args.b0_stride);
  m.b1 = args.b1 ? make_tma_3d(args.b1, args.experts, args.k - k0, args.n, 64, 64, fb, args.b1_stride) : m.b0;
  m.c0 = m.c1 = m.c2 = make_tma_2d(args.out, args.capacity, args.n, 64, 64);
  p.k_split = static_cast<int32_t>(k0);
  launch<Mode::kRowsMnB>(m, p, args.sm_count, stream);
}

}  // namespace

void prepare_expert_gemm_kernels(int sm_count) {
  load_module_of(reinterpret_cast<const void*>(&expert_gemm_kernel<Mode::kRows, false, false>));
  prepare<Mode::kRowsSwiGLU, false>(sm_count);
  prepare<Mode::kRows, false>(sm_count);
  prepare<Mode::kRowsMnB, false>(sm_count);
  prepare<Mode::kRowsSwiGLU, true>(sm_count);
  prepare<Mode::kRows, true>(sm_count);
  prepare<Mode::kRowsMnB, true>(sm_count);
  prepare<Mode::kWeightGrad, false>(sm_count);
  prepare<Mode::kRowsSwiGLU, false, true>(sm_count);
  prepare<Mode::kRowsSwiGLU, true, true>(sm_count);
}

void expert_gemm(const ExpertGemmArgs& args, cudaStream_t stream) { launch_rows<Mode::kRows>(args, stream); }
void expert_gemm_swiglu(const ExpertGemmArgs& args, cudaStream_t stream) {
  launch_rows<Mode::kRowsSwiGLU>(args, stream);
}
void expert_gemm_n_major(const ExpertGemmArgs& args, cudaStream_t stream) { launch_rows<Mode::kRowsMnB>(args, stream); }

void expert_weight_grad(const WeightGradArgs& args, cudaStream_t stream) {
  check(args.tickets != nullptr, "tile tickets");
  check(args.capacity % kBlockM == 0 && args.m % 64 == 0 && args.n % 64 == 0 && args.capacity <= INT32_MAX,
        "capacity % 128, M % 64, N % 64");
  // Rows [0, split) of each expert's output go to out, the rest to out2 (as many rows again).
  check(args.out2 == nullptr || (args.split % 64 == 0 && args.m == 2 * args.split), "weight grad split: M = 2 · split, split % 64");
  constexpr int kBlockN = Config<Mode::kWeightGrad>::kBlockN;
  const int64_t out_rows = args.out2 ? args.split : args.m;
  Maps m;
  m.a = m.a_half = m.a_quarter = m.a_fold = make_tma_2d_chunks(args.a, args.capacity, args.m, kBlockK, kBlockM / 64);
  m.b0 = m.b1 = m.b_half = make_tma_2d_chunks(args.b, args.capacity, args.n, kBlockK, kBlockN / 64);
  m.c0 = make_tma_3d(args.out, args.experts, out_rows, args.n, 64, 64, L2Fetch::k256B, args.out_stride);
  m.c1 = m.c2 = args.out2
                    ? make_tma_3d(args.out2, args.experts, out_rows, args.n, 64, 64, L2Fetch::k256B, args.out2_stride)
                    : m.c0;
  Params p{};
  p.grid.expert_offset = args.expert_offset;
  p.grid.experts = static_cast<int32_t>(args.experts);
  p.grid.tiles_m = static_cast<int32_t>((args.m + kBlockM - 1) / kBlockM);
  p.grid.tiles_n = static_cast<int32_t>((args.n + kBlockN - 1) / kBlockN);
  p.grid.block_n = kBlockN;
  p.grid.capacity = static_cast<int32_t>(args.capacity);
  p.grid.weight_grad = true;
  p.grid.expert_rows = args.expert_rows;
  p.m = static_cast<int32_t>(args.m);
  p.n = static_cast<int32_t>(args.n);
  p.out_split = args.out2 ? static_cast<int32_t>(args.split) : INT32_MAX;
  p.status = args.status;
  p.in_order = args.in_order;
  p.cluster = 1;
  p.tickets = args.tickets;
  launch<Mode::kWeightGrad>(m, p, args.sm_count, stream);
}

}  // namespace lynx::gemm
