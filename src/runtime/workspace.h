// What a Workspace owns: every device buffer of every path, the cuBLAS handle, the status word.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/region.h"
#include "common/bf16.h"
#include "common/peers.h"
#include "common/status.h"
#include "kernels/peer/api.h"
#include "kernels/cublas/api.h"
#include "kernels/schedule/api.h"
#include "lynx/error.h"
#include "lynx/moe.h"
#include "plan/context_layout.h"
#include "plan/layer_plan.h"

namespace lynx {

// Buffers of the passes (both backends). cap = schedule capacity rows. Comments give [rows, cols] and what each
// holds in forward / backward (buffers are reused between the two passes where lifetimes allow).
struct UnfusedBuffers {
  bf16_t* xg;       // [cap, H]  gathered x rows (scratch at R = 1, gathered again by backward; saved
                    //            context at R > 1)
  bf16_t* g;        // [cap, I]  gate pre-activation (saved context)
  bf16_t* u;        // [cap, I]  up projection (saved context)
  bf16_t* h;        // [cap, I]  fwd: silu(g)⊙u;            bwd: w · silu(g)⊙u (over da, in place)
  bf16_t* rows_a;   // [cap, H]  fwd: expert outputs y_e;   bwd: gathered dy rows
  bf16_t* rows_b;   // [cap, H]  bwd: per-row dx (fused: rows_a's memory, the dy rows done with)
  bf16_t* da;       // [cap, I]  bwd: dy_row · w_down[e] (h's memory)
  bf16_t* dg;       // [cap, I]  bwd
  bf16_t* du;       // [cap, I]  bwd
  // Shared expert (null when I_s == 0).
  bf16_t* gs;       // [T, I_s]  saved context
  bf16_t* us;       // [T, I_s]  saved context
  bf16_t* hs;       // [T, I_s]  fwd: silu(gs)⊙us;  bwd: recomputed for dws_down
  float* ys;        // [T, H]    fwd: shared output (fp32); bwd: shared dx (fp32)
  bf16_t* dhs;      // [T, I_s]  bwd
  bf16_t* dgs;      // [T, I_s]  bwd
  bf16_t* dus;      // [T, I_s]  bwd
};

// Extra buffers of the fused backward (allocated only for Backend::kFused).
struct FusedBuffers {
  bf16_t* dgu;  // [cap, 2I]  dg | du per row
};

// The FP8 forward's buffers (Config::precision == Precision::kFp8Block; all null otherwise). E4M3 values,
// fp32 scales (kernels/fp8/api.h): per 128×128 block of a weight, per 1×128 tile of a row; ↑ rounds up.
struct Fp8Buffers {
  // The routed experts' weights, made by quantize_weights (or given by set_quantized_weights: then the
  // block scales may be any fp32) and kept from call to call.
  uint8_t* w_gate;       // [E_loc, I, H]
  float* w_gate_scales;  // [E_loc, I/128↑, H/128↑]
  uint8_t* w_up;         // [E_loc, I, H]
  float* w_up_scales;    // [E_loc, I/128↑, H/128↑]
  uint8_t* w_down;       // [E_loc, H, I]
  float* w_down_scales;  // [E_loc, H/128↑, I/128↑]
  // Transposed, for the backward's dgrad GEMMs (blocks of the transposed matrices).
  uint8_t* w_down_t;          // [E_loc, I, H]   w_downᵀ
  float* w_down_t_scales;     // [E_loc, I/128↑, H/128↑]
  uint8_t* w_gate_up_t;       // [E_loc, H, 2I]  [w_gate; w_up]ᵀ
  float* w_gate_up_t_scales;  // [E_loc, H/128↑, 2I/128↑]
  // Scratch of a call. The weight gradients' transposed operands ([width, cap], scales [width, cap/128])
  // reuse the buffers of the same width, which hold at least as many scales.
  uint8_t* x;            // [T, H]    one rank: forward: x, quantised once per token; backward: dy
  float* x_scales;       // [T, H/128↑]
  uint8_t* xg;           // [cap, H]  their rows in schedule order; backward: dy's, dy's transposed, x's, x's transposed
  float* xg_scales;      // [cap, H/128↑]
  uint8_t* h;            // [cap, I]  silu(g)⊙u, quantised for the down GEMM; backward: w·silu(g)⊙u transposed
  float* h_scales;       // [cap, I/128↑]
  uint8_t* dgu;          // [cap, 2I] backward: dg | du, quantised for the dgrad of gate/up, then transposed
  float* dgu_scales;     // [cap, 2I/128↑]
};

// Elements from one expert's matrix to the next in an [E, rows, cols] view: rows · cols where contiguous;
// the routed gate and up weights and their gradients may have a stride of their own (validate.cpp).
inline int64_t expert_stride(const TensorView& v) { return v.shape[0] > 1 ? v.strides[0] : v.shape[1] * v.shape[2]; }

// The weights the FP8 copies were made from (pointer identity, as ContextKey compares): bf16 ones
// (quantize_weights) or pre-quantised e4m3 ones (set_quantized_weights); and whether any were.
struct QuantizedWeightsKey {
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* w_down = nullptr;
  DType dtype = DType::kBF16;
  bool valid = false;
  // The bf16 views' expert strides (a view's data pointer is not all of it); e4m3 weights are contiguous.
  int64_t gate_stride = 0, up_stride = 0;
  bool operator==(const QuantizedWeightsKey&) const = default;
  static QuantizedWeightsKey of(const ExpertWeights& w, DType dtype) {
    const bool bf16 = dtype == DType::kBF16;
    return {w.w_gate.data, w.w_up.data, w.w_down.data, dtype, true, bf16 ? expert_stride(w.w_gate) : 0,
            bf16 ? expert_stride(w.w_up) : 0};
  }
};

// The routed experts' E4M3 copies (the weight fields of `buffers`; its scratch fields unused) and what
// they were made from. Allocated by the workspace that made them; the workspaces of one layer at other
// token counts may use them too (share_quantized_weights), and the last of them to go frees them.
struct Fp8WeightStore {
  int device = 0;
  int64_t bytes = 0;
  std::vector<void*> allocations;
  Fp8Buffers buffers{};
  QuantizedWeightsKey forward;   // the weights w_gate, w_up and w_down were made from
  QuantizedWeightsKey backward;  // ... w_down_t and w_gate_up_t
  Fp8WeightStore() = default;
  Fp8WeightStore(const Fp8WeightStore&) = delete;
  Fp8WeightStore& operator=(const Fp8WeightStore&) = delete;
  ~Fp8WeightStore();  // frees on its device; whoever drops the last reference has waited for it
};

// Whether `stream` is being captured into a CUDA graph (an error answering it counts as captured).
bool stream_capturing(cudaStream_t stream);

// Identifies the inputs a saved forward context belongs to (the tensors it was computed from).
struct ContextKey {
  const void* x = nullptr;
  const void* topk_ids = nullptr;
  const void* topk_weights = nullptr;
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* ws_gate = nullptr;
  const void* ws_up = nullptr;
  bool operator==(const ContextKey&) const = default;

