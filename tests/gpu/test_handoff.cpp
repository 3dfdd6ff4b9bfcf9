// The expert GEMM's tile hand-off, alone (tests/gpu/handoff_kernel.cu): every consumer thread must
// read every tile id in order, then the end marker. tools/gpu-check also runs it under
// compute-sanitizer racecheck (docs/testing.md).
#include <gtest/gtest.h>

#include "gpu/gpu_test.h"
#include "gpu/handoff_kernel.h"

namespace lynx::test {
namespace {

class TileHandOff : public GpuTest {};

TEST_F(TileHandOff, EveryConsumerReadsEveryTileInOrder) {
  const int32_t tiles = 37;
  const std::vector<int32_t> seen = run_tile_handoff(tiles);
  for (int thread = 0; thread < 256; ++thread) {
    for (int32_t n = 0; n <= tiles; ++n) {
      ASSERT_EQ(seen[size_t(thread) * (tiles + 1) + n], n < tiles ? n : -2) << "consumer thread " << thread << ", read " << n;
    }
  }
}

}  // namespace
}  // namespace lynx::test
