// Routings for the schedule tests (CPU and GPU): every rank's [T, k] ids.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/schedule/api.h"

namespace lynx::sched::test {

// Every rank's [T, k] ids (the global expert of (t, j)), distinct within a token. With `hot` >= 0,
// about `hot_share` percent of source s's tokens have j = 0 on expert (hot + s * hot_step) % E: unequal
// counts from the sources to one expert (hot_step 1), or every token on one expert (100%, step 0).
struct Routing {
  int32_t R = 1;
  int64_t T = 0, k = 0, E = 0;
  std::vector<std::vector<int32_t>> ids;  // [R][T*k]
  std::vector<const int32_t*> ptrs;       // ids[s].data(), for build_schedule_host

  Routing(int32_t R_, int64_t T_, int64_t k_, int64_t E_, uint32_t seed, int64_t hot = -1, int hot_share = 0,
          int64_t hot_step = 1)
      : R(R_), T(T_), k(k_), E(E_), ids(R_) {
    std::mt19937 rng(seed);
    std::vector<int32_t> perm(E);
    for (int64_t e = 0; e < E; ++e) perm[e] = int32_t(e);
    for (int32_t s = 0; s < R; ++s) {
      ids[s].resize(T * k);
      for (int64_t t = 0; t < T; ++t) {
        int64_t first = 0;
        if (hot >= 0 && int(rng() % 100) < hot_share) {
          const int32_t h = int32_t((hot + s * hot_step) % E);
          std::swap(perm[0], *std::find(perm.begin(), perm.end(), h));
          first = 1;
        }
        for (int64_t j = first; j < k; ++j) std::swap(perm[j], perm[j + rng() % (E - j)]);
        for (int64_t j = 0; j < k; ++j) ids[s][t * k + j] = perm[j];
      }
    }
    refresh();
  }
  // ptrs point into this object's ids: a copy would point into the original's.
  Routing(const Routing&) = delete;
  Routing& operator=(const Routing&) = delete;
  // After ids changed size.
  void refresh() {
    ptrs.clear();
    for (auto& v : ids) ptrs.push_back(v.data());
  }

  int64_t entries() const { return T * k; }
  int64_t local_experts() const { return E / R; }
  int64_t worst_case_capacity() const {
    const int64_t routed = R * T * k;
    return (routed + std::min(local_experts(), routed) * 127 + 127) / 128 * 128;
  }
  Problem problem(int32_t rank, int64_t capacity) const {
    Problem p;
    p.num_ranks = R;
    p.rank = rank;
    p.tokens = T;
    p.top_k = k;
    p.num_experts = E;
    p.capacity = capacity;
    return p;
  }
  HostSchedule host(int32_t rank, int64_t capacity, HostResult* result = nullptr) const {
    HostSchedule out;
    const HostResult res = build_schedule_host(problem(rank, capacity), ptrs.data(), out);
    if (result) *result = res;
    return out;
  }
};

}  // namespace lynx::sched::test
