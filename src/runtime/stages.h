// The stages of a layer call. In the experiments build (CMake option LYNX_EXPERIMENTS) only,
// LYNX_OMIT=stage[,stage...] leaves the named stages out of every layer call, so that timing a pass
// with and without a stage, in the same process state and at the same power cap, shows what the
// stage costs within the pass (tools/gpu-breakdown, docs/performance.md). A pass with stages left
// out computes wrong results; it is for timing only. Stages in the steps both paths share (gather,
// shared expert, combine) are left out of the unfused path too. The schedule cannot be left out: the
// GEMMs' tile counts come from it.
#pragma once

#include <cstdint>
#include <string>

namespace lynx {

enum class Stage : uint32_t {
  kGather,          // forward: x rows into schedule order (in the fused path, inside the gate/up GEMM,
                    // which then reads the rows of the call before)
  kSharedForward,   // forward: the shared expert
  kGateUp,          // forward: the gate/up GEMM with SwiGLU (and, in the fused path, the gather inside it;
                    // FP8: h's quantisation in its epilogue)
  kDown,            // forward: the down GEMM
  kCombine,         // forward: the combine into y
  kDyGather,        // backward: dy rows into schedule order (fused: inside the da GEMM, so leaving
                    // that GEMM out leaves this out too; FP8's at one rank likewise, all but dy's
                    // quantisation and its tiles' scales, which come before it). Its buffer is the
                    // forward's down output and the per-row dx too, so without it the da GEMM reads
                    // the last of those.
  kDgradDown,       // backward: da = dy_row · w_down
  kSwigluBackward,  // backward: dg, du and d_topk_weights
  kDgradGateUp,     // backward: dx_row = [dg | du] · [w_gate; w_up]
  kDxCombine,       // backward: the combine into dx
  kXGather,         // backward, one rank: x rows into schedule order again, for dw_gate and dw_up
  kWgradGateUp,     // backward: dw_gate and dw_up
  kWgradDown,       // backward: dw_down
  kSharedBackward,  // backward: the shared expert
  kCount
};

#if LYNX_EXPERIMENTS
// The stages of a comma-separated list of names (as stage_name gives them), as a bit set; throws
// lynx::Error naming the first unknown name. Empty list: none.
uint32_t parse_omitted_stages(const std::string& list);

const char* stage_name(Stage s);

// Whether to leave `s` out of this call: LYNX_OMIT (read once per process) names it and the workspace
// has already run the stage's pass `calls_before` times. NOTES: the first call of each pass runs in
// full, so a stage left out later leaves its output buffer holding the values it computed then, which
// for the benchmark's repeated inputs are the values it would compute now, except in the buffers two
// stages write (rows a: the dy rows, then the per-row dx; da, then w·silu(g)⊙u; FP8 at one rank, f8.x:
// dy's tiles, then x's), which then hold the other stage's values: finite, of the same magnitudes, not
// the same data. Left out from the first call, the downstream kernels computed on never-written (zero)
// memory, and under the power cap zero operands ran faster: at deepseek-v3 leaving out the 0.31 ms
// gather saved 0.68 ms (measured 2026-11-29, commit 27164ab).
bool omitted(Stage s, int64_t calls_before);
#else
constexpr bool omitted(Stage, int64_t) { return false; }
#endif

}  // namespace lynx
