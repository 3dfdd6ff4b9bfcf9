// Expert parallelism's entry points: connecting a group, and the virtual-rank driver.
#include "lynx/ranks.h"

#include <memory>
#include <string>
#include <vector>

#include "api/aliasing.h"
#include "api/call.h"
#include "api/passes.h"
#include "comm/transport.h"
#include "common/cuda_check.h"
#include "common/current_device.h"
#include "lynx/error.h"
#include "plan/overrides.h"
#include "runtime/scratch.h"
#include "runtime/steps.h"
#include "runtime/workspace.h"

namespace lynx {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Every rank's shape and config must be the group's; rank r at position r.
void check_group(const std::vector<Workspace*>& ranks) {
  if (ranks.empty()) throw Error("ranks", "is empty");
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!ranks[r]) throw Error("ranks", "[" + str(r) + "] is null");
  }
  const Workspace::Impl& first = ranks[0]->impl();
  const int64_t R = first.shape.num_ranks;
  if (int64_t(ranks.size()) != R) {
    throw Error("ranks", "holds " + str(ranks.size()) + " workspaces for shape.num_ranks = " + str(R));
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Workspace::Impl& w = ranks[r]->impl();
    LayerShape want = first.shape;
    want.rank = int32_t(r);
    const LayerShape& s = w.shape;
    if (s.rank != int32_t(r)) throw Error("ranks", "[" + str(r) + "] is rank " + str(s.rank) + ": give them in rank order");
    if (s.tokens != want.tokens || s.hidden != want.hidden || s.intermediate != want.intermediate ||
        s.num_experts != want.num_experts || s.top_k != want.top_k ||
        s.shared_intermediate != want.shared_intermediate || s.num_ranks != want.num_ranks) {
      throw Error("ranks", "[" + str(r) + "] has another shape than rank 0: every rank needs the same shape");
    }
    if (w.layout.bytes != first.layout.bytes || w.config.peer_timeout_ms != first.config.peer_timeout_ms ||
        w.config.save_forward_context != first.config.save_forward_context ||
        w.config.precision != first.config.precision ||
        w.config.bf16_weight_grads != first.config.bf16_weight_grads ||
        w.config.caller_context != first.config.caller_context) {
      throw Error("ranks", "[" + str(r) + "] has another config than rank 0: every rank needs the same config");
    }
    if (w.connected() && R > 1) throw Error("ranks", "[" + str(r) + "] is connected already");
  }
}

// A rank's arguments validated as the one-rank call does; with several ranks the error says which
// rank's argument it is (the argument keeps its name).
template <class Validate>
void validate_rank(Validate&& validate, Workspace::Impl& w, size_t r, size_t ranks) {
  try {
    validate(w, r);
  } catch (const Error& e) {
    if (ranks == 1) throw;
    const std::string prefix = "lynx: " + (e.argument().empty() ? std::string() : e.argument() + ": ");
    std::string message = e.what();
    if (message.rfind(prefix, 0) == 0) message = message.substr(prefix.size());
    throw Error(e.argument(), "of rank " + str(r) + ": " + message);
  }
}

// run_ranks' passes, once checked: each rank's steps on its own stream, forked from `stream` and joined
// back to it (or, at one rank, on `stream`).
template <class Step>
void queue_ranks(const std::vector<Workspace*>& ranks, cudaStream_t stream, Step&& step) {
  const auto each = [&](fused::Step s, const auto& stream_of) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      Workspace::Impl& w = ranks[r]->impl();
      api::enqueue_pass(w, [&] { step(w, r, s, stream_of(w)); });
    }
  };
  // NOTES: each rank's scratch (Config::scratch_allocator) is taken on `stream` before the ranks fork from
  // it and given back on it after they have joined it again (at the end of this function).
  std::vector<std::unique_ptr<ScratchLease>> scratch;
  for (Workspace* ws : ranks) {
    api::enqueue_pass(ws->impl(), [&] { scratch.push_back(std::make_unique<ScratchLease>(ws->impl(), stream)); });
  }
  if (ranks.size() == 1) {
    api::enqueue_pass(ranks[0]->impl(), [&] {
      for (fused::Step s : fused::kSteps) step(ranks[0]->impl(), 0, s, stream);
    });
    return;
  }
#if LYNX_EXPERIMENTS
  // LYNX_VIRTUAL_RANKS=serial: every step of every rank on `stream`, rank after rank (each launch has the
  // GPU to itself; a rank's barrier waits find the ranks before it arrived), to time against the ranks
  // at once.
  if (plan::environment_overrides().virtual_serial == 1) {
    for (fused::Step s : fused::kSteps) each(s, [&](const Workspace::Impl&) { return stream; });
    return;
  }
