// What every entry point does around a pass: device and connection checks, and the report of a wait
// that timed out.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <string>

#include "lynx/error.h"
#include "runtime/workspace.h"

namespace lynx::api {

// NOTES: the stream's own device is not checked: cudaStreamGetDevice on a stream being captured fails
// and ends the capture as invalidated (every CUDA-graph test failed so, H100, 2026-12-05, 4ab51b4).
inline void check_device(const Workspace::Impl& w) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device != w.device) {
    throw Error("device", "the current CUDA device (" + std::to_string(device) + ") is not the workspace's device (" +
                              std::to_string(w.device) + "): make it current (cudaSetDevice) before the call");
  }
}

inline void require_connected(const Workspace::Impl& w) {
  if (!w.connected()) {
    throw Error("ws", "rank " + std::to_string(w.shape.rank) + " of " + std::to_string(w.shape.num_ranks) +
                          " is not connected to the other ranks: call connect_ranks or connect_process_group first");
  }
}

// Runs a pass's enqueue. A CUDA error it meets after a device wait timed out (whose trap lost the
// context) is reported as that wait: the host-mapped stall report names it, the CUDA error does not.
// NOTES: a launch or a lazy module load after the trap fails with "unspecified launch failure"
// before Workspace::check could read the report.
template <class Enqueue>
void enqueue_pass(const Workspace::Impl& w, Enqueue&& enqueue) {
  try {
    enqueue();
  } catch (const Error&) {
    if (w.stall_report && w.stall_report->code != int32_t(StatusCode::kOk)) {
      throw Error("", describe_status(*w.stall_report, w.shape.top_k));
    }
    throw;
  }
}

// A call of `impls`' workspaces (one, or every rank of a *_ranks call) on `stream`: after each one's
// last call, and recording its own end, where it threw too (Workspace::Impl::wait_for_last_call); as it
// is where `stream` is being captured.
template <class Impls, class Enqueue>
void enqueue_calls(const Impls& impls, cudaStream_t stream, Enqueue&& enqueue) {
  if (stream_capturing(stream)) return enqueue();
  for (Workspace::Impl* w : impls) w->wait_for_last_call(stream);
  try {
    enqueue();
  } catch (...) {
    for (Workspace::Impl* w : impls) w->record_failed_call(stream);
    throw;
  }
  for (Workspace::Impl* w : impls) w->record_call(stream);
}

// A call of one workspace: its pass's enqueue (enqueue_pass) in order (enqueue_calls).
template <class Enqueue>
void enqueue_call(Workspace::Impl& w, cudaStream_t stream, Enqueue&& enqueue) {
  enqueue_calls(std::array<Workspace::Impl*, 1>{&w}, stream, [&] { enqueue_pass(w, enqueue); });
}

}  // namespace lynx::api
