// Seeded random cases (RandomCases.*): shapes, routings, backends, context and virtual ranks drawn
// from a seed, forward and backward against the fp64 reference, every output per tensor and per row.
//   LYNX_RANDOM_CASES=N        cases in a batch (default 200)
//   LYNX_RANDOM_BATCH_SEED=S   the batch's seed (default: a fresh one, printed)
//   LYNX_RANDOM_SEED=S         replays the one case of seed S (printed on every case's line)
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/random_case.h"

namespace lynx::test {
namespace {

class RandomCases : public GpuTest {};

// The value of environment variable `name` as an unsigned integer (decimal or 0x hex), if set.
std::optional<uint64_t> env_u64(const char* name) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s, &end, 0);
  if (errno != 0 || *end != '\0') throw std::invalid_argument(std::string(name) + " is not an unsigned integer: " + s);
  return uint64_t(v);
}

// The seeds to run: the one replayed, or a batch's.
std::vector<uint64_t> seeds_to_run() {
  if (const std::optional<uint64_t> one = env_u64("LYNX_RANDOM_SEED")) {
    std::printf("random cases: replaying seed %llu\n", static_cast<unsigned long long>(*one));
    return {*one};
  }
  const uint64_t base = env_u64("LYNX_RANDOM_BATCH_SEED").value_or(uint64_t(fresh_seed()) << 32 | fresh_seed());
  const int64_t n = int64_t(env_u64("LYNX_RANDOM_CASES").value_or(200));
  std::printf("random cases: %lld cases of batch seed %llu (LYNX_RANDOM_BATCH_SEED=%llu replays the batch)\n",
              static_cast<long long>(n), static_cast<unsigned long long>(base), static_cast<unsigned long long>(base));
  std::vector<uint64_t> seeds;
  for (int64_t i = 0; i < n; ++i) seeds.push_back(case_seed(base, i));
  return seeds;
}

TEST_F(RandomCases, Batch) {
  const std::vector<uint64_t> seeds = seeds_to_run();
  ASSERT_FALSE(seeds.empty()) << "LYNX_RANDOM_CASES is 0";
  std::vector<std::string> failed;
  for (const uint64_t seed : seeds) {
    const CaseOutcome outcome = run_random_case(seed);
    std::printf("%s\n", outcome.line().c_str());
    std::fflush(stdout);
    if (!outcome.ok()) failed.push_back(outcome.line());
  }
  std::printf("random cases: %zu run, %zu failed\n", seeds.size(), failed.size());
  std::string list;
  for (const std::string& f : failed) list += "\n  " + f;
  EXPECT_TRUE(failed.empty()) << failed.size() << " of " << seeds.size() << " cases failed; replay one with "
                              << "LYNX_RANDOM_SEED=<seed> lynx_gpu_tests --gtest_filter='RandomCases.*':" << list;
}

}  // namespace
}  // namespace lynx::test
