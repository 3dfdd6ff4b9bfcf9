// The device schedule builder against the host builder, bit for bit (the host builder is checked
// against the placement rule in tests/cpu/test_schedule.cpp). Ranks are virtual: every rank's ids are
// a separate buffer on the one GPU.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/schedule_routing.h"
#include "gpu/gpu_test.h"
#include "kernels/schedule/api.h"
#include "plan/schedule.h"

namespace lynx::sched {
namespace {

using lynx::test::DeviceBuffer;
using test::Routing;

class ScheduleDevice : public lynx::test::GpuTest {};

constexpr int64_t kGuard = 256;  // ints past the end of every buffer that must stay untouched

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { LYNX_TEST_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s); }
};

// What one device build left in every buffer, guards included.
struct DeviceOutput {
  std::vector<int32_t> row_token_slot, row_src_rank, expert_offset, expert_rows, block_offset, half_block_offset, slot_row,
      scratch;
  DeviceStatus status{};

  bool operator==(const DeviceOutput& o) const {
    return row_token_slot == o.row_token_slot && row_src_rank == o.row_src_rank && expert_offset == o.expert_offset &&
           expert_rows == o.expert_rows && block_offset == o.block_offset && half_block_offset == o.half_block_offset &&
           slot_row == o.slot_row &&
           std::memcmp(&status, &o.status, sizeof(status)) == 0;
  }
};

// The launch plan a workspace makes for problem `p` on this device.
SchedulePlan plan_of(const Problem& p) {
  const LaunchLimits l = launch_limits();
  return plan::make_schedule_plan(p.tokens, p.top_k, p.local_experts(), p.num_ranks, l.sm_count, l.max_shared_ints);
}

// Device buffers of one rank's schedule (each kGuard ints longer than needed) and the ranks' ids.
class DeviceSchedule {
 public:
  DeviceSchedule(const Routing& g, int32_t rank, int64_t capacity)
      : p_(g.problem(rank, capacity)),
        plan_(plan_of(p_)),
        row_token_slot_(bytes(capacity)),
        row_src_rank_(bytes(capacity)),
        expert_offset_(bytes(g.local_experts() + 1)),
        expert_rows_(bytes(g.local_experts())),
        block_offset_(bytes(g.local_experts() + 1)),
        half_block_offset_(bytes(g.local_experts() + 1)),
        slot_row_(bytes(g.entries())),
        scratch_(bytes(plan_.scratch_ints())),
        status_(sizeof(DeviceStatus)) {
    set_routing(g);
  }

  // Replaces the ids (same R, T, k, E) the next build reads.
  void set_routing(const Routing& g) {
    ids_.clear();
    routing_ = DeviceRouting{};
    for (int32_t s = 0; s < g.R; ++s) {
      ids_.push_back(lynx::test::to_device(g.ids[s]));
      routing_.topk_ids[s] = ids_.back().as<int32_t>();
    }
  }

  // Fills every buffer (and the scratch) with `poison` bytes and the status with `status`.
  void poison(int byte, const DeviceStatus& status = DeviceStatus{}) {
    for (DeviceBuffer* b : {&row_token_slot_, &row_src_rank_, &expert_offset_, &expert_rows_, &block_offset_, &half_block_offset_, &slot_row_,
                           &scratch_}) {
      b->fill_bytes(byte);
    }
    lynx::test::upload(status_.get(), &status, sizeof(status));
  }

  void enqueue(cudaStream_t stream) const {
    DeviceBuffers b{row_token_slot_.as<int32_t>(), row_src_rank_.as<int32_t>(), expert_offset_.as<int32_t>(),
                    expert_rows_.as<int32_t>(), block_offset_.as<int32_t>(), half_block_offset_.as<int32_t>(), slot_row_.as<int32_t>(),
                    scratch_.as<int32_t>(),
                    status_.as<DeviceStatus>()};
    build_schedule_device(p_, plan_, routing_, b, stream);
  }

  DeviceOutput build(cudaStream_t stream) {
    enqueue(stream);
    LYNX_TEST_CUDA(cudaGetLastError());
    LYNX_TEST_CUDA(cudaStreamSynchronize(stream));
    return read();
  }

