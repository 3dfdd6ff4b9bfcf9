#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/transport.h"
#include "common/cuda_check.h"
#include "common/current_device.h"
#include "kernels/expert_gemm/api.h"
#include "kernels/fp8/api.h"
#include "kernels/glue/api.h"
#include "kernels/peer/api.h"
#include "kernels/schedule/api.h"
#include "runtime/steps.h"
#include "runtime/workspace.h"

namespace lynx {
namespace {

DeviceInfo query_device(int device) {
  DeviceInfo info;
  LYNX_CUDA(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
  size_t free_bytes = 0, total_bytes = 0;
  LYNX_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  info.global_memory_bytes = static_cast<int64_t>(total_bytes);
  return info;
}

// n bytes of device memory, recorded in `into`; the error says what they were for and how much the
// workspace already holds.
void* device_alloc(int64_t n, std::vector<void*>& into, int64_t held, const char* what) {
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, static_cast<size_t>(n));
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error("", "cannot allocate " + std::to_string(n) + " bytes of device memory for " + what + " (" +
                        std::to_string(held) + " bytes already held): " + cudaGetErrorString(err));
  }
  into.push_back(p);
  return p;
}

// f8's weight fields: the store's.
void point_at_fp8_store(Fp8Buffers& f8, const Fp8WeightStore& st) {
  const Fp8Buffers& b = st.buffers;
  f8.w_gate = b.w_gate;
  f8.w_gate_scales = b.w_gate_scales;
  f8.w_up = b.w_up;
  f8.w_up_scales = b.w_up_scales;
  f8.w_down = b.w_down;
  f8.w_down_scales = b.w_down_scales;
  f8.w_down_t = b.w_down_t;
  f8.w_down_t_scales = b.w_down_t_scales;
  f8.w_gate_up_t = b.w_gate_up_t;
  f8.w_gate_up_t_scales = b.w_gate_up_t_scales;
}

// Workspace::context_layout: FNV-1a over what decides where a context's buffers lie (plan/context_layout.h:
// the shape, capacity and backend) and what they hold (the precision).
uint64_t fingerprint_context_layout(const LayerShape& s, int64_t capacity, const ResolvedConfig& c) {
  // NOTES: the order of plan/context_layout.h's buffers, as its version: a context filled by a build that
  // placed them otherwise is refused.
  constexpr int64_t kLayoutVersion = 2;
  uint64_t h = 14695981039346656037ull;
  for (const int64_t v : {kLayoutVersion, s.tokens, s.hidden, s.intermediate, s.num_experts, s.top_k,
                          s.shared_intermediate, int64_t(s.num_ranks), int64_t(s.rank), capacity, int64_t(c.backend),
                          int64_t(c.precision)}) {
    for (int i = 0; i < 8; ++i) h = (h ^ uint64_t((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  }
  return h;
}

}  // namespace

Fp8WeightStore::~Fp8WeightStore() {
  const detail::CurrentDevice on(device, std::nothrow);
  for (void* p : allocations) cudaFree(p);
  cudaGetLastError();
}

void Workspace::Impl::place_forward_only_context(const LayerShape& s, int64_t capacity) {
  const plan::ContextSizes sizes = plan::context_sizes(s, capacity, config.backend);
  const auto internal = [] {
    return Error("", "internal: the context's buffers are not those of plan/context_layout.h");
  };
  if (context_block.bytes != plan::context_block_bytes(sizes)) throw internal();
  // NOTES: what a forward keeping no context is lent is the block's start, so g and u must lie last, and
  // the gathered rows (R > 1) just before them.
  const auto offset_of = [&](auto& field) { return context_block.offset_of(reinterpret_cast<void**>(&field)); };
  if (offset_of(un.g) != plan::forward_only_bytes(sizes, true)) throw internal();
  const bool rows = sizes.xg > 0;
  if (rows && offset_of(un.xg) != plan::forward_only_bytes(sizes, false)) throw internal();
  // The bf16 gate/up GEMM reads the gathered rows at R > 1 (FP8 gathers x's tiles into scratch); the
  // unfused forward writes every buffer.
  const bool fp8_forward = config.precision == Precision::kFp8Block;
  context_forward_only_bytes = config.backend == Backend::kUnfused ? context_block.bytes
                                                                   : plan::forward_only_bytes(sizes, !fp8_forward);
  if (config.scratch_allocator == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    LYNX_CUDA(cudaMemPoolCreate(&context_pool, &props));
    int off = 0;
    LYNX_CUDA(cudaMemPoolSetAttribute(context_pool, cudaMemPoolReuseAllowInternalDependencies, &off));
  }
}

void Workspace::Impl::use_fp8_store(std::shared_ptr<Fp8WeightStore> store) {
  if (!fp8_store || !store) throw Error("", "internal: an FP8 weight store shared outside FP8");
  if (store == fp8_store) return;
  LYNX_CUDA(cudaDeviceSynchronize());
  if (counts_fp8_store) bytes -= fp8_store->bytes;  // this workspace's own copies: freed once no other reads them
  counts_fp8_store = false;
  fp8_store = std::move(store);
  point_at_fp8_store(f8, *fp8_store);
}

void* Workspace::Impl::alloc_bytes(int64_t n) {
  if (n == 0) return nullptr;
  void* p = device_alloc(n, allocations, bytes, "the workspace");
  bytes += n;
  return p;
}

Workspace::Impl::Impl(const LayerShape& s, const Config& c, std::shared_ptr<Fp8WeightStore> shared_store) : shape(s) {
  validate_shape(s);
  LYNX_CUDA(cudaGetDevice(&device));
  int major = 0;
  LYNX_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major != 9) {
    throw Error("", "device " + std::to_string(device) + " has compute capability " + std::to_string(major) +
                        ".x; lynx needs Hopper (sm_90)");
  }
  const DeviceInfo info = query_device(device);
  int l2 = 0;
  LYNX_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  device_props.sm_count = info.sm_count;
  device_props.l2_bytes = l2;
  device_props.schedule = sched::launch_limits();
#if LYNX_EXPERIMENTS
  overrides = plan::environment_overrides();
#endif
  replan();
  config = resolve_config(s, c, info);
  try {
    const int64_t T = s.tokens, H = s.hidden, I = s.intermediate, k = s.top_k, Is = s.shared_intermediate;
    const int64_t E_loc = s.local_experts(), cap = config.schedule_capacity;

    // NOTES: the region is one allocation of its own, so that cudaIpcGetMemHandle exports exactly it.
    const bool own_scratch = config.scratch_allocator == nullptr;
    // NOTES: the fused backwards queue dw_down, the dy rows' last use, before the dgrad of gate/up,
    // whose per-row dx then take the dy rows' memory: 2·cap·H bytes less (320 MiB at qwen3-30b-a3b).
    // The unfused backward computes its weight gradients last, from the dy rows.
    const bool rows_b_apart = config.backend != Backend::kFused;
    layout = comm::region_layout(
        s, cap, {.rows = own_scratch, .slot_row = !config.caller_context, .rows_b_apart = rows_b_apart});
    region = static_cast<char*>(alloc_bytes(layout.bytes));
    LYNX_CUDA(cudaMemset(region, 0, size_t(layout.bytes)));
    peer_tables = alloc<void*>(int64_t(comm::kTables) * s.num_ranks);
    status = in_region<DeviceStatus>(layout.status);
    LYNX_CUDA(cudaMallocHost(reinterpret_cast<void**>(&status_host), sizeof(DeviceStatus)));
    LYNX_CUDA(cudaMemset(&status->first_bad_route, 0xFF, sizeof(status->first_bad_route)));
    gemm_tickets = alloc<int32_t>(2);
    LYNX_CUDA(cudaMemset(gemm_tickets, 0, 2 * sizeof(int32_t)));
    LYNX_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&stall_report), sizeof(DeviceStatus), cudaHostAllocMapped));
    *stall_report = DeviceStatus{};
    LYNX_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&stall_report_device), stall_report, 0));
    // NOTES: one rank's checked ids are read by its own schedule build alone, within the call.
    if (s.num_ranks > 1) {
      ids32 = in_region<int32_t>(layout.ids32);
    } else {
      scratch(ids32, T * k);
    }

    problem.num_ranks = s.num_ranks;
    problem.rank = s.rank;
    problem.tokens = T;
    problem.top_k = k;
    problem.num_experts = s.num_experts;
    problem.capacity = cap;
    context_buffer(schedule.row_token_slot, cap);
    if (s.num_ranks == 1) {
      scratch(schedule.row_src_rank, cap);  // every row's source is this rank (Workspace::schedule)
    } else {
      context_buffer(schedule.row_src_rank, cap);
    }
    context_buffer(schedule.expert_offset, E_loc + 1);
    context_buffer(schedule.expert_rows, E_loc);
    context_buffer(schedule.block_offset, E_loc + 1);
    // NOTES: at R > 1 the other ranks write slot_row into the region, where the next forward's schedule
    // writes it again: a caller's context keeps a copy (fused_forward.cpp, close), which the combines read.
    if (config.caller_context) {
      context_buffer(schedule.slot_row, T * k);
    } else {
      schedule.slot_row = in_region<int32_t>(layout.slot_row);
    }
    scratch_ints = plan.schedule.scratch_ints();
    schedule.scratch = alloc<int32_t>(scratch_ints);
    schedule.status = status;
    schedule.stall_report = stall_report_device;
    LYNX_CUDA(cudaMallocHost(reinterpret_cast<void**>(&counts_host), sizeof(int32_t) * (2 * E_loc + 1)));
    LYNX_CUDA(cudaEventCreateWithFlags(&counts_ready, cudaEventDisableTiming));
    LYNX_CUDA(cudaEventCreateWithFlags(&last_call_done, cudaEventDisableTiming));

    // The context's order is plan/context_layout.h's: the shared expert's products before the rows.
    if (Is > 0) {
      context_buffer(un.gs, T * Is);
      context_buffer(un.us, T * Is);
    }
    // NOTES: at R = 1 backward gathers the x rows again (plan/context_layout.cpp says why); in FP8 with
    // FP8 weight gradients it reads x's tiles instead (fp8_backward.cpp), and needs no bf16 rows.
    const bool fp8_weight_grads = config.precision == Precision::kFp8Block && !config.bf16_weight_grads;
    if (s.num_ranks == 1) {
      if (!fp8_weight_grads) scratch(un.xg, cap * H);
    } else {
      context_buffer(un.xg, cap * H);
    }
    gate_up_by_slot = plan::gate_up_by_slot(s, config.backend);
    const int64_t gate_up_rows = gate_up_by_slot ? T * k : cap;
    context_buffer(un.g, gate_up_rows * I);
    context_buffer(un.u, gate_up_rows * I);
    scratch(un.h, cap * I);
    if (own_scratch || s.num_ranks > 1) {  // at R > 1 the other ranks read them
      un.rows_a = in_region<bf16_t>(layout.rows_a);
      un.rows_b = in_region<bf16_t>(layout.rows_b);
    } else {
      scratch(un.rows_a, cap * H);
      if (rows_b_apart) {
        scratch(un.rows_b, cap * H);
      } else {
        scratch_on(un.rows_b, un.rows_a);
      }
    }
    // NOTES: da's one reader, the SwiGLU backward, writes w·silu(g)⊙u over it in place (glue/api.h);
    // the forward's h is dead by then. [cap, I] bytes less (120 MiB at qwen3-30b-a3b).
    scratch_on(un.da, un.h);
    if (config.backend == Backend::kUnfused) {  // the fused backward keeps dg | du in fb.dgu
      scratch(un.dg, cap * I);
      scratch(un.du, cap * I);
    }
    if (Is > 0) {
      scratch(un.hs, T * Is);
      scratch(un.ys, T * H);
      scratch(un.dhs, T * Is);
      scratch(un.dgs, T * Is);
      scratch(un.dus, T * Is);
    }
    if (config.precision == Precision::kFp8Block) {
      const int64_t E = E_loc, kbH = fp8::blocks_of(H), kbI = fp8::blocks_of(I);
      const int64_t kb2I = fp8::blocks_of(2 * I);
      if (shared_store) {
        fp8_store = std::move(shared_store);
        counts_fp8_store = false;
      } else {
        fp8_store = std::make_shared<Fp8WeightStore>();
        fp8_store->device = device;
        counts_fp8_store = true;
        Fp8WeightStore& st = *fp8_store;
        const auto own = [&](auto*& field, int64_t count) {  // into the store, counted as this workspace's
          using T = std::remove_reference_t<decltype(*field)>;
          const int64_t n = count * int64_t(sizeof(T));
          field = static_cast<T*>(device_alloc(n, st.allocations, bytes, "the FP8 weight copies"));
          st.bytes += n;
          bytes += n;
        };
        Fp8Buffers& b = st.buffers;
        own(b.w_gate, E * I * H);
        own(b.w_gate_scales, E * kbI * kbH);
        own(b.w_up, E * I * H);
        own(b.w_up_scales, E * kbI * kbH);
        own(b.w_down, E * H * I);
        own(b.w_down_scales, E * kbH * kbI);
        own(b.w_down_t, E * I * H);
        own(b.w_down_t_scales, E * kbI * kbH);
        own(b.w_gate_up_t, E * H * 2 * I);
        own(b.w_gate_up_t_scales, E * kbH * kb2I);
      }
      point_at_fp8_store(f8, *fp8_store);
      // At R > 1 each rank's tiles are staged in its shared region's token rows (fp8_rows.cpp): H bytes
      // and 4 per 128 columns a token, within the 2·H of a bf16 row.
      if (s.num_ranks > 1 && H + 4 * kbH > 2 * H) throw Error("shape.hidden", "internal: FP8 tiles exceed a token row");
      if (s.num_ranks == 1) {
        scratch(f8.x, T * H);
        scratch(f8.x_scales, T * kbH);
      }
      scratch(f8.xg, cap * H);
      scratch(f8.xg_scales, cap * kbH);
      scratch(f8.h, cap * I);
      scratch(f8.h_scales, cap * kbI);
      scratch(f8.dgu, cap * 2 * I);
      scratch(f8.dgu_scales, cap * kb2I);
    }
    if (config.caller_context) place_forward_only_context(s, cap);
    context_layout = fingerprint_context_layout(s, cap, config);
    if (config.backend == Backend::kFused) {
      scratch(fb.dgu, cap * 2 * I);
      if (!gate_up_by_slot) {
        std::vector<int32_t> numbers(static_cast<size_t>(cap));
        std::iota(numbers.begin(), numbers.end(), 0);
        row_numbers = alloc<int32_t>(cap);
        LYNX_CUDA(cudaMemcpy(row_numbers, numbers.data(), sizeof(int32_t) * numbers.size(), cudaMemcpyHostToDevice));
      }
      gather_sync = alloc<int32_t>(gemm::gather_sync_ints(cap));
      LYNX_CUDA(cudaMemset(gather_sync, 0, sizeof(int32_t) * gemm::gather_sync_ints(cap)));
      gemm::prepare_expert_gemm_kernels(device_props.sm_count);
    }
    // NOTES: lynx's kernels are loaded now, and cuBLAS's for the shared expert (common/kernel_loading.h
    // says why): a pass that loaded one at its first launch could wait for its own cross-rank barrier,
    // or hold the host until the GPU is idle.
    glue::load_kernels();
    sched::load_schedule_kernels();
    sched::load_stage_routing_kernels();
    if (s.num_ranks > 1) peer::load_kernels();
    if (config.precision == Precision::kFp8Block) {
      fp8::load_quantize_kernels();
      fp8::load_gemm_kernels();
    }
    LYNX_CUBLAS(cublasCreate(&cublas));
    // NOTES: forward issues 3·E_loc grouped products and backward 6·E_loc, each with at most one
    // K tail of its own (kernels/cublas/products.h); room for both passes means a forward+backward step
    // never waits for the pool (GroupedGemm syncs only when full).
    grouped = std::make_unique<blas::GroupedGemm>(2 * 9 * E_loc);
    load_shared_expert_kernels(*this);
    // NOTES: cudaMemset runs on the default stream, which a caller's non-blocking stream does not
    // wait for: the status word, the tickets and the gather's counters must be set before the
    // constructor returns.
    LYNX_CUDA(cudaStreamSynchronize(nullptr));
  } catch (...) {
    release();
    throw;
  }
}

