// The block-scaled FP8 GEMMs' host side (api.h: gemm_block_scaled and its grouped forms over the
// experts' rows): argument checks, tensor maps and launches of the kernel in gemm/kernel.cuh.
#include <cuda.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/cuda_check.h"
#include "common/kernel_loading.h"
#include "common/per_device.h"
#include "kernels/expert_gemm/tma.h"
#include "kernels/fp8/api.h"
#include "kernels/fp8/gemm/kernel.cuh"
#include "lynx/error.h"

namespace lynx::fp8 {
namespace {

using namespace impl;

void check_sizes(int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0 || K <= 0) throw Error("fp8 gemm", "M, N and K must be positive");
  if (K % 16 != 0) throw Error("K", "must be a multiple of 16 (the TMA's row stride alignment), got " + std::to_string(K));
  if (M > INT32_MAX / 2 || N > INT32_MAX / 2 || K > INT32_MAX / 2) throw Error("fp8 gemm", "a dimension is too large");
}

template <Form kForm, class Out, int kGather = kGatherNone>
void launch(const CUtensorMap& tma_a, const CUtensorMap& tma_b, const CUtensorMap& tma_b2, const float* a_scales,
            const float* b_scales, const float* b2_scales, const CUtensorMap& tma_out, const CUtensorMap& tma_out2,
            Out* out, int64_t M, int64_t N, int64_t K, const int32_t* expert_offset, int64_t experts,
            DeviceStatus* status, cudaStream_t stream, KeptGateUp kept = {}, int32_t split = 0,
            const SwiGLUOutputs& swiglu = {}, const gemm::RowGather& gather = {}, const RowSources& sources = {},
            bool pair_rows = false) {
  // With N even the dense form stores two adjacent columns at once (store_pair): its output is then
  // aligned to two elements.
  if constexpr (kForm == Form::kDense) {
    if (N % 2 == 0 && reinterpret_cast<uintptr_t>(out) % (2 * sizeof(Out)) != 0) {
      throw Error("out", "must be aligned to two elements (N is even: the columns are stored in pairs)");
    }
  }
  // The attribute and the SM count are per device: looked up once on each.
  static detail::PerDeviceCache configured, sm_count;
  detail::per_device(configured, [](int) {
    LYNX_CUDA(cudaFuncSetAttribute(gemm_kernel<kForm, Out, kGather>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   kSmem<kForm>));
    return 1;
  });
  const int sms = detail::per_device(sm_count, [](int device) {
    int n = 0;
    LYNX_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  });
  // At most one CTA per SM (one fits), each taking tiles in turn; the grouped forms' tiles past the
  // schedule's rows are not counted by the kernel, so some CTAs may find none.
  const int64_t out_n = kOutN<kForm>;
  const int64_t tiles = (N + out_n - 1) / out_n * blocks_of(M) * (kForm == Form::kWeightGrad ? experts : 1);
  if (tiles > INT32_MAX - sms) throw Error("fp8 gemm", "more than 2^31 tiles");  // t += gridDim.x stays an int32
  // With pair_rows an even grid, so that the CTAs of each pair of tiles (2u, 2u + 1) stay side by side
  // in every round (tiles.h).
  const int64_t ctas = std::min<int64_t>(tiles, sms);
  const dim3 grid(unsigned(pair_rows && ctas > 1 ? ctas & ~int64_t(1) : ctas));
  gemm_kernel<kForm, Out, kGather><<<grid, kThreads, kSmem<kForm>, stream>>>(
      tma_a, tma_b, tma_b2, a_scales, b_scales, b2_scales, tma_out, tma_out2, out, int32_t(M), int32_t(N), int32_t(K),
      expert_offset, int32_t(experts), status, kept, split, swiglu, gather, sources, pair_rows);
  LYNX_CUDA(cudaGetLastError());
}

// The bf16 outputs go out by TMA stores with the 128-byte swizzle (rows of N in 16-byte pieces, the
// tensor 128-byte aligned, as validate.cpp's NOTES say) and, kept g and u, in 16-byte chunks by slot.
struct Bf16Output {
  const void* p;
  const char* what;
  uintptr_t alignment;
};
void check_bf16_outputs(int64_t N, std::initializer_list<Bf16Output> outputs) {
  if (N % 8 != 0) {
    throw Error("N", "must be a multiple of 8 (bf16 output rows are stored in 16-byte pieces), got " + std::to_string(N));
  }
  for (const Bf16Output& o : outputs) {
    if (o.p != nullptr && reinterpret_cast<uintptr_t>(o.p) % o.alignment != 0) {
      throw Error(o.what, "must be " + std::to_string(o.alignment) + "-byte aligned");
    }
  }
}

void check_grouped(int64_t capacity, int64_t experts, const int32_t* expert_offset) {
  if (capacity % kTileM != 0) throw Error("capacity", "must be a multiple of 128, got " + std::to_string(capacity));
  if (experts <= 0 || experts > INT32_MAX / 2) throw Error("experts", "must be positive");
  if (expert_offset == nullptr) throw Error("expert_offset", "is null");
}

// A grouped form's in-kernel gather (TileGather, on) of K-byte rows into a, checked: the gather copies
// 16-byte pieces of them, which the TMA then reads.
gemm::RowGather row_gather(const TileGather& gather, const uint8_t* a, int64_t K) {
  if (gather.row_token_slot == nullptr || gather.sync == nullptr || gather.top_k <= 0 || gather.lookahead < 1) {
    throw Error("gather", "row_token_slot, sync, top_k and a lookahead of one row block at least are needed");
  }
  if (gather.sources.remote() && gather.sources.row_src_rank == nullptr) {
    throw Error("gather.sources", "row_src_rank is needed with remote sources");
  }
  if (K % 16 != 0 || reinterpret_cast<uintptr_t>(a) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(gather.tokens) % 16 != 0) {
    throw Error("gather", "a and the token tiles must be 16-byte aligned, with K % 16 == 0");
  }
  gemm::RowGather g{};
  g.src = reinterpret_cast<const uint4*>(gather.tokens);
  g.dst = reinterpret_cast<uint4*>(const_cast<uint8_t*>(a));
  g.row_token_slot = gather.row_token_slot;
  g.top_k = int32_t(gather.top_k);
  g.vecs = int32_t(K / 16);
  g.lookahead = gather.lookahead;
  g.sync = gather.sync;
  g.awaited = true;
  return g;
}

}  // namespace

