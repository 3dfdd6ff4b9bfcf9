// A reduced model of the expert GEMM's tile hand-off (producer thread -> consumer warpgroups through a
// shared-memory word per pipeline stage): the same waits, reads and releases (every consumer thread
// arrives on a stage's `empty` barrier, one stage late), without operand loads, so every stage
// completes by the producer's plain arrive, as the GEMM's no-data stages do. Small enough to run under
// compute-sanitizer racecheck (docs/testing.md); it does not model the TMA-completed stages.
#pragma once

#include <cstdint>
#include <vector>

namespace lynx::test {

// Runs one CTA: the producer hands tiles 0 .. tiles-1 (tile t spans 1 + t % 3 stages), then an end
// marker (-2). Returns, per consumer thread (256), the tile ids it read, tiles + 1 values each.
std::vector<int32_t> run_tile_handoff(int32_t tiles);

}  // namespace lynx::test