  DeviceOutput read() const {
    DeviceOutput o;
    o.row_token_slot = ints(row_token_slot_);
    o.row_src_rank = ints(row_src_rank_);
    o.expert_offset = ints(expert_offset_);
    o.expert_rows = ints(expert_rows_);
    o.block_offset = ints(block_offset_);
    o.half_block_offset = ints(half_block_offset_);
    o.slot_row = ints(slot_row_);
    o.scratch = ints(scratch_);
    LYNX_TEST_CUDA(cudaMemcpy(&o.status, status_.get(), sizeof(o.status), cudaMemcpyDeviceToHost));
    return o;
  }

  const Problem& problem() const { return p_; }

 private:
  static size_t bytes(int64_t ints) { return size_t(ints + kGuard) * sizeof(int32_t); }
  static std::vector<int32_t> ints(const DeviceBuffer& b) { return lynx::test::to_host<int32_t>(b, b.bytes() / 4); }

  Problem p_;
  SchedulePlan plan_;
  DeviceBuffer row_token_slot_, row_src_rank_, expert_offset_, expert_rows_, block_offset_, half_block_offset_, slot_row_,
      scratch_, status_;
  std::vector<DeviceBuffer> ids_;
  DeviceRouting routing_{};
};

int32_t poison_word(int byte) { return int32_t(uint32_t(byte & 0xFF) * 0x01010101u); }

// "" when got[begin, end) equals want[begin, end) (want empty: every value is `fill`), else the first
// difference.
std::string compare(const std::vector<int32_t>& got, const std::vector<int32_t>& want, int64_t begin, int64_t end,
                    int32_t fill = 0) {
  if (int64_t(got.size()) < end) return "buffer too short";
  for (int64_t i = begin; i < end; ++i) {
    const int32_t w = want.empty() ? fill : want[i];
    if (got[i] != w) {
      std::string what = "[";
      what += std::to_string(i);
      what += "] = ";
      what += std::to_string(got[i]);
      what += ", want ";
      what += std::to_string(w);
      return what;
    }
  }
  return "";
}

// Checks one device build (made over `poison` bytes) against the host builder; with `check_status`,
// also the status (which was zero before the build).
void check_output(const DeviceOutput& d, const HostSchedule& h, const HostResult& res, const Problem& p, int poison,
                  bool check_status = true) {
  const int32_t fill = poison_word(poison);
  const int64_t E_loc = p.local_experts(), cap = p.capacity, entries = p.tokens * p.top_k;
  EXPECT_EQ(compare(d.expert_offset, h.expert_offset, 0, E_loc + 1), "") << "expert_offset";
  EXPECT_EQ(compare(d.expert_offset, {}, E_loc + 1, E_loc + 1 + kGuard, fill), "") << "expert_offset guard";
  EXPECT_EQ(compare(d.expert_rows, h.expert_rows, 0, E_loc), "") << "expert_rows";
  EXPECT_EQ(compare(d.expert_rows, {}, E_loc, E_loc + kGuard, fill), "") << "expert_rows guard";
  EXPECT_EQ(compare(d.block_offset, h.block_offset, 0, E_loc + 1), "") << "block_offset";
  EXPECT_EQ(compare(d.block_offset, {}, E_loc + 1, E_loc + 1 + kGuard, fill), "") << "block_offset guard";
  EXPECT_EQ(compare(d.half_block_offset, h.half_block_offset, 0, E_loc + 1), "") << "half_block_offset";
  EXPECT_EQ(compare(d.half_block_offset, {}, E_loc + 1, E_loc + 1 + kGuard, fill), "") << "half_block_offset guard";
  const int64_t scratch_ints = plan_of(p).scratch_ints();
  EXPECT_EQ(compare(d.scratch, {}, scratch_ints, scratch_ints + kGuard, fill), "") << "scratch guard";
  // The build's last block sets its barrier and arrival counters back for the next build.
  EXPECT_EQ(d.status.schedule_arrivals, 0) << "schedule_arrivals";
  EXPECT_EQ(d.status.counted_blocks, 0u) << "counted_blocks";
  if (res.code == StatusCode::kOk) {
    const int64_t total = res.rows_needed;
    if (check_status) {
      EXPECT_EQ(d.status.code, int32_t(StatusCode::kOk));
    }
    EXPECT_EQ(compare(d.row_token_slot, h.row_token_slot, 0, total), "") << "row_token_slot";
    EXPECT_EQ(compare(d.row_src_rank, h.row_src_rank, 0, total), "") << "row_src_rank";
    EXPECT_EQ(compare(d.row_token_slot, {}, total, cap + kGuard, fill), "") << "row_token_slot past the total";
    EXPECT_EQ(compare(d.row_src_rank, {}, total, cap + kGuard, fill), "") << "row_src_rank past the total";
    EXPECT_EQ(compare(d.slot_row, h.slot_row, 0, entries), "") << "slot_row";
  } else {
    if (check_status) {
      EXPECT_EQ(d.status.code, int32_t(StatusCode::kCapacityOverflow));
      EXPECT_EQ(d.status.rank, p.rank);
      EXPECT_EQ(d.status.a, res.rows_needed);
      EXPECT_EQ(d.status.b, p.capacity);
    }
    EXPECT_EQ(compare(d.row_token_slot, {}, 0, cap + kGuard, fill), "") << "row_token_slot written on overflow";
    EXPECT_EQ(compare(d.row_src_rank, {}, 0, cap + kGuard, fill), "") << "row_src_rank written on overflow";
  }
  const int64_t slot_begin = res.code == StatusCode::kOk ? entries : 0;
  EXPECT_EQ(compare(d.slot_row, {}, slot_begin, entries + kGuard, fill), "") << "slot_row guard / overflow";
}

