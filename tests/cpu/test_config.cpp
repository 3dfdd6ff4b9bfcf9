// The config heuristics and their range checks (pure host functions).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "lynx/lynx.h"
#include "plan/context_layout.h"
#include "plan/gemm_strategy.h"

namespace lynx {
namespace {

LayerShape qwen3() {
  LayerShape s;
  s.tokens = 8192;
  s.hidden = 2048;
  s.intermediate = 768;
  s.num_experts = 128;
  s.top_k = 8;
  return s;
}

template <class F>
void expect_error(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

TEST(Config, WorstCaseRows) {
  LayerShape s = qwen3();
  // 65536 routed rows + 128 experts each padded by at most 127.
  EXPECT_EQ(worst_case_schedule_rows(s), 65536 + 128 * 127);
  s.num_ranks = 8;
  // 8 ranks' rows can all land on this rank's 16 experts.
  EXPECT_EQ(worst_case_schedule_rows(s), 526336);  // 8 * 65536 + 16 * 127 = 526320, rounded up to 128
  EXPECT_EQ(worst_case_schedule_rows(s) % kTileRows, 0);
  s = qwen3();
  s.tokens = 1;
  s.top_k = 1;
  // One row can only pad one expert.
  EXPECT_EQ(worst_case_schedule_rows(s), 128);
}

// fp8_block's GEMMs take fewer schedule rows than bf16's: a shape whose worst case exceeds them is refused
// at resolution in FP8 (not at the first forward), unless a capacity within them is given.
TEST(Config, Fp8ScheduleRowsAreBounded) {
  LayerShape s = qwen3();
  s.tokens = 1 << 20;
  s.top_k = 16;
  s.num_experts = 1024;
  s.num_ranks = 64;
  ASSERT_GT(worst_case_schedule_rows(s), Limits::kMaxFp8ScheduleRows);
  ASSERT_LE(worst_case_schedule_rows(s), Limits::kMaxRoutedRows + 1 - kTileRows);
  Config c;
  EXPECT_EQ(resolve_config(s, c, DeviceInfo{}).schedule_capacity, worst_case_schedule_rows(s));
  c.precision = Precision::kFp8Block;
  expect_error([&] { resolve_config(s, c, DeviceInfo{}); }, "config.schedule_capacity");
  c.schedule_capacity = Limits::kMaxFp8ScheduleRows + kTileRows;
  expect_error([&] { resolve_config(s, c, DeviceInfo{}); }, "config.schedule_capacity");
  c.schedule_capacity = Limits::kMaxFp8ScheduleRows;
  EXPECT_EQ(resolve_config(s, c, DeviceInfo{}).schedule_capacity, Limits::kMaxFp8ScheduleRows);
  EXPECT_EQ(Limits::kMaxFp8ScheduleRows % kTileRows, 0);
}

TEST(Config, DefaultsAreConsistent) {
  for (int32_t sms : {78, 114, 132}) {
    const ResolvedConfig r = resolve_config(qwen3(), Config{}, DeviceInfo{sms, int64_t(80) << 30});
    EXPECT_EQ(r.schedule_capacity, worst_case_schedule_rows(qwen3()));
    EXPECT_TRUE(r.save_forward_context);
    EXPECT_EQ(r.backend, Backend::kFused);
  }
  // A tiny layer: three rows, each padding one expert to a whole block.
  LayerShape tiny = qwen3();
  tiny.tokens = 3;
  tiny.top_k = 1;
  EXPECT_EQ(resolve_config(tiny, Config{}, DeviceInfo{}).schedule_capacity, 384);
}

TEST(Config, ExplicitValuesAreKeptOrRejected) {
  Config c;
  c.schedule_capacity = 4096;
  c.save_forward_context = false;
  const ResolvedConfig r = resolve_config(qwen3(), c, DeviceInfo{});
  EXPECT_EQ(r.schedule_capacity, 4096);
  EXPECT_FALSE(r.save_forward_context);
  c.backend = Backend::kUnfused;
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).backend, Backend::kUnfused);
  // Capacity beyond the worst case is clamped to it.
  c = Config{};
  c.schedule_capacity = 1 << 24;
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).schedule_capacity, worst_case_schedule_rows(qwen3()));

  c = Config{};
  c.schedule_capacity = 100;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.schedule_capacity");
  c = Config{};
  c.schedule_capacity = -128;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.schedule_capacity");
  c = Config{};
  c.backend = static_cast<Backend>(7);
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.backend");
  LayerShape bad = qwen3();
  bad.top_k = 200;
  expect_error([&] { resolve_config(bad, Config{}, DeviceInfo{}); }, "shape.top_k");
  bad = qwen3();
  bad.num_ranks = 2;  // several ranks run the fused path only
  c = Config{};
  c.backend = Backend::kUnfused;
  expect_error([&] { resolve_config(bad, c, DeviceInfo{}); }, "config.backend");
  EXPECT_EQ(resolve_config(bad, Config{}, DeviceInfo{}).backend, Backend::kFused);
  bad.num_ranks = 3;  // E = 128 is not divisible by 3
  expect_error([&] { resolve_config(bad, Config{}, DeviceInfo{}); }, "shape.num_experts");
  c = Config{};
  c.peer_timeout_ms = -1;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.peer_timeout_ms");
  EXPECT_EQ(resolve_config(qwen3(), Config{}, DeviceInfo{}).peer_timeout_ms, 30'000);
  // A scratch allocator, at any R; the pointer passes through (never dereferenced here).
  c = Config{};
  c.scratch_allocator = reinterpret_cast<ScratchAllocator*>(uintptr_t(64));
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).scratch_allocator, c.scratch_allocator);
  bad = qwen3();
  bad.num_ranks = 2;
  EXPECT_EQ(resolve_config(bad, c, DeviceInfo{}).scratch_allocator, c.scratch_allocator);
  // A caller's context, at any R: it needs a context to save.
  c = Config{};
  c.caller_context = true;
  EXPECT_TRUE(resolve_config(qwen3(), c, DeviceInfo{}).caller_context);
  EXPECT_TRUE(resolve_config(bad, c, DeviceInfo{}).caller_context);
  c.save_forward_context = false;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.caller_context");
  // FP8: the fused backend, at any R; bf16 by default.
  EXPECT_EQ(resolve_config(qwen3(), Config{}, DeviceInfo{}).precision, Precision::kBf16);
  c = Config{};
  c.precision = Precision::kFp8Block;
  EXPECT_EQ(resolve_config(qwen3(), c, DeviceInfo{}).precision, Precision::kFp8Block);
  EXPECT_EQ(resolve_config(bad, c, DeviceInfo{}).precision, Precision::kFp8Block);
  c.backend = Backend::kUnfused;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.precision");
  // The FP8 GEMMs take any capacity (persistent CTAs, not a grid row per 128 rows).
  c.backend = Backend::kAuto;
  LayerShape huge = qwen3();
  huge.tokens = int64_t(1) << 20;
  EXPECT_EQ(resolve_config(huge, c, DeviceInfo{}).schedule_capacity, worst_case_schedule_rows(huge));
  c = Config{};
  c.precision = static_cast<Precision>(7);
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.precision");
  // bf16 weight gradients: an FP8 option; with bf16 passes it would be silently meaningless.
  c = Config{};
  c.bf16_weight_grads = true;
  expect_error([&] { resolve_config(qwen3(), c, DeviceInfo{}); }, "config.bf16_weight_grads");
  c.precision = Precision::kFp8Block;
  EXPECT_TRUE(resolve_config(qwen3(), c, DeviceInfo{}).bf16_weight_grads);
}

