// What a rank process (rank_process.cpp) and the test that starts it (test_rank_processes.cpp) agree
// on: the case, dy, and the byte layout of a rank's outputs.
#pragma once

#include <cstring>
#include <vector>

#include "gpu/ranks_check.h"

namespace lynx::test {

inline Case process_case() { return Case{256, 128, 128, 8, 2, 64}; }

// dy from the seed: every process draws the same.
inline std::vector<HostBf16> process_dy(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x5eedULL);
  return random_bf16(rng, c.T * c.H, 1.0);
}

// Rank r's y and dx rows, d_topk_weights, its experts' dw_gate, dw_up, dw_down and (with a shared
// expert) its shared expert's gradients over its tokens, in this order, as raw bytes.
inline std::vector<uint8_t> encode_rank_outputs(const HostLayer& L, const OutputBuffers& global, const RankSlice& s,
                                                int32_t R, int32_t r) {
  const Case& c = L.c;
  const Outputs o = global.to_host_outputs();
  const int64_t T = c.T / R, E_loc = c.E / R;
  std::vector<uint8_t> out;
  const auto put = [&](const void* p, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + bytes);
  };
  put(o.y.data() + r * T * c.H, 2 * T * c.H);
  put(o.dx.data() + r * T * c.H, 2 * T * c.H);
  const std::vector<float> dtk = to_host<float>(s.d_topk, T * c.k);
  put(dtk.data(), 4 * T * c.k);
  put(o.dw_gate.data() + r * E_loc * c.I * c.H, 2 * E_loc * c.I * c.H);
  put(o.dw_up.data() + r * E_loc * c.I * c.H, 2 * E_loc * c.I * c.H);
  put(o.dw_down.data() + r * E_loc * c.H * c.I, 2 * E_loc * c.H * c.I);
  if (c.Is > 0) {
    for (const DeviceBuffer* b : {&s.dws_gate, &s.dws_up, &s.dws_down}) {
      const std::vector<HostBf16> v = to_host<HostBf16>(*b, c.Is * c.H);
      put(v.data(), 2 * c.Is * c.H);
    }
  }
  return out;
}

// The shared expert's gradients summed over the ranks (each rank's covers its own tokens), in double.
struct SharedSums {
  std::vector<double> gate, up, down;
};

// The sums, rounded to bf16, within the tolerance of one rank's (a sum of R roundings); nothing without
// a shared expert.
inline void expect_shared_sums_near(const SharedSums& s, const Outputs& want) {
  if (s.gate.empty()) return;
  const auto rounded = [](const std::vector<double>& v) {
    std::vector<HostBf16> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = float_to_bf16(float(v[i]));
    return out;
  };
  EXPECT_LT(rel_error(rounded(s.gate), to_double_vec(want.dws_gate), "dws_gate"), kTolerance);
  EXPECT_LT(rel_error(rounded(s.up), to_double_vec(want.dws_up), "dws_up"), kTolerance);
  EXPECT_LT(rel_error(rounded(s.down), to_double_vec(want.dws_down), "dws_down"), kTolerance);
}

// Places rank r's encoded outputs into `o` (sized for the global case), and adds its shared expert's
// gradients to `shared` (when given, and there is a shared expert).
inline void decode_rank_outputs(const Case& c, int32_t R, int32_t r, const std::vector<uint8_t>& bytes, Outputs& o,
                                SharedSums* shared = nullptr) {
  const int64_t T = c.T / R, E_loc = c.E / R;
  size_t at = 0;
  const auto get = [&](void* p, size_t n) {
    if (at + n > bytes.size()) throw std::runtime_error("rank " + std::to_string(r) + "'s outputs are short");
    std::memcpy(p, bytes.data() + at, n);
    at += n;
  };
  get(o.y.data() + r * T * c.H, 2 * T * c.H);
  get(o.dx.data() + r * T * c.H, 2 * T * c.H);
  get(o.d_topk.data() + r * T * c.k, 4 * T * c.k);
  get(o.dw_gate.data() + r * E_loc * c.I * c.H, 2 * E_loc * c.I * c.H);
  get(o.dw_up.data() + r * E_loc * c.I * c.H, 2 * E_loc * c.I * c.H);
  get(o.dw_down.data() + r * E_loc * c.H * c.I, 2 * E_loc * c.H * c.I);
  if (c.Is == 0) return;
  SharedSums ignored;
  SharedSums& into = shared ? *shared : ignored;
  std::vector<HostBf16> part(c.Is * c.H);
  for (std::vector<double>* sum : {&into.gate, &into.up, &into.down}) {
    get(part.data(), 2 * c.Is * c.H);
    sum->resize(part.size(), 0.0);
    for (size_t i = 0; i < part.size(); ++i) (*sum)[i] += to_double(part[i]);
  }
}

}  // namespace lynx::test
