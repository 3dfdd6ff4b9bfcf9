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

// Rank r's y and dx rows, d_topk_weights, its experts' dw_gate, dw_up, dw_down and its shared expert
// gradients, in this order, as raw bytes.
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
  return out;
}

// Places rank r's encoded outputs into `o` (sized for the global case).
inline void decode_rank_outputs(const Case& c, int32_t R, int32_t r, const std::vector<uint8_t>& bytes, Outputs& o) {
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
}

}  // namespace lynx::test
