#include "comm/transport.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "lynx/error.h"

namespace lynx::comm {
namespace {

// What export_region sends: fixed-size, plain bytes.
struct Exported {
  uint32_t magic;
  int32_t rank, ranks;
  int64_t bytes;
  cudaUUID_t device_uuid;
  cudaIpcMemHandle_t handle;
};
constexpr uint32_t kMagic = 0x6c796e78;  // "lynx"

}  // namespace

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  int can = 0;
  LYNX_CUDA(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can) {
    throw Error("ranks", "device " + std::to_string(device) + " cannot access device " + std::to_string(peer) +
                             " (no peer access between them)");
  }
  int current = 0;
  LYNX_CUDA(cudaGetDevice(&current));
  LYNX_CUDA(cudaSetDevice(device));
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  else LYNX_CUDA(err);
  LYNX_CUDA(cudaSetDevice(current));
}

std::vector<uint8_t> export_region(void* base, int device, int32_t rank, int32_t ranks, int64_t bytes) {
  Exported e{};
  e.magic = kMagic;
  e.rank = rank;
  e.ranks = ranks;
  e.bytes = bytes;
  cudaDeviceProp prop{};
  LYNX_CUDA(cudaGetDeviceProperties(&prop, device));
  e.device_uuid = prop.uuid;
  LYNX_CUDA(cudaIpcGetMemHandle(&e.handle, base));
  std::vector<uint8_t> out(sizeof e);
  std::memcpy(out.data(), &e, sizeof e);
  return out;
}

char* open_region(const std::vector<uint8_t>& exported, int device, int32_t expect_rank, int32_t ranks, int64_t bytes) {
  const std::string who = "rank " + std::to_string(expect_rank) + "'s exchanged bytes";
  if (exported.size() != sizeof(Exported)) {
    throw Error("all_gather", who + ": " + std::to_string(exported.size()) + " bytes, expected " +
                                  std::to_string(sizeof(Exported)) + " (not what connect_process_group sent)");
  }
  Exported e;
  std::memcpy(&e, exported.data(), sizeof e);
  if (e.magic != kMagic) throw Error("all_gather", who + " are not a lynx region handle");
  if (e.rank != expect_rank) {
    throw Error("all_gather", who + " come from rank " + std::to_string(e.rank) +
                                  ": the exchange must return every rank's bytes in rank order");
  }
  if (e.ranks != ranks || e.bytes != bytes) {
    throw Error("all_gather", who + ": a group of " + std::to_string(e.ranks) + " ranks with a " +
                                  std::to_string(e.bytes) + "-byte region, this rank has " + std::to_string(ranks) +
                                  " and " + std::to_string(bytes) + " (every rank needs the same shape and config)");
  }
  (void)device;
  void* base = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&base, e.handle, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error("all_gather", "cannot open " + who + " as CUDA IPC memory: " + cudaGetErrorString(err));
  }
  return static_cast<char*>(base);
}

void close_region(char* base) {
  if (base) cudaIpcCloseMemHandle(base);
}

}  // namespace lynx::comm