  static ContextKey of(const LayerInputs& in) {
    return {in.x.data, in.topk_ids.data, in.topk_weights.data, in.weights.w_gate.data, in.weights.w_up.data,
            in.weights.ws_gate.data, in.weights.ws_up.data};
  }
};

struct Workspace::Impl {
  LayerShape shape;
  ResolvedConfig config;
  int device = 0;
  int64_t bytes = 0;
  std::vector<void*> allocations;

  DeviceStatus* status = nullptr;       // device (in the shared region)
  DeviceStatus* status_host = nullptr;  // pinned
  int32_t* ids32 = nullptr;             // [T*k] validated int32 copy of topk_ids (in the shared region)

  // What other ranks read and write (comm/region.h), and how this rank reaches theirs (R > 1).
  char* region = nullptr;
  comm::RegionLayout layout{};
  std::vector<char*> peer_bases;  // [R]: every rank's region as this process addresses it; empty until connected
  std::vector<char*> opened;      // regions of other processes opened through CUDA IPC (closed by release)
  void** peer_tables = nullptr;   // device [comm::kTables * R] (comm::peer_tables)
  int64_t scratch_ints = 0;       // the schedule's scratch, as allocated
  // Virtual ranks (connect_ranks on one device): the stream this rank's compute step runs on, forked
  // from the caller's stream and joined back (api/ranks.cpp), and the events of the fork and join.
  cudaStream_t rank_stream = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
  sched::Problem problem;
  sched::DeviceBuffers schedule;
  int32_t* counts_host = nullptr;       // pinned: expert_offset [E_loc+1], then expert_rows [E_loc]
  cudaEvent_t counts_ready = nullptr;

  UnfusedBuffers un{};
  FusedBuffers fb{};
  Fp8Buffers f8{};  // its weight fields: fp8_store's
  std::shared_ptr<Fp8WeightStore> fp8_store;  // FP8: the weights' copies this workspace reads (null in bf16)
  bool counts_fp8_store = false;              // `bytes` counts fp8_store's (this workspace allocated it)
  cublasHandle_t cublas = nullptr;
  std::unique_ptr<blas::GroupedGemm> grouped;

