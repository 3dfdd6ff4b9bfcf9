// How a kernel addresses the R ranks' copies of a shared buffer at R > 1: a device array of R base
// pointers (the transport fills it, comm/), indexed by the source rank of each schedule row.
#pragma once

#include <cstdint>

#include "common/hd.h"

namespace lynx {

// Schedule row `row` of this rank came from rank row_src_rank[row], whose copy of the buffer starts at
// base[row_src_rank[row]]. Null `base`: one rank, the buffer the call names is the only one.
struct RowSources {
  const void* const* base = nullptr;     // [R] device
  const int32_t* row_src_rank = nullptr; // [capacity] device (the schedule's)

  LYNX_HD bool remote() const { return base != nullptr; }
};

// What the combine pulls at R > 1: the row of (t, j) lives in the rows buffer of the rank that owns
// expert topk_ids[t, j], at the row that rank wrote into this rank's slot_row.
struct CombineSources {
  const void* const* rows = nullptr;       // [R] device: each rank's per-row results (bf16 [cap, H])
  const int32_t* ids32 = nullptr;          // [T*k] device: this rank's checked ids (global experts)
  int32_t local_experts = 0;               // E / R: expert e lives on rank e / local_experts
  const float* const* d_topk_rows = nullptr;  // [R] device: each rank's per-row d_topk_weights, or null
  float* d_topk_weights = nullptr;         // [T*k] device: where this rank's d_topk_weights go, or null: at
                                          // R > 1 every one (pulled); at R = 1 the 0 of each slot not routed
};

}  // namespace lynx
