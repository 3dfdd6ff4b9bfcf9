// lynx-bench's clock regimes (bench/regime.h): the order of idle gaps, untimed and timed passes each
// regime gives, --regime's values, and the summary of the clock samples.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "regime.h"

namespace lynx::bench {
namespace {

std::string tag(char c, int n) {
  std::string s(1, c);
  s += std::to_string(n);
  return s;
}

// Runs `p` against fakes and returns the sequence of events: "i<ms>" idle, "w" untimed pass, "t<n>"
// the n-th timed pass. Every pass advances the fake clock by `pass_ms`; idling by its length.
std::vector<std::string> events(const Protocol& p, double pass_ms = 1.0) {
  std::vector<std::string> ev;
  double now = 0.0;
  int timed = 0;
  const std::vector<int> out = run_protocol(
      p, [&] { ev.push_back("w"), now += pass_ms; },
      [&] {
        ev.push_back(tag('t', timed));
        now += pass_ms;
        return timed++;
      },
      [&](int ms) { ev.push_back(tag('i', ms)), now += ms; }, [&] { return now; });
  EXPECT_EQ(out.size(), size_t(p.iters));
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], int(i)) << "timed results in order";
  return ev;
}

Protocol make(Regime r, int warmup, int iters, int idle_ms = 500, int sustain_ms = 3000) {
  Protocol p;
  p.regime = r;
  p.warmup = warmup;
  p.iters = iters;
  p.idle_ms = idle_ms;
  p.sustain_ms = sustain_ms;
  return p;
}

using Events = std::vector<std::string>;

TEST(BenchRegime, AsFoundWarmsUpOnceThenTimesBackToBack) {
  EXPECT_EQ(events(make(Regime::kAsFound, 2, 3)), (Events{"w", "w", "t0", "t1", "t2"}));
  EXPECT_EQ(events(make(Regime::kAsFound, 0, 1)), (Events{"t0"}));
}

TEST(BenchRegime, BurstIdlesAndWarmsUpBeforeEveryTimedPass) {
  EXPECT_EQ(events(make(Regime::kBurst, 1, 3, 250)),
            (Events{"i250", "w", "t0", "i250", "w", "t1", "i250", "w", "t2"}));
  EXPECT_EQ(events(make(Regime::kBurst, 0, 2, 7)), (Events{"i7", "t0", "i7", "t1"}));
}

TEST(BenchRegime, SustainedRunsUntimedPassesForItsTimeFirst) {
  // 10 ms of 3 ms passes: 4 untimed passes (the clock reads 0, 3, 6, 9 before them, 12 after).
  EXPECT_EQ(events(make(Regime::kSustained, 1, 2, 500, 10), 3.0), (Events{"w", "w", "w", "w", "t0", "t1"}));
  // The warm-up count is a floor: passes longer than the sustain time still warm up that often.
  EXPECT_EQ(events(make(Regime::kSustained, 3, 1, 500, 10), 50.0), (Events{"w", "w", "w", "t0"}));
  EXPECT_EQ(events(make(Regime::kSustained, 0, 1, 500, 0)), (Events{"t0"}));
}

TEST(BenchRegime, ParsesItsOptionValues) {
  EXPECT_EQ(*parse_regimes("as-found"), std::vector<Regime>{Regime::kAsFound});
  EXPECT_EQ(*parse_regimes("burst"), std::vector<Regime>{Regime::kBurst});
  EXPECT_EQ(*parse_regimes("sustained"), std::vector<Regime>{Regime::kSustained});
  EXPECT_EQ(*parse_regimes("all"), (std::vector<Regime>{Regime::kBurst, Regime::kSustained}));
  EXPECT_FALSE(parse_regimes(""));
  EXPECT_FALSE(parse_regimes("capped"));
  EXPECT_FALSE(parse_regimes("Burst"));
  for (Regime r : {Regime::kAsFound, Regime::kBurst, Regime::kSustained}) {
    EXPECT_EQ(parse_regimes(regime_name(r))->front(), r) << regime_name(r);
  }
}

TEST(BenchRegime, MedianOfOddAndEvenCounts) {
  EXPECT_DOUBLE_EQ(median_of(std::vector<float>{3.0f, 1.0f, 2.0f}), 2.0);
  EXPECT_DOUBLE_EQ(median_of(std::vector<float>{4.0f, 1.0f, 3.0f, 2.0f}), 2.5);
  EXPECT_DOUBLE_EQ(median_of(std::vector<double>{7.0}), 7.0);
  EXPECT_DOUBLE_EQ(median_of(std::vector<double>{}), 0.0);
}

TEST(BenchRegime, SummarizesClockSamples) {
  const ClockSummary none = summarize_clocks({});
  EXPECT_EQ(none.samples, 0);
  const ClockSummary odd = summarize_clocks({{1980, 2619, false}, {1500, 1000, true}, {1755, 2619, true}});
  EXPECT_EQ(odd.samples, 3);
  EXPECT_DOUBLE_EQ(odd.median_mhz, 1755);
  EXPECT_DOUBLE_EQ(odd.median_mem_mhz, 2619);
  EXPECT_DOUBLE_EQ(odd.capped_fraction, 2.0 / 3.0);
  const ClockSummary even =
      summarize_clocks({{1980, 2619, false}, {1500, 2619, true}, {1600, 2619, true}, {1980, 2619, false}});
  EXPECT_DOUBLE_EQ(even.median_mhz, 1790);
  EXPECT_DOUBLE_EQ(even.capped_fraction, 0.5);
}

}  // namespace
}  // namespace lynx::bench
