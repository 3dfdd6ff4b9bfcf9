// libFuzzer target over the C++ API's host checks and the host schedule builder: every input is either
// rejected with a lynx::Error that names an argument and says why, or accepted, and then what it
// computes keeps its promises. Any other exception, a crash, a sanitizer report or a broken promise
// (abort) is a finding.
//   tools/test runs it for a bounded time over the committed corpus (tests/fuzz/corpus).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/aliasing.h"
#include "kernels/schedule/api.h"
#include "lynx/lynx.h"

namespace {

using namespace lynx;

// Reads little-endian values from the input; zeros past its end.
struct Input {
  const uint8_t* p;
  size_t n;
  template <class T>
  T take() {
    T v{};
    const size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
  // A value in [lo, hi] most of the time, anything some of the time (the edges of the ranges).
  int64_t in(int64_t lo, int64_t hi) {
    const uint8_t mode = take<uint8_t>();
    const int64_t raw = take<int64_t>();
    if (mode % 8 == 0) return raw;
    return lo + int64_t(uint64_t(raw) % (uint64_t(hi - lo) + 1));
  }
  // align · [lo, hi] most of the time, anything some of the time.
  int64_t dim(int64_t align, int64_t lo, int64_t hi) {
    const uint8_t mode = take<uint8_t>();
    const int64_t raw = take<int64_t>();
    return mode % 8 == 0 ? raw : align * (lo + int64_t(uint64_t(raw) % (uint64_t(hi - lo) + 1)));
  }
  // Always in [lo, hi]: for the internal builder, whose problems come validated.
  int64_t within(int64_t lo, int64_t hi) { return lo + int64_t(uint64_t(take<int64_t>()) % (uint64_t(hi - lo) + 1)); }
};

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_api: broken promise: %s\n", what.c_str());
  std::abort();
}

void expect(bool ok, const std::string& what) {
  if (!ok) fail(what);
}

// A lynx::Error must name an argument and say something.
void check_error(const Error& e) {
  expect(!e.argument().empty(), std::string("an error without an argument: ") + e.what());
  expect(std::strlen(e.what()) > e.argument().size() + 2, std::string("an error that says nothing: ") + e.what());
}

TensorView view(Input& in, DType dtype, std::initializer_list<int64_t> shape) {
  // Mostly right, sometimes wrong in one way: dtype, a dimension, alignment, strides, absent.
  TensorView v = make_view(reinterpret_cast<void*>(uintptr_t(0x100000)), dtype, shape);
  switch (in.take<uint8_t>() % 12) {
    case 0: v.dtype = DType(in.take<uint8_t>() % 5); break;
    case 1: v.shape[in.take<uint8_t>() % kMaxTensorRank] = in.in(-2, 70000); break;
    case 2: v.data = reinterpret_cast<void*>(uintptr_t(0x100000) + in.take<uint8_t>()); break;
    case 3: {  // wrapping: in() is sometimes any value, and the sum must not overflow
      int64_t& stride = v.strides[in.take<uint8_t>() % kMaxTensorRank];
      stride = int64_t(uint64_t(stride) + uint64_t(in.in(-1, 3)));
      break;
    }
    case 4: v.data = nullptr; break;
    case 5: v.rank = int32_t(in.in(-1, 5)); break;
    default: break;
  }
  return v;
}

void fuzz_shape_and_config(Input& in) {
  LayerShape s;
  s.tokens = in.in(1, 300);
  s.hidden = in.dim(64, 1, 8);
  s.intermediate = in.dim(64, 1, 8);
  s.num_ranks = int32_t(in.in(1, 8));
  s.num_experts = in.dim(s.num_ranks >= 1 && s.num_ranks <= 64 ? s.num_ranks : 1, 1, 8);
  s.top_k = in.in(1, 8);
  s.shared_intermediate = in.dim(64, 0, 2);
  s.rank = int32_t(in.in(0, s.num_ranks >= 1 && s.num_ranks <= 64 ? s.num_ranks - 1 : 0));
  try {
    validate_shape(s);
  } catch (const Error& e) {
    check_error(e);
    return;
  }
  expect(s.tokens >= 1 && s.hidden % 64 == 0 && s.intermediate % 64 == 0 && s.num_experts % s.num_ranks == 0 &&
             s.top_k <= s.num_experts && s.rank < s.num_ranks,
         "validate_shape accepted a shape outside its rules");
  const int64_t worst = worst_case_schedule_rows(s);
  expect(worst % kTileRows == 0 && worst >= s.tokens * s.top_k * s.num_ranks &&
             worst <= Limits::kMaxRoutedRows + 1 - kTileRows,
         "worst_case_schedule_rows");
  // A capacity for a bounded load: whole tiles, at least the balanced rows, within the worst case, and
  // never smaller for a larger load.
  const double load = 1.0 + double(in.take<uint8_t>()) / 16.0;
  const int64_t bounded = schedule_capacity_for_load(s, load);
  expect(bounded % kTileRows == 0 && bounded >= s.tokens * s.top_k && bounded <= worst &&
             bounded <= schedule_capacity_for_load(s, load + 1.0),
         "schedule_capacity_for_load");
  Config c;
  c.schedule_capacity = in.take<uint8_t>() % 4 == 0 ? in.in(-200, 1 << 20) : 0;
  c.backend = Backend(in.in(0, 2));
  c.peer_timeout_ms = in.take<uint8_t>() % 4 == 0 ? in.in(-10, 4'000'000) : 0;
  c.save_forward_context = in.take<uint8_t>() % 2;
  c.precision = Precision(in.in(0, 2));  // 2: not a precision
  c.bf16_weight_grads = in.take<uint8_t>() % 2;
  c.caller_context = in.take<uint8_t>() % 4 == 0;
  ResolvedConfig r;
  try {
    r = resolve_config(s, c, DeviceInfo{});
  } catch (const Error& e) {
    check_error(e);
    return;
  }
  expect(r.schedule_capacity > 0 && r.schedule_capacity % kTileRows == 0 && r.schedule_capacity <= worst,
         "resolve_config's capacity");
  expect(r.backend == Backend::kFused || (r.backend == Backend::kUnfused && s.num_ranks == 1), "resolve_config's backend");
  expect(r.peer_timeout_ms > 0, "resolve_config's peer timeout");
  expect(r.precision == c.precision && (r.precision == Precision::kBf16 || r.precision == Precision::kFp8Block),
         "resolve_config's precision");
  expect(r.precision == Precision::kBf16 || r.backend == Backend::kFused, "FP8 on the unfused backend");
  expect(!r.caller_context || r.save_forward_context, "resolve_config's caller_context");
  expect(!r.bf16_weight_grads || r.precision == Precision::kFp8Block, "bf16 weight gradients outside FP8");

  // The tensors of a call on this shape.
  const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, E = s.local_experts(), k = s.top_k;
  const int64_t Is = s.shared_intermediate;
  LayerInputs li;
  li.x = view(in, DType::kBF16, {T, H});
  li.topk_ids = view(in, in.take<uint8_t>() % 2 ? DType::kI64 : DType::kI32, {T, k});
  li.topk_weights = view(in, DType::kF32, {T, k});
  li.weights.w_gate = view(in, DType::kBF16, {E, I, H});
  li.weights.w_up = view(in, DType::kBF16, {E, I, H});
  li.weights.w_down = view(in, DType::kBF16, {E, H, I});
  if (Is > 0 || in.take<uint8_t>() % 16 == 0) {
    li.weights.ws_gate = view(in, DType::kBF16, {Is, H});
    li.weights.ws_up = view(in, DType::kBF16, {Is, H});
    li.weights.ws_down = view(in, DType::kBF16, {H, Is});
  }
  Gradients g;
  g.dx = view(in, DType::kBF16, {T, H});
  g.d_topk_weights = view(in, DType::kF32, {T, k});
  g.dw_gate = view(in, DType::kBF16, {E, I, H});
  g.dw_up = view(in, DType::kBF16, {E, I, H});
  g.dw_down = view(in, DType::kBF16, {E, H, I});
  if (Is > 0) {
    g.dws_gate = view(in, DType::kBF16, {Is, H});
    g.dws_up = view(in, DType::kBF16, {Is, H});
    g.dws_down = view(in, DType::kBF16, {H, Is});
  }
  try {
    validate_inputs(s, li);
    const TensorView y = view(in, DType::kBF16, {T, H}), dy = view(in, DType::kBF16, {T, H});
    validate_output(s, y);
    validate_gradients(s, dy, g);
    api::check_forward_aliasing(li, y);
    api::check_backward_aliasing(li, dy, g);
  } catch (const Error& e) {
    check_error(e);
  }
}

// The host schedule builder on a fuzzed routing (ids anywhere, out of range included): each rank's
// schedule either reports an overflow or places every local (source, slot) exactly once, in its
// expert's block, padded to the tile height.
void fuzz_schedule(Input& in) {
  sched::Problem p;
  p.num_ranks = int32_t(in.within(1, 5));
  p.tokens = in.within(1, 40);
  p.top_k = in.within(1, 4);
  p.num_experts = p.num_ranks * in.within(1, 6);
  const int64_t entries = p.tokens * p.top_k, E_loc = p.local_experts();
  std::vector<std::vector<int32_t>> ids(p.num_ranks, std::vector<int32_t>(entries));
  std::vector<const int32_t*> ptrs;
  for (auto& v : ids) {
    for (auto& id : v) id = int32_t(in.in(-1, p.num_experts));  // out of range at times: not local anywhere
    ptrs.push_back(v.data());
  }
  p.capacity = kTileRows * in.within(0, 8);
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    p.rank = r;
    sched::HostSchedule out;
    const sched::HostResult res = build_schedule_host(p, ptrs.data(), out);
    expect(res.rows_needed % kTileRows == 0, "rows_needed is not padded");
    if (res.code == StatusCode::kCapacityOverflow) {
      expect(res.rows_needed > p.capacity, "an overflow within the capacity");
      continue;
    }
    expect(res.code == StatusCode::kOk && res.rows_needed <= p.capacity, "a build past the capacity");
    std::vector<int32_t> seen(size_t(p.num_ranks * entries), 0);
    for (int64_t e = 0; e < E_loc; ++e) {
      expect(out.expert_offset[e] % kTileRows == 0, "an expert block not on a tile");
      for (int64_t row = out.expert_offset[e]; row < out.expert_offset[e] + out.expert_rows[e]; ++row) {
        const int32_t s = out.row_src_rank[row], slot = out.row_token_slot[row];
        expect(s >= 0 && s < p.num_ranks && slot >= 0 && slot < entries, "a row out of range");
        expect(ids[s][slot] == r * E_loc + e, "a row in another expert's block");
        ++seen[s * entries + slot];
      }
    }
    for (int32_t s = 0; s < p.num_ranks; ++s) {
      for (int64_t i = 0; i < entries; ++i) {
        const bool local = ids[s][i] >= r * E_loc && ids[s][i] < (r + 1) * E_loc;
        expect(seen[s * entries + i] == (local ? 1 : 0), "a local entry placed other than once");
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  try {
    if (in.take<uint8_t>() % 2 == 0) {
      fuzz_shape_and_config(in);
    } else {
      fuzz_schedule(in);
    }
  } catch (const Error& e) {
    fail(std::string("an error escaped where none was expected: ") + e.what());
  } catch (const std::exception& e) {
    fail(std::string("an exception other than lynx::Error: ") + e.what());
  }
  return 0;
}