Workspace::Impl::~Impl() {
  // NOTES: kernels queued by earlier calls may still use these buffers (nothing here synchronises),
  // so destruction waits for the workspace's device, then frees everything on that device. An error
  // of the wait or the frees (say, after a trapped kernel) belongs to no later call: it is cleared.
  const detail::CurrentDevice on(device, std::nothrow);
  if (on.switched()) cudaDeviceSynchronize();
  release();
  cudaGetLastError();
}

peer::BarrierArgs Workspace::Impl::barrier_args() const {
  peer::BarrierArgs b;
  b.signals = table<peer::Signals>(comm::kSignals);
  b.status = status;
  b.rank = shape.rank;
  b.ranks = shape.num_ranks;
  b.stall_report = stall_report_device;
  b.timeout_ns = uint64_t(config.peer_timeout_ms) * 1'000'000ull;
  return b;
}

RowSources Workspace::Impl::row_sources(comm::Table t) const {
  if (ranks() == 1) return {};
  return {table<const void>(t), schedule.row_src_rank};
}

CombineSources Workspace::Impl::combine_sources(comm::Table rows) const {
  CombineSources c;
  if (ranks() == 1) return c;
  c.rows = table<const void>(rows);
  c.ids32 = ids32;
  c.local_experts = static_cast<int32_t>(shape.local_experts());
  return c;
}

