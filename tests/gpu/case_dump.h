// A random case written out for study away from the GPU (LYNX_RANDOM_DUMP=DIR, tests/gpu/random_case.cpp):
// its inputs, the GPU's outputs and the fp64 reference, one raw little-endian file each, and
// manifest.json naming each file's tensor, dtype and shape. tools/random_case_dump.py reads them.
#pragma once

#include <string>
#include <vector>

#include "gpu/layer_check.h"
#include "gpu/random_case.h"

namespace lynx::test {

// Writes case `what` (a line describing it) into DIR/<seed>/; throws std::runtime_error when a file
// cannot be written.
void dump_case(const std::string& dir, uint64_t seed, const std::string& what, const HostLayer& L,
               const std::vector<HostBf16>& dy, const Outputs& got, const Reference& want);

}  // namespace lynx::test