// Builds rank r on the device over two different poisons and compares with the host builder; a
// third build over the last one's output must leave identical bits.
void check_rank(const Routing& g, int32_t r, int64_t capacity, const std::string& what) {
  SCOPED_TRACE(what + " rank " + std::to_string(r) + " capacity " + std::to_string(capacity));
  HostResult res;
  const HostSchedule h = g.host(r, capacity, &res);
  Stream stream;
  DeviceSchedule d(g, r, capacity);
  DeviceOutput last;
  for (int poison : {0xFF, 0x5A}) {
    d.poison(poison);
    last = d.build(stream.s);
    check_output(last, h, res, d.problem(), poison);
  }
  const DeviceOutput again = d.build(stream.s);
  EXPECT_TRUE(again == last) << "a second build changed the output";
}

void check_all_ranks(const Routing& g, const std::string& what) {
  for (int32_t r = 0; r < g.R; ++r) check_rank(g, r, g.worst_case_capacity(), what);
}

std::string name(const char* what, int32_t R) { return std::string(what) + " R=" + std::to_string(R); }

TEST_F(ScheduleDevice, RandomRoutings) {
  for (int32_t R : {1, 2, 4, 8}) {
    check_all_ranks(Routing(R, 300, 8, 64, 100 + R), name("T=300 k=8 E=64", R));
    check_all_ranks(Routing(R, 1000, 2, 16, 200 + R), name("T=1000 k=2 E=16", R));
    check_all_ranks(Routing(R, 129, 4, 128, 300 + R), name("T=129 k=4 E=128", R));
    check_all_ranks(Routing(R, 4097, 8, 128, 350 + R), name("T=4097 k=8 E=128", R));
  }
}

TEST_F(ScheduleDevice, TargetShapes) {
  for (int32_t R : {1, 8}) check_all_ranks(Routing(R, 8192, 8, 128, 360 + R), name("qwen3 T=8192 k=8 E=128", R));
  check_all_ranks(Routing(1, 4096, 8, 256, 370), name("deepseek T=4096 k=8 E=256", 1));
  check_all_ranks(Routing(1, 8192, 2, 8, 380), name("mixtral T=8192 k=2 E=8", 1));
}