void Workspace::Impl::connect(const std::vector<char*>& bases) {
  const std::vector<void*> tables = comm::peer_tables(layout, bases);
  LYNX_CUDA(cudaMemcpy(peer_tables, tables.data(), tables.size() * sizeof(void*), cudaMemcpyHostToDevice));
  peer_bases = bases;
}

plan::LayerPlan Workspace::Impl::plan_for(const plan::DeviceProps& props) const {
#if LYNX_EXPERIMENTS
  return plan::make_layer_plan(shape, props, overrides);
#else
  return plan::make_layer_plan(shape, props);
#endif
}

void Workspace::Impl::replan() { plan = plan_for(device_props); }

plan::DeviceProps Workspace::Impl::virtual_rank_props() const {
  // NOTES: the schedule kernels' grids of the R ranks must all be resident together (cooperative). The
  // expert GEMMs keep every SM: planned for 1/R of them too, R = 8's forward took 1.81 ms against 1.62
  // with full grids (2026-12-04, af72472 against 366ac75; R = 1 1.19).
  plan::DeviceProps props = device_props;
#if LYNX_EXPERIMENTS
  // LYNX_VIRTUAL_RANKS=serial (api/ranks.cpp): one rank's launches at a time, each with every SM.
  if (overrides.virtual_serial == 1) return props;
#endif
  props.schedule.sm_count = std::max(shape.num_ranks, props.schedule.sm_count / shape.num_ranks);
  props.ranks_sharing_sms = shape.num_ranks;
  return props;
}

