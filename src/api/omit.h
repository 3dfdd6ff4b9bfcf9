// A benchmark aid: LYNX_OMIT=stage[,stage...] leaves the named stages out of every layer call, so that
// timing a pass with and without a stage, in the same process state and at the same power cap, shows
// what the stage costs within the pass (docs/forward.md, docs/backward.md). A pass with stages left
// out computes wrong results; it is for timing only. Stages in the steps both paths share (gather,
// shared expert, combine) are left out of the unfused path too. The schedule cannot be left out: the
// GEMMs' tile counts come from it.
#pragma once

#include <cstdint>
#include <string>

namespace lynx {

enum class Stage : uint32_t {
  kGather,          // forward: x rows into schedule order
  kSharedForward,   // forward: the shared expert
  kGateUp,          // forward: the gate/up GEMM with SwiGLU
  kDown,            // forward: the down GEMM
  kCombine,         // forward: the combine into y
  kDyGather,        // backward: dy rows into schedule order
  kDgradDown,       // backward: da = dy_row · w_down
  kSwigluBackward,  // backward: dg, du and d_topk_weights
  kDgradGateUp,     // backward: dx_row = [dg | du] · [w_gate; w_up]
  kDxCombine,       // backward: the combine into dx
  kWgradGateUp,     // backward: dw_gate and dw_up
  kWgradDown,       // backward: dw_down
  kSharedBackward,  // backward: the shared expert
  kCount
};

// The stages of a comma-separated list of names (as stage_name gives them), as a bit set; throws
// lynx::Error naming the first unknown name. Empty list: none.
uint32_t parse_omitted_stages(const std::string& list);

const char* stage_name(Stage s);

// Whether LYNX_OMIT names `s` (read once per process).
bool omitted(Stage s);

}  // namespace lynx