// Many local experts: fewer warps per block (shared memory), several rounds per chunk, and chunks
// larger than the smallest one (the grid holds at most one block per SM).
TEST_F(ScheduleDevice, ManyExperts) {
  check_all_ranks(Routing(1, 3000, 8, 2048, 390), name("E=2048", 1));
  check_all_ranks(Routing(2, 3000, 8, 4096, 391), name("E=4096", 2));
  check_all_ranks(Routing(1, 3000, 8, 4096, 392), name("E=4096", 1));
  const Routing big(1, 131072, 8, 4096, 393);
  check_rank(big, 0, big.worst_case_capacity(), "E=4096 T=131072 (grown chunks)");
  const Routing wide(64, 100, 8, 4096, 394);
  for (int32_t r : {0, 17, 63}) check_rank(wide, r, wide.worst_case_capacity(), "E=4096 R=64");
}

TEST_F(ScheduleDevice, UnequalSources) {
  for (int32_t R : {2, 4, 8}) check_all_ranks(Routing(R, 500, 4, 32, 400 + R, 0, 70), name("hot", R));
  check_all_ranks(Routing(8, 5000, 8, 64, 410, 3, 90), name("hot T=5000", 8));
}

TEST_F(ScheduleDevice, ExpertsWithNoRows) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 3, 2, 64, 500 + R), name("T=3 E=64", R));
}

TEST_F(ScheduleDevice, EveryTokenOnOneExpert) {
  for (int32_t R : {1, 2, 4, 8}) {
    for (int64_t k : {1, 4}) {
      check_all_ranks(Routing(R, 333, k, 16, 600 + R, 5, 100, 0), name(k == 1 ? "one expert k=1" : "one expert k=4", R));
    }
  }
  check_all_ranks(Routing(1, 20000, 1, 128, 650, 77, 100, 0), name("one expert T=20000", 1));
}

TEST_F(ScheduleDevice, TopKOne) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 777, 1, 32, 700 + R), name("k=1", R));
}

TEST_F(ScheduleDevice, OneLocalExpert) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 2000, 1, R, 800 + R), name("E=R", R));
  for (int32_t R : {2, 4, 8}) check_all_ranks(Routing(R, 200, 2, R, 850 + R), name("E=R k=2", R));
}

TEST_F(ScheduleDevice, SingleToken) {
  for (int32_t R : {1, 2, 4, 8}) check_all_ranks(Routing(R, 1, 8, 64, 900 + R), name("T=1", R));
}

TEST_F(ScheduleDevice, ManyRanks) {
  const Routing g(64, 20, 4, 128, 950);
  for (int32_t r : {0, 1, 31, 63}) check_rank(g, r, g.worst_case_capacity(), "R=64");
}

TEST_F(ScheduleDevice, CapacityExactlyEnough) {
  for (int32_t R : {1, 2, 4, 8}) {
    const Routing g(R, 250, 4, 32, 1000 + R);
    for (int32_t r = 0; r < R; ++r) {
      HostResult res;
      g.host(r, 0, &res);
      check_rank(g, r, res.rows_needed, name("exact capacity", R));
    }
  }
}

TEST_F(ScheduleDevice, CapacityOneRowShort) {
  for (int32_t R : {1, 2, 4, 8}) {
    const Routing g(R, 250, 4, 32, 1100 + R);
    for (int32_t r = 0; r < R; ++r) {
      HostResult res;
      g.host(r, 0, &res);
      ASSERT_GT(res.rows_needed, 0);
      check_rank(g, r, res.rows_needed - 1, name("one row short", R));
      check_rank(g, r, res.rows_needed / 2, name("half the rows", R));
    }
  }
}

TEST_F(ScheduleDevice, IdsOutsideRangeAreNotLocal) {
  for (int32_t R : {1, 2, 4}) {
    Routing g(R, 100, 4, 16, 1200 + R);
    const int32_t bad[] = {-1, 16, INT_MIN, INT_MAX, 17, -16};
    for (int32_t s = 0; s < R; ++s) {
      for (int64_t i = 0; i < g.entries(); i += 7) g.ids[s][i] = bad[(i / 7 + s) % 6];
    }
    check_all_ranks(g, name("bad ids", R));
  }
}