plan::LayerPlan Workspace::Impl::virtual_rank_plan() const {
  const plan::LayerPlan p = plan_for(virtual_rank_props());
  // NOTES: fewer schedule blocks need less scratch than the workspace holds (chunks · pairs + pairs).
  if (p.schedule.scratch_ints() > scratch_ints) {
    throw Error("ranks", "internal: the virtual-rank schedule plan needs more scratch than the workspace holds");
  }
  return p;
}

void Workspace::Impl::become_virtual_rank(const plan::LayerPlan& p, cudaStream_t stream, cudaEvent_t fork,
                                          cudaEvent_t join) {
  device_props = virtual_rank_props();
  plan = p;
  rank_stream = stream;
  fork_event = fork;
  join_event = join;
}

void Workspace::Impl::release() {
  fp8_store.reset();
  for (char* base : opened) comm::close_region(base);
  opened.clear();
  if (rank_stream) cudaStreamDestroy(rank_stream);
  if (fork_event) cudaEventDestroy(fork_event);
  if (join_event) cudaEventDestroy(join_event);
  rank_stream = nullptr;
  fork_event = join_event = nullptr;
  grouped.reset();
  if (cublas) cublasDestroy(cublas);
  if (counts_ready) cudaEventDestroy(counts_ready);
  if (last_call_done) cudaEventDestroy(last_call_done);
  if (counts_host) cudaFreeHost(counts_host);
  if (status_host) cudaFreeHost(status_host);
  if (stall_report) cudaFreeHost(stall_report);
  stall_report = nullptr;
  for (void* p : allocations) cudaFree(p);
  // NOTES: blocks still lent are given back on their streams; the pool goes once they are.
  if (context_pool) cudaMemPoolDestroy(context_pool);
  context_pool = nullptr;
  cublas = nullptr;
  counts_ready = nullptr;
  last_call_done = nullptr;
  counts_host = nullptr;
  status_host = nullptr;
  allocations.clear();
}

