// Loading kernels into a context before any pass runs.
//
// NOTES: with lazy module loading (CUDA's default) a kernel is loaded into a context at its first
// launch, and a load may wait until the kernels the context is running have finished. A pass whose
// first launch of a kernel comes after a kernel of its own that waits for other work (a cross-rank
// barrier waiting for a rank whose pass the same thread has not queued yet) would then wait for
// itself until the barrier's time limit; and a pass's first call would hold the host until the GPU
// is idle. So a workspace loads, when it is made, every kernel of lynx's kernel files, and cuBLAS's
// for the shared expert (runtime/steps.h). Not loaded then: the unfused backend's cuBLAS products of
// the routed experts, whose shapes follow the routing (one rank, and its calls wait for the GPU anyway).
#pragma once

namespace lynx {

// Loads into the current device's context every kernel of the module (one translation unit's device
// code) that holds `kernel`, a __global__ function's address. Throws lynx::Error when the driver
// cannot (it needs CUDA 12.4's module enumeration).
void load_module_of(const void* kernel);

}  // namespace lynx