void gemm_block_scaled(const uint8_t* a, const float* a_scales, int64_t M, int64_t K, const uint8_t* b,
                       const float* b_scales, int64_t N, float* out, DeviceStatus* status, cudaStream_t stream) {
  check_sizes(M, N, K);
  const CUtensorMap tma_b = gemm::make_tma_2d_bytes(b, N, K, kTileN);
  launch<Form::kDense>(gemm::make_tma_2d_bytes(a, M, K, kTileM), tma_b, tma_b, a_scales, b_scales, nullptr,
                       CUtensorMap{}, CUtensorMap{}, out, M, N, K, nullptr, 0, status, stream);
}

void grouped_gemm_block_scaled(const uint8_t* a, const float* a_scales, int64_t capacity, int64_t K,
                               const uint8_t* b, const float* b_scales, int64_t experts, int64_t N,
                               const int32_t* expert_offset, bf16_t* out, DeviceStatus* status, cudaStream_t stream,
                               const TileGather& gather, bool pair_rows) {
  check_sizes(capacity, N, K);
  check_grouped(capacity, experts, expert_offset);
  check_bf16_outputs(N, {{out, "out", 128}});
  if (gather.sources.remote()) {
    throw Error("gather.sources", "the grouped form gathers this rank's token tiles only (R = 1), not remote ones");
  }
  const CUtensorMap tma_a = gemm::make_tma_2d_bytes(a, capacity, K, kTileM);
  const CUtensorMap tma_b = gemm::make_tma_3d_bytes(b, experts, N, K, kTileN);
  const CUtensorMap tma_out = gemm::make_tma_2d(out, capacity, N, 64, 64);
  if (!gather.on()) {
    launch<Form::kGrouped>(tma_a, tma_b, tma_b, a_scales, b_scales, nullptr, tma_out, tma_out, out, capacity, N, K,
                           expert_offset, experts, status, stream, {}, 0, {}, {}, {}, pair_rows);
    return;
  }
  launch<Form::kGrouped, bf16_t, kGatherLocal>(tma_a, tma_b, tma_b, a_scales, b_scales, nullptr, tma_out, tma_out, out,
                                               capacity, N, K, expert_offset, experts, status, stream, {}, 0, {},
                                               row_gather(gather, a, K), {}, pair_rows);
}