void Workspace::Impl::throw_if_status_error(cudaStream_t stream) const {
  if (stall_report->code != int32_t(StatusCode::kOk)) throw Error("", describe_status(*stall_report, shape.top_k));
  if (status_host->code != int32_t(StatusCode::kOk)) {
    const std::string message = describe_status(*status_host, shape.top_k);
    LYNX_CUDA(cudaMemsetAsync(&status->code, 0, sizeof(status->code), stream));
    status_host->code = int32_t(StatusCode::kOk);
    throw Error("", message);
  }
}

Workspace::Workspace(const LayerShape& shape, const Config& config) : impl_(std::make_unique<Impl>(shape, config)) {}
Workspace::~Workspace() = default;

const LayerShape& Workspace::shape() const { return impl_->shape; }
const ResolvedConfig& Workspace::config() const { return impl_->config; }
int64_t Workspace::device_bytes() const { return impl_->bytes; }
int64_t Workspace::scratch_bytes() const { return impl_->scratch_block.bytes; }
int64_t Workspace::forward_context_bytes() const { return impl_->context_block.bytes; }
uint64_t Workspace::context_layout() const { return impl_->context_layout; }

bool Workspace::has_context_for(const LayerInputs& in) const {
  return impl_->context_valid && impl_->context == ContextKey::of(in);
}