  bool context_valid = false;
  // A forward given no ForwardContext on a caller_context workspace runs (runtime/context.h,
  // ContextLoan): it keeps no context.
  bool keeping_no_context = false;
  bool keeps_context() const { return config.save_forward_context && !keeping_no_context; }
  bool gate_up_by_slot = false;         // un.g, un.u are [T·k, I] by slot (plan/context_layout.h)
  int32_t* row_numbers = nullptr;       // fused, g and u by row: [capacity] 0, 1, ... (gemm::ExpertGemmArgs::gate_up_slot)
  ContextKey context;
  bool counts_on_host = false;          // counts_host holds the current schedule's counts
  bool schedule_built = false;          // a forward or recompute has queued a schedule build

  plan::DeviceProps device_props;
  plan::LayerPlan plan;             // every launch choice for this shape (plan/layer_plan.h)
  int32_t* gemm_tickets = nullptr;  // [2] device: the expert GEMM's tile ticket and finished CTAs; zero between launches
  int32_t* gather_sync = nullptr;   // fused: the in-kernel gather's counters (gemm::gather_sync_ints), zero between launches
  // Host-mapped (survives a trapped kernel): where a bounded device wait reports a stall.
  DeviceStatus* stall_report = nullptr;         // host pointer
  DeviceStatus* stall_report_device = nullptr;  // the same memory, as the device sees it
  // The end of the last call queued outside a CUDA-graph capture: a call or check waits for it first
  // (api::enqueue_calls). Neither on a stream being captured (stream_capturing).
  cudaEvent_t last_call_done = nullptr;
  bool last_call_recorded = false;
  void wait_for_last_call(cudaStream_t stream) const;
  void record_call(cudaStream_t stream);
  void record_failed_call(cudaStream_t stream) noexcept;  // record_call, its own errors dropped
  int64_t forward_calls = 0;                    // forward passes queued so far (stage omission, runtime/stages.h)
  int64_t backward_calls = 0;                   // backward passes queued so far
#if LYNX_EXPERIMENTS
  plan::Overrides overrides;                    // the environment's, then the test hooks' (experiments/test_hooks.h)
  int32_t test_stall_task = -1;                 // test hook: a gate/up tile the producer never loads
  int32_t test_gather_stall_block = -1;         // test hook: a row block the in-kernel gather never copies
#endif
  // The plan for this shape on `props` (and, in the experiments build, `overrides`).
  plan::LayerPlan plan_for(const plan::DeviceProps& props) const;
  // Makes the plan again from device_props: after it or `overrides` changed (a process group's ranks
  // found on one GPU; a test hook).
  void replan();

  // With `fp8_store`, an FP8 workspace reads that store's weight copies and allocates none (the caller
  // checked that they fit the shape and the device).
  Impl(const LayerShape& shape, const Config& config, std::shared_ptr<Fp8WeightStore> fp8_store = nullptr);
  ~Impl();
  void release();  // frees everything; safe to call twice
  // FP8: reads `store`'s weight copies from now on (its own are freed once no other workspace uses
  // them). Waits for the device first: queued passes may still read the copies being replaced.
  void use_fp8_store(std::shared_ptr<Fp8WeightStore> store);
  // Config::caller_context, once the context's buffers are placed: checks them against
  // plan/context_layout.h and sets context_forward_only_bytes.
  void place_forward_only_context(const LayerShape& s, int64_t capacity);

  template <class T>
  T* alloc(int64_t count) {
    return static_cast<T*>(alloc_bytes(count * int64_t(sizeof(T))));
  }
  void* alloc_bytes(int64_t bytes);

