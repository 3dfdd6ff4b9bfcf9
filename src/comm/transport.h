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

namespace lynx::comm {

// Lets `device` read and write `peer`'s memory (no-op when they are the same device or access is
// already enabled); throws lynx::Error when the two cannot reach each other.
void enable_peer_access(int device, int peer);

// What rank `rank` sends the others of a process group so that they can open its region.
std::vector<uint8_t> export_region(void* base, int device, int32_t rank, int32_t ranks, int64_t bytes);

// Opens another process's region from what it exported (checked: its rank, the group's size, the
// region's size); returns its base as this process addresses it. Throws lynx::Error naming what differs.
char* open_region(const std::vector<uint8_t>& exported, int device, int32_t expect_rank, int32_t ranks, int64_t bytes);

void close_region(char* base);

}  // namespace lynx::comm