int64_t Workspace::context_bytes() const {
  const Impl& w = *impl_;
  if (!w.context_valid) return 0;
  return plan::context_block_bytes(plan::context_sizes(w.shape, w.problem.capacity, w.config.backend));
}

Schedule Workspace::schedule() const {
  Schedule s;
  s.capacity = impl_->problem.capacity;
  s.local_experts = impl_->problem.local_experts();
  if (!impl_->schedule_built) return s;  // null arrays: nothing built yet
  s.row_token_slot = impl_->schedule.row_token_slot;
  s.row_src_rank = impl_->ranks() > 1 ? impl_->schedule.row_src_rank : nullptr;
  s.expert_offset = impl_->schedule.expert_offset;
  s.expert_rows = impl_->schedule.expert_rows;
  s.slot_row = impl_->schedule.slot_row;
  s.capacity = impl_->problem.capacity;
  s.local_experts = impl_->problem.local_experts();
  return s;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: the legacy stream while another is captured, say
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// NOTES: a workspace's calls share its device counters, schedule, status and buffers, so they must run
// one after another. Each call queued outside a CUDA-graph capture records its end (a call that threw
// too: some of its work may be queued); a call, or a check, first makes its stream wait for it. On the
// last call's own stream too: a handle does not name one stream (cudaStreamPerThread is each thread's
// own; a destroyed stream's handle may come back for a new one), and the wait costs a microsecond of
// host time. Not inside a capture (the callers ask: stream_capturing): a captured stream cannot wait for
// work outside it (cudaErrorStreamCaptureIsolation), and a captured call runs when its graph is
// launched, which the caller orders.
void Workspace::Impl::wait_for_last_call(cudaStream_t stream) const {
  if (last_call_recorded) LYNX_CUDA(cudaStreamWaitEvent(stream, last_call_done, 0));
}

void Workspace::Impl::record_call(cudaStream_t stream) {
  LYNX_CUDA(cudaEventRecord(last_call_done, stream));
  last_call_recorded = true;
}

void Workspace::Impl::record_failed_call(cudaStream_t stream) noexcept {
  try {
    record_call(stream);
  } catch (...) {  // the call's own error is the one to report
  }
}

void Workspace::check(cudaStream_t stream) const {
  // A trapped kernel leaves the context unusable: its stall report is the useful error then.
  if (!stream_capturing(stream)) impl_->wait_for_last_call(stream);
  const cudaError_t copy = cudaMemcpyAsync(impl_->status_host, impl_->status, sizeof(DeviceStatus),
                                           cudaMemcpyDeviceToHost, stream);
  const cudaError_t sync = copy == cudaSuccess ? cudaStreamSynchronize(stream) : copy;
  if (impl_->stall_report->code != int32_t(StatusCode::kOk)) {
    throw Error("", describe_status(*impl_->stall_report, impl_->shape.top_k));
  }
  LYNX_CUDA(sync);
  try {
    impl_->throw_if_status_error(stream);
  } catch (...) {
    impl_->record_failed_call(stream);  // the status' clearing, queued on `stream`
    throw;
  }
}

}  // namespace lynx
