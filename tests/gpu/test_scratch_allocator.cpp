// Scratch taken from a caller's allocator at every call (ScratchAllocator.*): layers sharing one
// allocator give the bits of workspaces that own their scratch, with every forward queued before the
// backwards as in a model's step; the scratch is given back by every call; graph capture works; an
// allocator that returns no memory is an error that queues nothing.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/layer_check.h"
#include "gpu/poisoning_allocator.h"
#include "lynx/allocator.h"
#include "runtime/workspace.h"

namespace lynx::test {
namespace {

class ScratchAllocatorTest : public GpuTest {};

// An allocator that has no memory.
class EmptyAllocator final : public ScratchAllocator {
 public:
  void* allocate(size_t, cudaStream_t) override { return nullptr; }
  void deallocate(void*, size_t, cudaStream_t) override {}
};

Config config_of(Backend b, bool save_context, ScratchAllocator* a = nullptr) {
  Config c;
  c.backend = b;
  c.save_forward_context = save_context;
  c.scratch_allocator = a;
  return c;
}

// kLayers layers on one allocator: every forward (and recompute, without a saved context), then every
// backward in reverse order; each layer's outputs against a workspace that owns its scratch.
void expect_layers_share_scratch(Backend b, bool save_context) {
  constexpr int kLayers = 3;
  // NOTES: I = 1024: gate/up (2I columns) and `da` (I) gather their rows inside the GEMMs, which write
  // them into scratch (narrower launches gather token-major in a kernel of their own).
  const Case c{300, 128, 1024, 8, 2, 64};
  const auto seed = fresh_seed();
  SCOPED_TRACE(case_name(c) + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const LayerStack stack = layers_with_outputs(c, kLayers, rng, config_of(b, save_context), !save_context);
  const auto& [L, dy, want] = stack;
  PoisoningAllocator alloc;
  std::vector<std::unique_ptr<Workspace>> ws;
  std::vector<std::unique_ptr<OutputBuffers>> out;
  std::vector<DeviceBuffer> d_dy;
  for (int i = 0; i < kLayers; ++i) {
    ws.push_back(std::make_unique<Workspace>(L[i]->shape, config_of(b, save_context, &alloc)));
    out.push_back(std::make_unique<OutputBuffers>(c));
    out[i]->poison();
    d_dy.push_back(to_device(dy[i]));
  }
  // One block each while made (the shared expert's kernels loaded: lynx/allocator.h), given back.
  EXPECT_EQ(alloc.allocations, kLayers);
  EXPECT_EQ(alloc.outstanding, 0);
  const int made = alloc.allocations;
  for (int i = 0; i < kLayers; ++i) {
    forward(*ws[i], L[i]->inputs(), out[i]->y_view(), nullptr);
    EXPECT_EQ(alloc.outstanding, 0) << "forward " << i << " kept its scratch";
  }
  for (int i = kLayers - 1; i >= 0; --i) {
    if (!save_context) recompute_forward_context(*ws[i], L[i]->inputs(), nullptr);
    backward(*ws[i], L[i]->inputs(), make_view(d_dy[i].get(), DType::kBF16, {c.T, c.H}), out[i]->grads(), nullptr);
    EXPECT_EQ(alloc.outstanding, 0) << "backward " << i << " kept its scratch";
  }
  for (int i = 0; i < kLayers; ++i) {
    ws[i]->check(nullptr);
    EXPECT_EQ(first_difference(out[i]->to_host_outputs(), want[i]), "") << "layer " << i;
  }
  EXPECT_EQ(alloc.allocations - made, kLayers * (save_context ? 2 : 3));
  EXPECT_GT(ws[0]->scratch_bytes(), 0);
  EXPECT_EQ(alloc.last_bytes, size_t(ws[0]->scratch_bytes()));
  // The scratch is what the workspace no longer holds (up to the 1 KB steps of each buffer).
  Workspace owning(L[0]->shape, config_of(b, save_context));
  EXPECT_EQ(owning.scratch_bytes(), 0);
  EXPECT_GE(ws[0]->device_bytes() + ws[0]->scratch_bytes(), owning.device_bytes());
  EXPECT_LE(ws[0]->device_bytes() + ws[0]->scratch_bytes(), owning.device_bytes() + 16 * 1024);
  EXPECT_LT(2 * ws[0]->device_bytes(), owning.device_bytes());
  // The fused backward's per-row dx lie on its dy rows (runtime/workspace.cpp); the unfused keeps both.
  const Workspace::Impl& own = owning.impl();
  EXPECT_EQ(own.un.rows_b == own.un.rows_a, b == Backend::kFused);
}

TEST_F(ScratchAllocatorTest, LayersShareOneScratchFused) { expect_layers_share_scratch(Backend::kFused, true); }
TEST_F(ScratchAllocatorTest, LayersShareOneScratchUnfused) { expect_layers_share_scratch(Backend::kUnfused, true); }
TEST_F(ScratchAllocatorTest, LayersShareOneScratchRecomputed) { expect_layers_share_scratch(Backend::kFused, false); }

// Forward and backward captured in a CUDA graph take and give back their scratch inside the graph
// (memory nodes); replays with new routing match the reference.
TEST_F(ScratchAllocatorTest, GraphReplay) {
  HostLayer L({250, 128, 128, 8, 2, 64}, fresh_seed());
  PoisoningAllocator alloc;
  Workspace ws(L.shape, config_of(Backend::kFused, true, &alloc));
  EXPECT_EQ(alloc.allocations, 1);  // while made (the shared expert's kernels loaded: lynx/allocator.h)
  expect_graph_replays_match_reference(ws, L, false);
  EXPECT_EQ(alloc.allocations, 3);  // and once by each captured call, not by the replays
  EXPECT_EQ(alloc.outstanding, 0);
}

// No memory from the allocator: the call throws naming it, and writes nothing.
TEST_F(ScratchAllocatorTest, NoMemoryIsAnErrorThatWritesNothing) {
  const Case c{64, 64, 64, 4, 2, 0};
  const HostLayer L(c, fresh_seed());
  EmptyAllocator empty;
  Workspace ws(L.shape, config_of(Backend::kFused, true, &empty));
  OutputBuffers out(c);
  out.poison();
  try {
    forward(ws, L.inputs(), out.y_view(), nullptr);
    ADD_FAILURE() << "forward ran without scratch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.scratch_allocator"), std::string::npos) << e.what();
  }
  for (HostBf16 v : out.to_host_outputs().y) ASSERT_EQ(v.bits, 0xFFFF) << "y was written";
}

// With a shared expert the workspace takes a block while it is made (lynx/allocator.h): none is an
// error naming the allocator.
TEST_F(ScratchAllocatorTest, NoMemoryWhileMadeIsAnError) {
  const Case c{64, 64, 64, 4, 2, 64};
  const HostLayer L(c, fresh_seed());
  EmptyAllocator empty;
  try {
    Workspace ws(L.shape, config_of(Backend::kFused, true, &empty));
    ADD_FAILURE() << "the workspace was made without its block";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.scratch_allocator"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lynx::test
