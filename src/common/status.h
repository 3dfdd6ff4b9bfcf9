// The device status word: how kernels report errors without a host synchronisation.
#pragma once

#include <cstdint>
#include <string>

namespace lynx {

enum class StatusCode : int32_t {
  kOk = 0,
  kCapacityOverflow = 1,  // a = rows needed, b = schedule capacity
  kExpertOutOfRange = 2,  // a = flat index t*k+j, b = the id, c = E
  kNonFiniteWeight = 3,   // a = flat index t*k+j, b = the weight's bits
  kWaitTimeout = 4,       // rank = block, a = which wait (sm90::Wait), b = task (-1: the next, not yet
                          // known; -2: past the last), c = phase or counter seen
  kPeerFailed = 5,        // R > 1: rank `a` reported error code `b` in this pass; this rank's outputs are not written
  kNonFiniteInput = 6,    // a NaN or an infinity in a tensor the FP8 path quantises: a = which (Fp8Tensor)
};

// Which tensor a kNonFiniteInput names.
enum class Fp8Tensor : int64_t { kX = 0, kH = 1, kGate = 2, kUp = 3, kDown = 4, kDy = 5, kDgu = 6 };

// One per workspace, in device memory: zero at workspace creation but for first_bad_route (UINT64_MAX);
// the host sets `code` back to kOk after it reads an error. The first error wins (codes are set by
// atomicCAS from kOk).
struct DeviceStatus {
  int32_t code;
  int32_t rank;
  int64_t a, b, c;
  // Lowest offending routing index seen by validation (atomicMin), UINT64_MAX when none: keeps the
  // reported routing error deterministic when many entries are bad. The validation's last block
  // reports it and sets it back to UINT64_MAX for the next call.
  unsigned long long first_bad_route;
  // The schedule builder's grid barriers: blocks arrived, over both barriers of a build. Zero between
  // builds: the build's last block sets it back.
  int32_t schedule_arrivals;
  // Blocks of the schedule builder that have finished, so that the last one knows every block is past
  // the barriers (common/last_block.cuh). Zero between builds: the last block sets it back.
  uint32_t counted_blocks;
};

// A readable sentence for a status reported by a kernel; empty for kOk. `top_k` turns flat routing
// indices back into [t, j].
std::string describe_status(const DeviceStatus& status, int64_t top_k);

}  // namespace lynx