void grouped_swiglu_block_scaled(const uint8_t* a, const float* a_scales, int64_t capacity, int64_t K,
                                 const uint8_t* gate, const float* gate_scales, const uint8_t* up,
                                 const float* up_scales, int64_t experts, int64_t N, const int32_t* expert_offset,
                                 bf16_t* h, DeviceStatus* status, cudaStream_t stream, KeptGateUp kept,
                                 const QuantizedH& hq, const TileGather& gather, bool pair_rows) {
  check_sizes(capacity, N, K);
  check_grouped(capacity, experts, expert_offset);
  if (kept.gate != nullptr && (kept.up == nullptr || kept.slot == nullptr)) {
    throw Error("kept", "gate, up and slot are given together or not at all");
  }
  if (h == nullptr && hq.codes == nullptr && kept.gate == nullptr) {
    throw Error("h", "is null, and nothing else is asked");
  }
  check_bf16_outputs(
      N, {{h, "h", 128}, {kept.gate, "kept.gate", 16}, {kept.up, "kept.up", 16}, {kept.slot, "kept.slot", 16}});
  SwiGLUOutputs outputs;
  outputs.store_h = h != nullptr;
  if (hq.codes != nullptr) {
    // The codes go out in 16-byte chunks of a row: rows of N bytes, 16-byte aligned.
    if (N % 16 != 0) throw Error("N", "must be a multiple of 16 where h is quantised, got " + std::to_string(N));
    if (reinterpret_cast<uintptr_t>(hq.codes) % 16 != 0) throw Error("hq.codes", "must be 16-byte aligned");
    if (hq.scales == nullptr) throw Error("hq.scales", "is null");
    outputs.h_codes = hq.codes;
    outputs.h_scales = hq.scales;
    outputs.h_report = hq.report;
  }
  const CUtensorMap tma_h = h != nullptr ? gemm::make_tma_2d(h, capacity, N, 64, 64) : CUtensorMap{};
  const CUtensorMap tma_a = gemm::make_tma_2d_bytes(a, capacity, K, kTileM);
  const CUtensorMap tma_gate = gemm::make_tma_3d_bytes(gate, experts, N, K, kTileN);
  const CUtensorMap tma_up = gemm::make_tma_3d_bytes(up, experts, N, K, kTileN);
  if (!gather.on()) {
    launch<Form::kSwiGLU>(tma_a, tma_gate, tma_up, a_scales, gate_scales, up_scales, tma_h, tma_h, h, capacity, N,
                          K, expert_offset, experts, status, stream, kept, 0, outputs, {}, {}, pair_rows);
    return;
  }
  const gemm::RowGather g = row_gather(gather, a, K);
  if (gather.sources.remote()) {
    launch<Form::kSwiGLU, bf16_t, kGatherRemote>(tma_a, tma_gate, tma_up, a_scales, gate_scales, up_scales, tma_h,
                                                 tma_h, h, capacity, N, K, expert_offset, experts, status, stream,
                                                 kept, 0, outputs, g, gather.sources, pair_rows);
  } else {
    launch<Form::kSwiGLU, bf16_t, kGatherLocal>(tma_a, tma_gate, tma_up, a_scales, gate_scales, up_scales, tma_h,
                                                tma_h, h, capacity, N, K, expert_offset, experts, status, stream,
                                                kept, 0, outputs, g, {}, pair_rows);
  }
}

void grouped_weight_grad_block_scaled(const uint8_t* a, const float* a_scales, int64_t M, const uint8_t* b,
                                      const float* b_scales, int64_t N, int64_t capacity, int64_t experts,
                                      const int32_t* expert_offset, bf16_t* out, bf16_t* out2, int64_t split,
                                      DeviceStatus* status, cudaStream_t stream, BatchStrides out_strides) {
  check_sizes(M, N, capacity);
  check_grouped(capacity, experts, expert_offset);
  if (split <= 0 || split > M || (split < M && (out2 == nullptr || split % 64 != 0))) {
    throw Error("split", "must be M, or a multiple of 64 below M with out2 given, got " + std::to_string(split));
  }
  check_bf16_outputs(N, {{out, "out", 128}, {out2, "out2", 128}});
  // Each K block's scales are copied into shared memory 16 bytes at a time.
  if (reinterpret_cast<uintptr_t>(a_scales) % 16 != 0 || reinterpret_cast<uintptr_t>(b_scales) % 16 != 0) {
    throw Error("a_scales, b_scales", "must be 16-byte aligned");
  }
  if (out_strides.src0 % 8 != 0 || out_strides.src1 % 8 != 0) {
    throw Error("out_strides", "must be multiples of 8 elements (TMA's 16-byte global strides)");
  }
  const CUtensorMap tma_out =
      gemm::make_tma_3d(out, experts, split, N, 64, 64, gemm::L2Fetch::k256B, out_strides.src0);
  const CUtensorMap tma_out2 =
      split < M ? gemm::make_tma_3d(out2, experts, M - split, N, 64, 64, gemm::L2Fetch::k256B, out_strides.src1)
                : tma_out;
  const CUtensorMap tma_b = gemm::make_tma_2d_bytes(b, N, capacity, kTileN);
  launch<Form::kWeightGrad>(gemm::make_tma_2d_bytes(a, M, capacity, kTileM), tma_b, tma_b, a_scales, b_scales, nullptr,
                            tma_out, tma_out2, out, M, N, capacity, expert_offset, experts, status, stream, {},
                            int32_t(split));
}

void load_gemm_kernels() {
  load_module_of(reinterpret_cast<const void*>(&gemm_kernel<Form::kSwiGLU, bf16_t, kGatherRemote>));
}

}  // namespace lynx::fp8
