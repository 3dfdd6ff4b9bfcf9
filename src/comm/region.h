// The shared region: every buffer of a rank that other ranks read or write, in one device allocation
// (so one CUDA IPC handle exports it), laid out the same on every rank of a group. The transports
// (transport.h) give each rank the base of every rank's region; the kernels see, per buffer, a device
// table of R pointers (common/peers.h).
#pragma once

#include <cstdint>
#include <vector>

#include "lynx/config.h"

namespace lynx::comm {

// Byte offsets from the region's base.
struct RegionLayout {
  int64_t status;       // DeviceStatus (this rank's; peers read the copy in the signals)
  int64_t signals;      // peer::Signals: the barriers' counters
  int64_t ids32;        // [T*k] int32: this rank's checked ids (the schedule builds read every rank's)
  int64_t slot_row;     // [T*k] int32: row of (t, j) on the rank that computes it (that rank writes it)
  int64_t weights;      // [T*k] fp32: this rank's router weights (the SwiGLU backward reads them)
  int64_t d_topk_rows;  // [cap] fp32: d_topk_weights of this rank's rows (their sources pull them)
  int64_t token_rows;   // [T, H] bf16: x in forward, dy in backward (pulled by the ranks that need the rows);
                        // FP8: their 1×128 tiles, bytes [T, H] then fp32 scales [T, H/128↑] (fit: H >= 64)
  int64_t rows_a;       // [cap, H] bf16: forward's expert outputs (pulled by the combines)
  int64_t rows_b;       // [cap, H] bf16: backward's per-row dx (pulled by the dx combines); rows_a's
                        // offset unless RegionContents::rows_b_apart
  int64_t bytes;        // the whole region
};

// What the region holds besides what every rank holds. At R = 1 nothing is shared, but the region holds
// the buffers all the same (ids32, token_rows, weights and d_topk_rows take no space: the ids are
// scratch), rows_a and rows_b unless `rows` is false (they are then scratch a call takes:
// Config::scratch_allocator), slot_row unless `slot_row` is false (a caller's forward context holds it).
// At R > 1 every buffer is there whatever those two flags say: the other ranks read the rows and write
// slot_row (a caller's context keeps a copy of it). At any R, rows_b lies on rows_a unless
// `rows_b_apart` (the fused backward is done with its dy rows, rows_a, before its per-row dx fill rows_b;
// each is read by other ranks only in a close step, after the barrier that ends the pass's compute).
struct RegionContents {
  bool rows = true;
  bool slot_row = true;
  bool rows_b_apart = true;
};
RegionLayout region_layout(const LayerShape& shape, int64_t capacity, const RegionContents& contents = {});

// The device tables, each R pointers: table t of rank s at [t * R + s].
enum Table : int32_t { kTokenRows, kWeights, kSlotRow, kRowsA, kRowsB, kDTopkRows, kSignals, kTables };

// The tables for regions at `bases` (every rank's, as this rank addresses them), as host values.
std::vector<void*> peer_tables(const RegionLayout& layout, const std::vector<char*>& bases);

}  // namespace lynx::comm
