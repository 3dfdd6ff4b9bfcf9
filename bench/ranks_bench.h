// lynx-bench --ranks: one global problem on R = 1, 2, 4, ... virtual ranks of this GPU, each R checked
// bit for bit against R = 1 and timed in the same run, with the bytes the ranks move between them.
#pragma once

#include <string>
#include <vector>

#include "gpu_clock.h"
#include "problem.h"
#include "regime.h"

namespace lynx::bench {

// Bytes read from another rank's memory in one pass, over all ranks.
struct RankTraffic {
  int64_t remote_rows = 0;     // routed rows whose expert lives on another rank than their token
  int64_t forward_bytes = 0;   // the x rows (or tiles) pulled, the expert outputs pulled back, the routing read
  int64_t backward_bytes = 0;  // the dy rows pulled, the dx rows pulled back, weights and d_topk_weights
};

// From the routing alone (host ids of all R·T tokens). In FP8 the x and dy rows travel as 1×128 tiles
// (a byte an element, 4 bytes a tile), the expert outputs and dx rows in bf16 as ever.
RankTraffic rank_traffic(const LayerShape& global, const std::vector<int32_t>& ids, int32_t R,
                         Precision precision = Precision::kBf16);

struct RanksRow {
  int32_t ranks;
  std::string pass;  // forward | backward | forward+backward
  double ms;
  double enqueue_ms;  // host time to enqueue one timed pass (median over the rounds)
  ClockSummary clocks;
  RankTraffic traffic;
  std::string check;  // "bitwise = R=1" or what differs
};

// `ranks` in the order given; each R needs E and T divisible by it. Rounds interleave the R values:
// each row's ms is the median over the rounds of each round's median. In `precision` (FP8: each rank's
// weights quantised once, before the check). With `graph`, each R's forward and backward are captured
// once into CUDA graphs on a stream of their own and timed as replays; a replayed forward+backward
// must then give the first R's bits again.
std::vector<RanksRow> time_ranks(Problem& p, const std::vector<int32_t>& ranks, const std::vector<std::string>& passes,
                                 const Protocol& protocol, int rounds, const GpuClock* clock,
                                 Precision precision = Precision::kBf16, bool graph = false);

}  // namespace lynx::bench
