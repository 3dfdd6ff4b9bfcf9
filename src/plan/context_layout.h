// The forward context's buffers (what backward reads of its forward) and the block a caller's
// lynx::ForwardContext needs for them: a workspace places them in this order, each rounded up to 1 KB
// (runtime/workspace.h, LentBlock), and checks that its block is this size. A forward that keeps no
// context is lent only the block's start (forward_only_bytes).
#pragma once

#include <cstdint>

#include "lynx/config.h"

namespace lynx::plan {

// Bytes of each buffer, in placement order.
struct ContextSizes {
  int64_t row_token_slot, row_src_rank, expert_offset, expert_rows, block_offset, half_block_offset, slot_row;  // the schedule
  int64_t gs, us;    // the shared expert's gate and up products (0 without one)
  int64_t xg, g, u;  // gathered x rows (R > 1 only; one rank gathers them again), gate and up products
};

// Whether the gate and up products are kept by slot, [T·k, I] (t·k + j: one rank, fused backend), or
// by schedule row, [capacity, I] (padding rows included).
// NOTES: by slot the context holds no padding rows: 192 MiB at qwen3-30b-a3b where the capacity's
// rows took 240 (each expert's rows are padded to whole 128-row blocks, and the capacity is sized for
// the worst padding). At R > 1 a row's slot is its source rank's, so rows of two ranks share slots;
// the unfused backend's cuBLAS GEMMs write by row.
bool gate_up_by_slot(const LayerShape& shape, Backend backend);

ContextSizes context_sizes(const LayerShape& shape, int64_t capacity, Backend backend);

// One buffer's share of a lent block.
constexpr int64_t lent_bytes(int64_t bytes) { return (bytes + 1023) / 1024 * 1024; }

int64_t context_block_bytes(const ContextSizes& s);

// The start of the block that a forward keeping no context writes and reads: the schedule and the shared
// expert's products, and with `gathered_rows` the gathered x rows, which the bf16 gate/up GEMM reads at
// R > 1 (FP8 gathers x's tiles into scratch). g and u lie last so that such a forward needs none of their
// bytes (192 MiB of the 192.6 at qwen3-30b-a3b, one rank).
int64_t forward_only_bytes(const ContextSizes& s, bool gathered_rows);

}  // namespace lynx::plan