// Capacities for a bounded load: the balanced share times max_load plus each local expert's padding,
// in whole tiles, never above the worst case (which one rank always needs).
TEST(Config, ScheduleCapacityForLoad) {
  LayerShape s = qwen3();  // T = 8192, k = 8, E = 128
  s.num_ranks = 8;
  const int64_t Tk = s.tokens * s.top_k, E_loc = 16;
  EXPECT_EQ(schedule_capacity_for_load(s, 1.0), (Tk + E_loc * 127 + 127) / 128 * 128);
  EXPECT_EQ(schedule_capacity_for_load(s, 2.0), (2 * Tk + E_loc * 127 + 127) / 128 * 128);
  EXPECT_EQ(schedule_capacity_for_load(s, 1.5), (3 * Tk / 2 + E_loc * 127 + 127) / 128 * 128);
  EXPECT_EQ(schedule_capacity_for_load(s, 8.0), worst_case_schedule_rows(s));
  EXPECT_EQ(schedule_capacity_for_load(s, 1e300), worst_case_schedule_rows(s));
  EXPECT_EQ(schedule_capacity_for_load(qwen3(), 1.0), worst_case_schedule_rows(qwen3()));  // one rank
  // A capacity resolve_config takes as it is.
  Config c;
  c.schedule_capacity = schedule_capacity_for_load(s, 2.0);
  EXPECT_EQ(resolve_config(s, c, DeviceInfo{}).schedule_capacity, c.schedule_capacity);
  for (const double bad : {0.5, 0.0, -1.0, std::nan("")}) {
    expect_error([&] { schedule_capacity_for_load(s, bad); }, "max_load");
  }
  s.hidden = 100;
  expect_error([&] { schedule_capacity_for_load(s, 2.0); }, "shape.hidden");
}

