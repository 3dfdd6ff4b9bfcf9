// The clock regime a timing is taken in, and the order of untimed and timed passes that gives it.
//
// NOTES: an H200 holds its board power at 700 W. A process starts at full clock (1980 MHz) and, once
// tens of milliseconds of tensor-core work have raised the power average, its SM clock settles at
// ~1200-1500 MHz and the layer's passes take 11-20% longer (docs/performance.md, "The layer runs at
// the GPU's power cap"; bench/results/2026-12-04-h200-6cbc9dd-log.txt). A median over back-to-back passes
// therefore depends on what ran before it. The two regimes below fix that: a burst pass starts after
// the GPU has been idle, so it runs at full clock; a sustained pass runs after seconds of the same work,
// inside the cap, as a training step does. `kAsFound` keeps the plain warm-up-then-time order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace lynx::bench {

enum class Regime { kAsFound, kBurst, kSustained };

inline const char* regime_name(Regime r) {
  switch (r) {
    case Regime::kBurst: return "burst";
    case Regime::kSustained: return "sustained";
    case Regime::kAsFound: break;
  }
  return "as-found";
}

// lynx-bench's --regime value: one regime, or "all" for burst and sustained; nothing if unknown.
inline std::optional<std::vector<Regime>> parse_regimes(const std::string& v) {
  if (v == "as-found") return std::vector<Regime>{Regime::kAsFound};
  if (v == "burst") return std::vector<Regime>{Regime::kBurst};
  if (v == "sustained") return std::vector<Regime>{Regime::kSustained};
  if (v == "all") return std::vector<Regime>{Regime::kBurst, Regime::kSustained};
  return std::nullopt;
}

struct Protocol {
  Regime regime = Regime::kAsFound;
  int warmup = 3;          // untimed passes: before the timed ones (as-found, sustained), or before each (burst)
  int iters = 20;          // timed passes
  int idle_ms = 500;       // burst: the GPU idle before each timed pass's warm-up
  int sustain_ms = 3000;   // sustained: at least this long of untimed passes back to back first
};

// Runs `p`'s passes and returns what each timed pass gave, in order.
// - `warm()` runs one pass untimed and waits for it (so the host clock follows the GPU);
// - `timed()` runs one pass, waits for it and returns its timing;
// - `idle(ms)` leaves the GPU idle for ms milliseconds;
// - `now_ms()` reads a host clock in milliseconds.
// Pure in the sense that matters: every effect goes through the four callables (CPU-tested with fakes).
template <class Warm, class Timed, class Idle, class Now>
auto run_protocol(const Protocol& p, Warm&& warm, Timed&& timed, Idle&& idle, Now&& now_ms) {
  std::vector<decltype(timed())> out;
  out.reserve(size_t(p.iters));
  if (p.regime == Regime::kBurst) {
    for (int i = 0; i < p.iters; ++i) {
      idle(p.idle_ms);
      for (int w = 0; w < p.warmup; ++w) warm();
      out.push_back(timed());
    }
    return out;
  }
  if (p.regime == Regime::kSustained) {
    const double t0 = now_ms();
    int warmed = 0;
    while (warmed < p.warmup || now_ms() - t0 < double(p.sustain_ms)) {
      warm();
      ++warmed;
    }
  } else {
    for (int w = 0; w < p.warmup; ++w) warm();
  }
  for (int i = 0; i < p.iters; ++i) out.push_back(timed());
  return out;
}

// The median of `v`, the mean of the middle two for an even count; 0 for none.
template <class T>
double median_of(std::vector<T> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? double(v[n / 2]) : 0.5 * (double(v[n / 2 - 1]) + double(v[n / 2]));
}

// What the SM clock did over a row's timed passes: one sample read after each.
struct ClockSample {
  double sm_mhz = 0;
  double mem_mhz = 0;
  bool power_capped = false;  // the driver named its power cap among the reasons for the clock
};

struct ClockSummary {
  int samples = 0;            // 0: the clock could not be read (no NVML); the rest is then meaningless
  double median_mhz = 0;
  double median_mem_mhz = 0;
  double capped_fraction = 0; // of the samples
};

inline ClockSummary summarize_clocks(std::vector<ClockSample> s) {
  ClockSummary out;
  out.samples = int(s.size());
  if (s.empty()) return out;
  std::vector<double> sm, mem;
  int capped = 0;
  for (const ClockSample& c : s) {
    sm.push_back(c.sm_mhz);
    mem.push_back(c.mem_mhz);
    capped += c.power_capped ? 1 : 0;
  }
  out.median_mhz = median_of(std::move(sm));
  out.median_mem_mhz = median_of(std::move(mem));
  out.capped_fraction = double(capped) / double(s.size());
  return out;
}

}  // namespace lynx::bench
