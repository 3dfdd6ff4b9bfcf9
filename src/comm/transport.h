// How ranks reach each other's shared regions (region.h). In one process: the regions' own pointers
// (virtual ranks on one device; peer access between devices). Between processes: CUDA IPC handles,
// exchanged by the caller. Only these functions know which; the kernels see plain pointers.
// NOTES: a network transport (NCCL's device-initiated networking, NVSHMEM) would add a kind here
// whose tables hold symmetric-heap addresses, and route the kernels' remote loads (the gathers, the
// combines, the SwiGLU backward's weights) and stores (the schedule's slot_row, the barriers) through
// its device API instead of plain loads and stores: docs/expert-parallel.md.
#pragma once

#include <cstdint>
#include <vector>

#include "lynx/config.h"

namespace lynx::comm {

// Lets `device` read and write `peer`'s memory (no-op when they are the same device or access is
// already enabled); throws lynx::Error when the two cannot reach each other.
void enable_peer_access(int device, int peer);

// What a rank of a process group sends the others so that they can open its region: its IPC handle,
// device, and its shape and config (every rank's must be the group's, but for the rank).
std::vector<uint8_t> export_region(void* base, int device, const LayerShape& shape, const ResolvedConfig& config);

// Opens on `device` another process's region from what it exported; returns its base as this process
// addresses it. Throws lynx::Error naming what differs: not rank `expect_rank`, or another shape or
// config than `shape` / `config` (this rank's).
char* open_region(const std::vector<uint8_t>& exported, int device, int32_t expect_rank, const LayerShape& shape,
                  const ResolvedConfig& config);

void close_region(char* base);

// Whether what a rank exported (export_region) came from `device` itself: the two ranks' passes then
// share its SMs. Call after open_region has accepted the bytes.
bool exported_from_device(const std::vector<uint8_t>& exported, int device);

}  // namespace lynx::comm
