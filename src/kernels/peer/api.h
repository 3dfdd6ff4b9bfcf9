// Cross-rank barriers (R > 1): each rank counts, in the signal words of every other rank's shared
// region, the barriers it has reached; a rank waits until every peer has reached as many as it has.
// Counters only grow (no zeroing launch, graph replays included), and every wait is bounded: a peer that
// never arrives is reported (which peer, the count seen) through the host-mapped stall report, then
// the kernel traps.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/status.h"
#include "lynx/config.h"

namespace lynx::peer {

// In every rank's shared region, zero when the region is made.
struct Signals {
  uint32_t arrivals[Limits::kMaxRanks];  // arrivals[s]: barriers rank s has reached (written by rank s)
  // errors[s]: rank s's status code as it ended its last compute step (written by rank s before that
  // arrival). NOTES: a copy, not rank s's status word itself: that changes under the reader (s's
  // check() clears it, s's next pass may set it) before a slow peer's closing wait reads it; the copy
  // is rewritten only at s's next compute arrival, which no rank reaches before every rank has closed.
  int32_t errors[Limits::kMaxRanks];
  uint32_t passed;                       // barriers this rank has passed (written by this rank only)
  uint32_t reserved[3];
};

struct BarrierArgs {
  Signals* const* signals = nullptr;             // [R] device: every rank's signals
  DeviceStatus* status = nullptr;                // this rank's status word
  int32_t rank = 0, ranks = 1;
  DeviceStatus* stall_report = nullptr;          // host-mapped: where a timed-out wait reports
  uint64_t timeout_ns = 0;
};

// Arrives at the next barrier: counts it in every rank's signals, after this rank's earlier work (the
// kernels before it on `stream`) is visible to them. With `publish_status` (the compute step's end),
// this rank's status code is first copied into every rank's errors[rank].
void arrive(const BarrierArgs& args, bool publish_status, cudaStream_t stream);

// Waits until every rank has arrived at the barrier this rank arrived at last. With `collect_errors`
// (the close step), an error a peer published (not itself a peer failure) becomes kPeerFailed in this
// rank's status, so that this rank's combine writes nothing either and check() reports it.
void wait(const BarrierArgs& args, bool collect_errors, cudaStream_t stream);

// Loads the barrier kernels into the current context (common/kernel_loading.h says why).
void load_kernels();

}  // namespace lynx::peer