#endif
  Workspace::Impl& first = ranks[0]->impl();
  LYNX_CUDA(cudaEventRecord(first.fork_event, stream));
  for (Workspace* ws : ranks) LYNX_CUDA(cudaStreamWaitEvent(ws->impl().rank_stream, first.fork_event, 0));
  // NOTES: joined on every path, a throwing one too: the scratch goes back on `stream` (the leases'
  // destructors) only behind whatever the rank streams were given.
  const auto join = [&] {
    for (Workspace* ws : ranks) {
      cudaEventRecord(ws->impl().join_event, ws->impl().rank_stream);
      cudaStreamWaitEvent(stream, ws->impl().join_event, 0);
    }
  };
  try {
    for (fused::Step s : fused::kSteps) each(s, [](const Workspace::Impl& w) { return w.rank_stream; });
  } catch (...) {
    join();
    throw;
  }
  for (Workspace* ws : ranks) {
    LYNX_CUDA(cudaEventRecord(ws->impl().join_event, ws->impl().rank_stream));
    LYNX_CUDA(cudaStreamWaitEvent(stream, ws->impl().join_event, 0));
  }
}

// One pass of every rank, each on its rank's own stream forked from `stream` and joined back, so that
// one rank's kernels fill the GPU beside another's tails and launch gaps: the ranks run at once, as
// ranks on their own GPUs or in their own processes do.
// NOTES: a rank's barrier waits spin on the device for ranks running beside it, each in one small
// block (bounded by peer_timeout_ms); the schedule kernels, the only launches that need all of their
// blocks resident at once, are planned for 1/R of the SMs (Workspace::Impl::virtual_rank_plan), so R of them and the
// spinning blocks fit the GPU together.
// `validate` checks each rank's arguments, then `across` all ranks' together, before anything is queued.
template <class Validate, class Across, class Step>
void run_ranks(const std::vector<Workspace*>& ranks, size_t args, cudaStream_t stream, Validate&& validate,
               Across&& across, Step&& step) {
  if (ranks.empty() || args != ranks.size()) {
    throw Error("ranks", "needs one argument per rank: " + str(ranks.size()) + " ranks, " + str(args) + " arguments");
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (!ranks[r]) throw Error("ranks", "[" + str(r) + "] is null");
    Workspace::Impl& w = ranks[r]->impl();
    if (w.shape.rank != int32_t(r) || int64_t(ranks.size()) != w.shape.num_ranks) {
      throw Error("ranks", "[" + str(r) + "] is rank " + str(w.shape.rank) + " of " + str(w.shape.num_ranks) +
                               ": give every rank of the group, in rank order");
    }
    api::check_device(w);
    api::require_connected(w);
    if (ranks.size() > 1 && !w.rank_stream) {
      throw Error("ranks", "[" + str(r) + "] was not connected by connect_ranks on one device (virtual ranks)");
    }
    for (size_t s = 0; s < ranks.size() && ranks.size() > 1; ++s) {
      if (!ranks[s] || w.peer_bases[s] != ranks[s]->impl().region) {
        throw Error("ranks", "[" + str(r) + "] and [" + str(s) + "] were not connected to each other: give one group");
      }
    }
    if (w.config.caller_context) {
      throw Error("ranks", "[" + str(r) + "] keeps no forward context (Config::caller_context): call the one-rank "
                           "forward and backward, with a ForwardContext (a forward given none keeps none)");
    }
    if (w.config.backend != Backend::kFused) {
      throw Error("ranks", "[" + str(r) + "] uses the unfused backend: the *_ranks calls run the fused passes");
    }
    validate_rank(validate, w, r, ranks.size());
  }
  across();
  std::vector<Workspace::Impl*> impls;
  for (Workspace* ws : ranks) impls.push_back(&ws->impl());
  api::enqueue_calls(impls, stream, [&] { queue_ranks(ranks, stream, step); });
}

}  // namespace

void connect_ranks(const std::vector<Workspace*>& ranks) {
  check_group(ranks);
  if (ranks.size() == 1) return;
  std::vector<char*> bases;
  for (Workspace* ws : ranks) bases.push_back(ws->impl().region);
  for (Workspace* a : ranks) {
    for (Workspace* b : ranks) comm::enable_peer_access(a->impl().device, b->impl().device);
  }
  bool one_device = true;
  for (Workspace* ws : ranks) one_device = one_device && ws->impl().device == ranks[0]->impl().device;
  detail::CurrentDevice on(ranks[0]->impl().device);
  // NOTES: everything that can fail comes first, into locals; only then is any workspace changed, so
  // that a failure leaves every rank as it was (unconnected).
  struct Driver {
    plan::LayerPlan plan;
    cudaStream_t stream = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
  };
  std::vector<Driver> drivers(one_device ? ranks.size() : 0);
  try {
    for (size_t r = 0; r < drivers.size(); ++r) {
      drivers[r].plan = ranks[r]->impl().virtual_rank_plan();
      LYNX_CUDA(cudaStreamCreateWithFlags(&drivers[r].stream, cudaStreamNonBlocking));
      LYNX_CUDA(cudaEventCreateWithFlags(&drivers[r].fork, cudaEventDisableTiming));
      LYNX_CUDA(cudaEventCreateWithFlags(&drivers[r].join, cudaEventDisableTiming));
    }
    for (size_t r = 0; r < ranks.size(); ++r) {
      Workspace::Impl& w = ranks[r]->impl();
      on.set(w.device);
      w.connect(bases);
    }
  } catch (...) {
    for (Driver& d : drivers) {
      if (d.stream) cudaStreamDestroy(d.stream);
      if (d.fork) cudaEventDestroy(d.fork);
      if (d.join) cudaEventDestroy(d.join);
    }
    for (Workspace* ws : ranks) ws->impl().peer_bases.clear();
    throw;
  }
  for (size_t r = 0; r < drivers.size(); ++r) {
    ranks[r]->impl().become_virtual_rank(drivers[r].plan, drivers[r].stream, drivers[r].fork, drivers[r].join);
  }
}