// The size of a caller's forward context: the saved buffers of docs/design.md, each rounded up to 1 KB.
// One rank, fused: the schedule, and g and u by slot (T·k rows, no padding; 192.6 MiB at
// qwen3-30b-a3b), whatever the capacity; unfused: g and u by schedule row (capacity rows); a shared
// expert adds its gate and up products; R > 1 adds the gathered x rows and the rows' source ranks.
TEST(Config, ForwardContextBytes) {
  const LayerShape s = qwen3();
  const int64_t q = forward_context_bytes(s, Config{});
  const int64_t cap = worst_case_schedule_rows(s), rows = s.tokens * s.top_k;
  const int64_t schedule = 4 * (cap + rows);
  EXPECT_GE(q, 2 * rows * (2 * s.intermediate) + schedule);
  EXPECT_LT(q, 2 * rows * (2 * s.intermediate) + schedule + 16 * 1024);
  EXPECT_NEAR(double(q) / (1 << 20), 192.6, 0.1);
  Config unfused;
  unfused.backend = Backend::kUnfused;
  const int64_t qu = forward_context_bytes(s, unfused);
  EXPECT_GE(qu, 2 * cap * (2 * s.intermediate) + schedule);
  EXPECT_LT(qu, 2 * cap * (2 * s.intermediate) + schedule + 16 * 1024);
  LayerShape shared = qwen3();
  shared.shared_intermediate = 512;
  EXPECT_EQ(forward_context_bytes(shared, Config{}) - q, 2 * 2 * s.tokens * 512);
  Config small;
  small.schedule_capacity = 8192;
  EXPECT_LT(forward_context_bytes(s, small), q);  // the schedule's share only
  small.backend = Backend::kUnfused;
  EXPECT_LT(forward_context_bytes(s, small), qu / 4);
  LayerShape two = qwen3();
  two.num_ranks = 2;
  const int64_t cap2 = worst_case_schedule_rows(two);
  EXPECT_GE(forward_context_bytes(two, Config{}), 2 * cap2 * (two.hidden + 2 * two.intermediate) + 4 * (2 * cap2 + rows));
  // docs/design.md's figure: R = 8, T = 8192 a rank, the capacity for a load of 2.
  LayerShape eight = qwen3();
  eight.num_ranks = 8;
  Config load2;
  load2.schedule_capacity = schedule_capacity_for_load(eight, 2.0);
  EXPECT_NEAR(double(forward_context_bytes(eight, load2)) / (1 << 20), 911.3, 0.1);
}

// What a forward keeping no context is lent of a context (plan::forward_only_bytes): the block less g and
// u, which lie last, and without `gathered_rows` less the x rows too, which lie just before them. At
// qwen3-30b-a3b, one rank: the schedule's 0.57 MiB instead of 192.6.
TEST(Config, ForwardOnlyContextBytes) {
  LayerShape s = qwen3();
  const int64_t cap = worst_case_schedule_rows(s), rows = s.tokens * s.top_k;
  const plan::ContextSizes one = plan::context_sizes(s, cap, Backend::kFused);
  const int64_t whole = plan::context_block_bytes(one);
  EXPECT_EQ(whole, forward_context_bytes(s, Config{}));
  const int64_t schedule = plan::forward_only_bytes(one, true);
  EXPECT_EQ(plan::forward_only_bytes(one, false), schedule);  // one rank keeps no x rows
  EXPECT_EQ(whole - schedule, 2 * plan::lent_bytes(2 * rows * s.intermediate));
  EXPECT_GE(schedule, 4 * (cap + rows));
  EXPECT_LT(schedule, 4 * (cap + rows) + 8 * 1024);
  EXPECT_NEAR(double(schedule) / (1 << 20), 0.57, 0.01);
  s.shared_intermediate = 512;
  const plan::ContextSizes shared = plan::context_sizes(s, cap, Backend::kFused);
  EXPECT_EQ(plan::forward_only_bytes(shared, true) - schedule, 2 * 2 * s.tokens * 512);  // gs and us are lent
  s.num_ranks = 2;
  const int64_t cap2 = worst_case_schedule_rows(s);
  const plan::ContextSizes two = plan::context_sizes(s, cap2, Backend::kFused);
  const int64_t gate_up = 2 * plan::lent_bytes(2 * cap2 * s.intermediate);
  const int64_t x_rows = plan::lent_bytes(2 * cap2 * s.hidden);
  EXPECT_EQ(plan::context_block_bytes(two) - plan::forward_only_bytes(two, true), gate_up);
  EXPECT_EQ(plan::context_block_bytes(two) - plan::forward_only_bytes(two, false), gate_up + x_rows);
}

// The unfused path's GEMM issue strategy on the products of the benchmark shapes' forward gate GEMMs
// (mean rows per expert · I · H · 2 FLOPs), as measured on the H200 (2026-11-29).
TEST(GemmStrategy, FollowsTheMeasuredSweep) {
  using plan::GemmStrategy;
  using plan::choose_gemm_strategy;
  EXPECT_EQ(choose_gemm_strategy(2 * 128, 512.0 * 768 * 2048 * 2), GemmStrategy::kGrouped);  // qwen3-30b-a3b
  EXPECT_EQ(choose_gemm_strategy(2 * 64, 1024.0 * 1024 * 2048 * 2), GemmStrategy::kLoop);    // olmoe-1b-7b
  EXPECT_EQ(choose_gemm_strategy(2 * 8, 2048.0 * 14336 * 4096 * 2), GemmStrategy::kLoop);    // mixtral-8x7b
  EXPECT_EQ(choose_gemm_strategy(2 * 256, 128.0 * 2048 * 7168 * 2), GemmStrategy::kLoop);    // deepseek-v3
  EXPECT_EQ(choose_gemm_strategy(4, 1e6), GemmStrategy::kLoop);  // a handful of launches costs nothing
}

}  // namespace
}  // namespace lynx
