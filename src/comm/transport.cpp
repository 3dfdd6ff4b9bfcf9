#include "comm/transport.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "common/cuda_check.h"
#include "common/current_device.h"
#include "lynx/error.h"

namespace lynx::comm {
namespace {

// What export_region sends: fixed-size, plain bytes.
struct Exported {
  uint32_t magic;
  int32_t rank, ranks;
  int64_t tokens, hidden, intermediate, num_experts, top_k, shared_intermediate;
  int64_t capacity, peer_timeout_ms;
  int32_t save_forward_context, backend, precision, bf16_weight_grads, caller_context;
  cudaUUID_t device_uuid;
  cudaIpcMemHandle_t handle;
};
constexpr uint32_t kMagic = 0x6c796e78;  // "lynx"

// The fields every rank of a group must share, with their names, as exported.
Exported group_fields(const LayerShape& s, const ResolvedConfig& c) {
  Exported e{};
  e.magic = kMagic;
  e.rank = s.rank;
  e.ranks = s.num_ranks;
  e.tokens = s.tokens, e.hidden = s.hidden, e.intermediate = s.intermediate, e.num_experts = s.num_experts;
  e.top_k = s.top_k, e.shared_intermediate = s.shared_intermediate;
  e.capacity = c.schedule_capacity, e.peer_timeout_ms = c.peer_timeout_ms;
  e.save_forward_context = c.save_forward_context, e.backend = int32_t(c.backend);
  e.precision = int32_t(c.precision);
  e.bf16_weight_grads = c.bf16_weight_grads;
  e.caller_context = c.caller_context;
  return e;
}

}  // namespace

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  int can = 0;
  LYNX_CUDA(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can) {
    throw Error("ranks", "device " + std::to_string(device) + " cannot access device " + std::to_string(peer) +
                             " (no peer access between them)");
  }
  const detail::CurrentDevice on(device);
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
  else LYNX_CUDA(err);
}

std::vector<uint8_t> export_region(void* base, int device, const LayerShape& shape, const ResolvedConfig& config) {
  Exported e = group_fields(shape, config);
  cudaDeviceProp prop{};
  LYNX_CUDA(cudaGetDeviceProperties(&prop, device));
  e.device_uuid = prop.uuid;
  LYNX_CUDA(cudaIpcGetMemHandle(&e.handle, base));
  std::vector<uint8_t> out(sizeof e);
  std::memcpy(out.data(), &e, sizeof e);
  return out;
}

char* open_region(const std::vector<uint8_t>& exported, int device, int32_t expect_rank, const LayerShape& shape,
                  const ResolvedConfig& config) {
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
  const Exported mine = group_fields(shape, config);
  const struct {
    const char* name;
    int64_t theirs, ours;
  } fields[] = {{"num_ranks", e.ranks, mine.ranks},
                {"tokens", e.tokens, mine.tokens},
                {"hidden", e.hidden, mine.hidden},
                {"intermediate", e.intermediate, mine.intermediate},
                {"num_experts", e.num_experts, mine.num_experts},
                {"top_k", e.top_k, mine.top_k},
                {"shared_intermediate", e.shared_intermediate, mine.shared_intermediate},
                {"schedule_capacity", e.capacity, mine.capacity},
                {"peer_timeout_ms", e.peer_timeout_ms, mine.peer_timeout_ms},
                {"save_forward_context", e.save_forward_context, mine.save_forward_context},
                {"backend", e.backend, mine.backend},
                {"precision", e.precision, mine.precision},
                {"bf16_weight_grads", e.bf16_weight_grads, mine.bf16_weight_grads},
                {"caller_context", e.caller_context, mine.caller_context}};
  for (const auto& f : fields) {
    if (f.theirs != f.ours) {
      throw Error("all_gather", who + ": " + f.name + " = " + std::to_string(f.theirs) + ", this rank has " +
                                    std::to_string(f.ours) + " (every rank needs the group's shape and config)");
    }
  }
  void* base = nullptr;
  const cudaError_t err = [&] {
    const detail::CurrentDevice on(device);
    return cudaIpcOpenMemHandle(&base, e.handle, cudaIpcMemLazyEnablePeerAccess);
  }();
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error("all_gather", "cannot open " + who + " as CUDA IPC memory: " + cudaGetErrorString(err));
  }
  return static_cast<char*>(base);
}

bool exported_from_device(const std::vector<uint8_t>& exported, int device) {
  Exported e;
  std::memcpy(&e, exported.data(), sizeof e);
  cudaDeviceProp prop{};
  LYNX_CUDA(cudaGetDeviceProperties(&prop, device));
  return std::memcmp(&e.device_uuid, &prop.uuid, sizeof prop.uuid) == 0;
}

void close_region(char* base) {
  if (base) cudaIpcCloseMemHandle(base);
}

}  // namespace lynx::comm