// The first error wins: an earlier error stays, and it does not stop this build's rows.
TEST_F(ScheduleDevice, EarlierErrorStaysAndRowsAreStillBuilt) {
  const Routing g(2, 300, 4, 32, 1300);
  DeviceStatus earlier{};
  earlier.code = int32_t(StatusCode::kWaitTimeout);
  earlier.rank = 1;
  earlier.a = 11;
  earlier.b = 22;
  earlier.c = 33;
  earlier.first_bad_route = 44;
  Stream stream;
  for (bool overflow : {false, true}) {
    SCOPED_TRACE(overflow ? "overflow" : "fits");
    HostResult res;
    g.host(0, 0, &res);
    const int64_t capacity = overflow ? res.rows_needed - 128 : res.rows_needed;
    const HostSchedule h = g.host(0, capacity, &res);
    DeviceSchedule d(g, 0, capacity);
    d.poison(0x5A, earlier);
    const DeviceOutput out = d.build(stream.s);
    EXPECT_EQ(std::memcmp(&out.status, &earlier, sizeof(earlier)), 0) << "status changed";
    check_output(out, h, res, d.problem(), 0x5A, /*check_status=*/false);
  }
}

// Buffers reused across builds with different routings: nothing of an earlier build leaks in.
TEST_F(ScheduleDevice, ReusedBuffers) {
  const Routing a(4, 600, 8, 64, 1400), b(4, 600, 8, 64, 1401, 2, 100, 0);
  HostResult res_a, res_b;
  const int64_t capacity = std::max(a.worst_case_capacity(), b.worst_case_capacity());
  const HostSchedule ha = a.host(2, capacity, &res_a), hb = b.host(2, capacity, &res_b);
  Stream stream;
  DeviceSchedule d(a, 2, capacity);
  d.poison(0xFF);
  const DeviceOutput first = d.build(stream.s);
  check_output(first, ha, res_a, d.problem(), 0xFF);
  d.set_routing(b);
  const DeviceOutput second = d.build(stream.s);
  EXPECT_EQ(compare(second.row_token_slot, hb.row_token_slot, 0, res_b.rows_needed), "");
  EXPECT_EQ(compare(second.row_src_rank, hb.row_src_rank, 0, res_b.rows_needed), "");
  EXPECT_EQ(compare(second.slot_row, hb.slot_row, 0, a.entries()), "");
  EXPECT_EQ(compare(second.expert_offset, hb.expert_offset, 0, a.local_experts() + 1), "");
  d.set_routing(a);
  const DeviceOutput third = d.build(stream.s);
  EXPECT_EQ(compare(third.row_token_slot, ha.row_token_slot, 0, res_a.rows_needed), "");
  EXPECT_EQ(compare(third.row_src_rank, ha.row_src_rank, 0, res_a.rows_needed), "");
  EXPECT_EQ(compare(third.slot_row, ha.slot_row, 0, a.entries()), "");
  EXPECT_EQ(third.expert_offset, first.expert_offset);
  EXPECT_EQ(third.expert_rows, first.expert_rows);
}

// The builder is only stream work: it can be captured into a CUDA graph and replayed.
TEST_F(ScheduleDevice, GraphCapture) {
  const Routing g(2, 2000, 8, 64, 1500);
  HostResult res;
  const HostSchedule h = g.host(1, g.worst_case_capacity(), &res);
  Stream stream;
  DeviceSchedule d(g, 1, g.worst_case_capacity());
  cudaGraph_t graph = nullptr;
  LYNX_TEST_CUDA(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeThreadLocal));
  d.enqueue(stream.s);
  LYNX_TEST_CUDA(cudaStreamEndCapture(stream.s, &graph));
  cudaGraphExec_t exec = nullptr;
  LYNX_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int poison : {0xFF, 0x5A}) {
    d.poison(poison);
    LYNX_TEST_CUDA(cudaGraphLaunch(exec, stream.s));
    LYNX_TEST_CUDA(cudaStreamSynchronize(stream.s));
    check_output(d.read(), h, res, d.problem(), poison);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace lynx::sched
