// The benchmark's correctness check against the double-precision CPU reference. The reference is
// computed once per problem; each path then writes into outputs poisoned with NaN (poison_outputs) and
// is compared with it (check_outputs), so an output a path leaves unwritten fails.
// Checked: the rows of y, dx and d_topk_weights of a spread of tokens (the full reference is too slow
// at benchmark shapes), and the weight gradients of a few experts and of the shared expert, each over
// every row routed to it (a weight gradient depends on all of them), on a bounded set of its
// intermediate units.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "problem.h"

namespace lynx::bench {

struct CheckResult {
  double y = -1, dx = -1, d_topk = -1;  // relative Frobenius errors over the checked rows (-1: not checked)
  double dw = -1;  // the worst relative Frobenius error of the checked weight gradients (-1: not checked)
  bool ok = false;
  std::string summary() const;
};

constexpr double kCheckTolerance = 1e-2;

// Up to this many experts' weight gradients are checked: the first ones of the first checked token.
constexpr int kCheckedExperts = 3;

// The reference of one checked token's rows.
struct RowReference {
  int64_t token;
  std::vector<double> y, dx, d_topk;  // [H], [H], [k] (dx, d_topk empty without backward)
};

// One FFN's reference weight gradients, over `units` of its intermediate dimension: those rows of its
// gate and up gradients, those columns of its down gradient.
struct FfnReference {
  int64_t expert;  // -1: the shared expert
  int64_t rows;    // routed rows (for the shared expert: every token)
  int64_t width;   // its intermediate size
  std::vector<int64_t> units;
  std::vector<double> gate, up;  // [units, H]
  std::vector<double> down;      // [H, units]
};

struct CheckReference {
  bool with_backward = false;
  std::vector<RowReference> rows;
  std::vector<FfnReference> ffns;  // empty without backward
  std::string describe() const;    // what is checked, for the report
};

// The reference of y (and, with_backward, of dx, d_topk_weights and the weight gradients) for `tokens`
// tokens spread over [0, T). Host threads; bounded by kCheckedExperts and the units per FFN.
CheckReference check_reference(const Problem& p, int tokens, bool with_backward);

// NaN into every output the check reads: y, dx, d_topk_weights and every weight gradient.
void poison_outputs(const Problem& p);

// Compares the outputs a path computed (stream synchronised) with the reference.
CheckResult check_outputs(const Problem& p, const CheckReference& want);

}  // namespace lynx::bench
