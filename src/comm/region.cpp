#include "comm/region.h"

#include "common/status.h"
#include "kernels/peer/api.h"

namespace lynx::comm {
namespace {

// NOTES: 1 KB alignment keeps every buffer on the TMA's and the 16-byte vector loads' boundaries.
constexpr int64_t kAlign = 1024;

struct Cursor {
  int64_t at = 0;
  int64_t take(int64_t bytes) {
    const int64_t here = at;
    at += (bytes + kAlign - 1) / kAlign * kAlign;
    return here;
  }
};

}  // namespace

RegionLayout region_layout(const LayerShape& s, int64_t cap, const RegionContents& contents) {
  const bool shared = s.num_ranks > 1;
  const int64_t entries = s.tokens * s.top_k;
  Cursor c;
  RegionLayout l{};
  l.status = c.take(sizeof(DeviceStatus));
  l.signals = c.take(sizeof(peer::Signals));
  l.ids32 = c.take(shared ? 4 * entries : 0);
  l.slot_row = c.take(shared || contents.slot_row ? 4 * entries : 0);
  l.weights = c.take(shared ? 4 * entries : 0);
  l.d_topk_rows = c.take(shared ? 4 * cap : 0);
  l.token_rows = c.take(shared ? 2 * s.tokens * s.hidden : 0);
  const int64_t rows = shared || contents.rows ? 2 * cap * s.hidden : 0;
  l.rows_a = c.take(rows);
  l.rows_b = contents.rows_b_apart ? c.take(rows) : l.rows_a;
  l.bytes = c.at;
  return l;
}

std::vector<void*> peer_tables(const RegionLayout& l, const std::vector<char*>& bases) {
  const size_t R = bases.size();
  std::vector<void*> t(kTables * R);
  for (size_t s = 0; s < R; ++s) {
    char* b = bases[s];
    t[kTokenRows * R + s] = b + l.token_rows;
    t[kWeights * R + s] = b + l.weights;
    t[kSlotRow * R + s] = b + l.slot_row;
    t[kRowsA * R + s] = b + l.rows_a;
    t[kRowsB * R + s] = b + l.rows_b;
    t[kDTopkRows * R + s] = b + l.d_topk_rows;
    t[kSignals * R + s] = b + l.signals;
  }
  return t;
}

}  // namespace lynx::comm