void connect_process_group(Workspace& ws, const AllGather& all_gather) {
  Workspace::Impl& w = ws.impl();
  const int32_t R = w.shape.num_ranks;
  if (R == 1) return;
  if (w.connected()) throw Error("ws", "is connected already");
  if (!all_gather) throw Error("all_gather", "is empty");
  const std::vector<std::vector<uint8_t>> all =
      all_gather(comm::export_region(w.region, w.device, w.shape, w.config));
  if (int64_t(all.size()) != R) {
    throw Error("all_gather", "returned " + str(all.size()) + " ranks' bytes for a group of " + str(R));
  }
  std::vector<char*> bases(R, nullptr);
  int32_t sharing = 1;  // ranks on this rank's GPU, itself included (the plan's choices: plan/layer_plan.cpp)
  try {
    for (int32_t r = 0; r < R; ++r) {
      if (r == w.shape.rank) {
        bases[r] = w.region;
        continue;
      }
      bases[r] = comm::open_region(all[r], w.device, r, w.shape, w.config);
      w.opened.push_back(bases[r]);
      if (comm::exported_from_device(all[r], w.device)) ++sharing;
    }
    w.connect(bases);
  } catch (...) {
    for (char* b : w.opened) comm::close_region(b);
    w.opened.clear();
    throw;
  }
  if (sharing > 1) {
    w.device_props.ranks_sharing_sms = sharing;
    w.replan();
  }
}

void forward_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                   const std::vector<TensorView>& y, cudaStream_t stream) {
  if (in.size() != y.size()) throw Error("y", "needs one output per rank");
  run_ranks(
      ranks, in.size(), stream,
      [&](Workspace::Impl& w, size_t r) {
        validate_inputs(w.shape, in[r]);
        validate_output(w.shape, y[r]);
        api::check_forward_aliasing(in[r], y[r]);
        api::require_quantized_weights(w, in[r], Fp8Copies::kForward);
      },
      [&] { api::check_ranks_forward_aliasing(in, y); },
      [&](Workspace::Impl& w, size_t r, fused::Step s, cudaStream_t st) {
        api::forward_step(w, in[r], y[r], st, s);
        if (s == fused::Step::kClose) ++w.forward_calls;
      });
}

void recompute_forward_context_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                                     cudaStream_t stream) {
  run_ranks(
      ranks, in.size(), stream,
      [&](Workspace::Impl& w, size_t r) {
        validate_inputs(w.shape, in[r]);
        api::require_quantized_weights(w, in[r], Fp8Copies::kForward);
      },
      [] {},  // each rank writes only its own workspace's context
      [&](Workspace::Impl& w, size_t r, fused::Step s, cudaStream_t st) {
        api::recompute_step(w, in[r], st, s);
      });
}

void backward_ranks(const std::vector<Workspace*>& ranks, const std::vector<LayerInputs>& in,
                    const std::vector<TensorView>& dy, const std::vector<Gradients>& grads, cudaStream_t stream) {
  if (dy.size() != in.size() || grads.size() != in.size()) throw Error("grads", "needs one dy and one gradient set per rank");
  run_ranks(
      ranks, in.size(), stream,
      [&](Workspace::Impl& w, size_t r) {
        validate_inputs(w.shape, in[r]);
        validate_gradients(w.shape, dy[r], grads[r]);
        api::check_backward_aliasing(in[r], dy[r], grads[r]);
        require_context(w, in[r]);  // before any rank queues anything: a pass begun must be ended
        api::require_quantized_weights(w, in[r], Fp8Copies::kBackward);
      },
      [&] { api::check_ranks_backward_aliasing(in, dy, grads); },
      [&](Workspace::Impl& w, size_t r, fused::Step s, cudaStream_t st) {
        api::backward_step(w, in[r], dy[r], grads[r], st, s);
        if (s == fused::Step::kClose) ++w.backward_calls;
      });
}

}  // namespace lynx