  // Buffers a call points into a block it is lent (the scratch from config.scratch_allocator, the
  // context from the caller's ForwardContext): each field stays null between calls, and a call points
  // it at its offset in the block (runtime/scratch.h, runtime/context.h).
  struct LentBlock {
    struct Slot {
      void** field;
      int64_t offset;
    };
    std::vector<Slot> slots;
    int64_t bytes = 0;
    void place(void** field, int64_t n) {
      // NOTES: 1 KB steps keep every buffer on the TMA's and the 16-byte vector loads' boundaries.
      *field = nullptr;
      slots.push_back({field, bytes});
      bytes += plan::lent_bytes(n);
    }
    // `field` lies on the block's `of`, placed before (their lifetimes within a call do not meet).
    void alias(void** field, void** of) {
      *field = nullptr;
      for (const Slot& s : slots) {
        if (s.field == of) {
          slots.push_back({field, s.offset});
          return;
        }
      }
      throw Error("", "internal: a lent buffer aliases one not placed before it");
    }
    // Points the buffers placed before `end` into the block at `base`, the others at null (a block lent
    // in part: runtime/context.h, ContextLoan).
    void bind(char* base, int64_t end = INT64_MAX) const {
      for (const Slot& s : slots) *s.field = s.offset < end ? base + s.offset : nullptr;
    }
    int64_t offset_of(void** field) const {
      for (const Slot& s : slots) {
        if (s.field == field) return s.offset;
      }
      throw Error("", "internal: a buffer not placed in a lent block");
    }
    void unbind() const {
      for (const Slot& s : slots) *s.field = nullptr;
    }
  };
  LentBlock scratch_block;  // empty without an allocator
  LentBlock context_block;  // empty unless config.caller_context
  // The start of context_block that a forward keeping no context is lent (plan::forward_only_bytes; the
  // whole block on the unfused backend, whose forward writes every buffer).
  int64_t context_forward_only_bytes = 0;
  // Where that block comes from without config.scratch_allocator: a pool of this workspace's that never
  // makes a stream wait for another's queued work to reuse a block (lynx/allocator.h says why: ranks on
  // streams of their own wait for one another inside their kernels).
  cudaMemPool_t context_pool = nullptr;
  uint64_t context_layout = 0;  // Workspace::context_layout
  // Scratch: the buffers a call needs only while it runs; allocated with the workspace unless
  // config.scratch_allocator lends them.
  template <class T>
  void scratch(T*& field, int64_t count) {
    if (config.scratch_allocator == nullptr) {
      field = alloc<T>(count);
    } else {
      scratch_block.place(reinterpret_cast<void**>(&field), count * int64_t(sizeof(T)));
    }
  }
  // Scratch on the memory of `of` (placed before): their lifetimes within a call do not meet.
  template <class T>
  void scratch_on(T*& field, T*& of) {
    if (config.scratch_allocator == nullptr) {
      field = of;
    } else {
      scratch_block.alias(reinterpret_cast<void**>(&field), reinterpret_cast<void**>(&of));
    }
  }
  // The forward context: what backward reads of its forward; allocated with the workspace unless
  // config.caller_context (the caller's ForwardContext holds it).
  template <class T>
  void context_buffer(T*& field, int64_t count) {
    if (!config.caller_context) {
      field = alloc<T>(count);
    } else {
      context_block.place(reinterpret_cast<void**>(&field), count * int64_t(sizeof(T)));
    }
  }

  int32_t ranks() const { return shape.num_ranks; }
  bool connected() const { return ranks() == 1 || !peer_bases.empty(); }
  template <class T>
  T* in_region(int64_t offset) const {
    return reinterpret_cast<T*>(region + offset);
  }
  // Table t of comm/region.h: R device pointers, as the kernels read them.
  template <class T = void>
  T* const* table(comm::Table t) const {
    return reinterpret_cast<T* const*>(peer_tables + int64_t(t) * ranks());
  }
  peer::BarrierArgs barrier_args() const;
  // R > 1: where each schedule row's copy of buffer `t` lies (its source rank's), and where the
  // combines pull each (t, j)'s row of `rows` (its expert's rank's); empty at R = 1.
  RowSources row_sources(comm::Table t) const;
  CombineSources combine_sources(comm::Table rows) const;
  // Points the tables at `bases` (every rank's region, rank order) and marks the workspace connected.
  void connect(const std::vector<char*>& bases);
  // Virtual ranks: the R ranks' passes run at once on one GPU, so each rank's schedule kernels (whose
  // grids must all be resident together) are planned for 1/R of its SMs.
  // virtual_rank_plan makes that plan and changes nothing; become_virtual_rank takes it, with the
  // driver's stream and events (owned from then on).
  plan::DeviceProps virtual_rank_props() const;
  plan::LayerPlan virtual_rank_plan() const;
  void become_virtual_rank(const plan::LayerPlan& p, cudaStream_t stream, cudaEvent_t fork, cudaEvent_t join);

  const int32_t* host_expert_offset() const { return counts_host; }
  const int32_t* host_expert_rows() const { return counts_host + problem.local_experts() + 1; }
  const int32_t* device_total_rows() const { return schedule.expert_offset + problem.local_experts(); }

  // Throws lynx::Error when *status_host (already copied back, `stream` waited for) or the stall
  // report holds an error; a reported routing/capacity error is first cleared on the device, in
  // `stream` order, so that the next call starts clean. (Errors stay set until reported: one call
  // cannot erase another's.)
  void throw_if_status_error(cudaStream_t stream) const;
};

}  // namespace lynx
