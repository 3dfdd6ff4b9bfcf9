// lynx: expert parallelism. R ranks each hold T tokens and E / R experts (LayerShape::num_ranks, rank);
// each rank's forward returns y for its own tokens, its backward dx and d_topk_weights for its own
// tokens and the weight gradients of its own experts over every rank's tokens. Results are bitwise
// those of one rank holding all R·T tokens (rank-major) and all E experts.
//
// A group is R workspaces of one shape (but for `rank`) and one config, connected once, before their
// first pass, with no kernel of theirs running:
//  * one process: connect_ranks. Workspaces on one device are virtual ranks (tests, benchmarks);
//    on different devices they reach each other by peer access.
//  * one process per rank: connect_process_group, with an all-gather of bytes the caller supplies;
//    the regions are shared through CUDA IPC (several processes may share one device).
// Then every rank runs forward / backward / recompute_forward_context (moe.h) as usual, on its own
// stream, device or process: the passes meet at two cross-rank barriers each, on the device, with no
// host synchronisation. Every rank must run the same sequence of passes. A rank that does not come
// within Config::peer_timeout_ms is reported by the others (the rank and the barrier), whose kernels
// then trap. Virtual ranks on one device are run with the *_ranks calls below, or each with the
// one-rank calls on a stream of its own; never two ranks' one-rank calls on one stream (the first
// waits on the device for the second, queued behind it, until the timeout). The default timeout is
// 30 s: raise it where a rank may fall further behind the others (a checkpoint written between
// passes, say). Other ranks read and write a rank's buffers during their passes:
// keep every rank's workspace alive until every rank's last pass has ended. By default each rank's
// schedule_capacity is the worst case over all ranks' tokens (R times the one-rank size): set it to
// what the routing needs (schedule_capacity_for_load, config.h). Config::scratch_allocator and
// Config::caller_context work at R > 1 as at one rank, for what is a rank's alone (the shared region,
// what the other ranks read and write, stays the workspace's): a group made with caller_context (every
// rank alike) runs the one-rank calls with each rank's ForwardContext (a forward given none keeps none),
// which the *_ranks calls do not take.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "lynx/moe.h"

namespace lynx {

// Connects workspaces ranks[0..R-1] of one process (ranks[r]->shape().rank == r).
void connect_ranks(const std::vector<Workspace*>& ranks);

// Returns every rank's bytes in rank order, given this rank's (an all-gather over the caller's
// process group: torch.distributed, MPI, files).
using AllGather = std::function<std::vector<std::vector<uint8_t>>(const std::vector<uint8_t>& mine)>;

// Connects this process's rank of a group of processes. Every rank calls it, with its own workspace.
void connect_process_group(Workspace& ws, const AllGather& all_gather);

// Virtual ranks: every rank's pass (all ranks' workspaces on the current device, connected by
// connect_ranks), ordered after the work already on `stream`, and the work queued on `stream` later
// after it. The ranks run at once, each on a stream of its own forked from `stream`; capturable in a
// CUDA graph. Argument i belongs to ranks[i]; each is validated as by the one-rank call.
void forward_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                   const std::vector<TensorView>& y, cudaStream_t stream);
void recompute_forward_context_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                                     cudaStream_t stream);
void backward_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                    const std::vector<TensorView>& dy, const std::vector<Gradients>& grads, cudaStream_t stream);

}  // namespace lynx
