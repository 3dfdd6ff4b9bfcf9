// The expert GEMM's tile hand-off, alone (tests/gpu/handoff_kernel.cu): every consumer thread must
// read every tile id in order, then the end marker. Run under compute-sanitizer racecheck it shows
// whether the tool flags the pattern itself (docs/testing.md).
#include <gtest/gtest.h>

#include "gpu/gpu_test.h"
#include "gpu/handoff_kernel.h"

namespace lynx::test {
namespace {

class TileHandOff : public GpuTest, public ::testing::WithParamInterface<HandOffRelease> {};

TEST_P(TileHandOff, EveryConsumerReadsEveryTileInOrder) {
  const int32_t tiles = 37;
  const std::vector<int32_t> seen = run_tile_handoff(tiles, GetParam());
  for (int thread = 0; thread < 256; ++thread) {
    for (int32_t n = 0; n <= tiles; ++n) {
      ASSERT_EQ(seen[size_t(thread) * (tiles + 1) + n], n < tiles ? n : -2) << "consumer thread " << thread << ", read " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Release, TileHandOff,
                         ::testing::Values(HandOffRelease::kBarrierThenThreadZero, HandOffRelease::kEveryThread),
                         [](const auto& info) {
                           return info.param == HandOffRelease::kEveryThread ? "EveryThread" : "BarrierThenThreadZero";
                         });

}  // namespace
}  // namespace lynx::test
