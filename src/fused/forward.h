// The fused forward path (R = 1): the dispatch steps, then the routed experts as two persistent
// TMA + wgmma kernels that read the schedule from device memory (gate/up with SwiGLU in the epilogue,
// then down), then the combine. No host synchronisation anywhere: capturable in a CUDA graph.
// Errors found on the device (routing, schedule capacity) leave y unwritten and are reported by
// Workspace::check().
#pragma once

#include "api/workspace_impl.h"
#include "fused/expert_gemm.h"

namespace lynx::fused {

// The fields of ExpertGemmArgs that come from the workspace (schedule, status, SM count).
ExpertGemmArgs expert_gemm_args(const Workspace::Impl& w);

// Makes the launch of `a` gather its A rows (into a.a, schedule order) from `rows` ([T, K]) itself.
void gather_rows_in(ExpertGemmArgs& a, const Workspace::Impl& w, const TensorView& rows);

// Where a launch whose rows each feed `products_per_row` output columns gets its rows gathered:
// token-major by a kernel before it, by the launch itself, or (LYNX_GEMM_GATHER=0, a sweep switch) by
// the row-major kernel before it. The test hook, then LYNX_GEMM_GATHER_TOKENS, then
// gather_token_major (fused/gather_plan.h) decide between the first and the others.
enum class GatherPlace { kTokenKernel, kInGemm, kRowKernel };
GatherPlace gather_place(const Workspace::Impl& w, int64_t products_per_row);

// Queues the gather of `rows` ([T, K]) into `dst` (schedule order) for kTokenKernel and kRowKernel;
// nothing for kInGemm (gather_rows_in then).
void queue_gather_kernel(GatherPlace place, const Workspace::Impl& w, const TensorView& rows, bf16_t* dst,
                         cudaStream_t s);

void forward(Workspace::Impl& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream);
void recompute_forward_context(Workspace::Impl& ws, const LayerInputs& in, cudaStream_t stream);

}  // namespace lynx::fused
