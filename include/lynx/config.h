// lynx: layer shape, config, and the pure host functions that check and resolve them.
#pragma once

#include <cstdint>

namespace lynx {

class ScratchAllocator;  // lynx/allocator.h

// The sizes of one MoE layer as seen by one expert-parallel rank.
struct LayerShape {
  int64_t tokens = 0;               // T: tokens on this rank
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I: routed expert intermediate size
  int64_t num_experts = 0;          // E: experts over all ranks
  int64_t top_k = 0;                // k
  int64_t shared_intermediate = 0;  // I_s: shared expert intermediate size, 0 = no shared expert
  int32_t num_ranks = 1;            // R
  int32_t rank = 0;                 // this rank, in [0, R)

  int64_t local_experts() const { return num_ranks > 0 ? num_experts / num_ranks : 0; }
};

enum class Backend : int32_t {
  kAuto = 0,     // kFused (the fastest at most shapes; not at mixtral-8x7b: README)
  kUnfused = 1,  // schedule + gather + cuBLAS GEMMs + SwiGLU + combine; one host sync per call (the baseline)
  kFused = 2,    // TMA + wgmma expert kernels reading the schedule on the device: no host sync in
                 // forward or backward (capturable in CUDA graphs)
};

// The number format of the routed experts' GEMMs.
enum class Precision : int32_t {
  kBf16 = 0,      // bf16 operands, fp32 accumulation
  kFp8Block = 1,  // forward: E4M3 operands with power-of-two fp32 scales per 1×128 tile of x and h and per
                  // 128×128 block of the weights, promoted into fp32 once per 128-wide K block (docs/fp8.md);
                  // the weights' E4M3 copies made by quantize_weights, or given quantised with any fp32
                  // block scales by set_quantized_weights (moe.h). The backward's GEMMs too:
                  // the dgrads (dy and dg | du in 1×128 tiles, transposed weight copies) and the weight
                  // gradients (operands in 1×128 tiles along the tokens; bf16 with bf16_weight_grads).
                  // The shared expert stays bf16. Fused backend; at R > 1 the same on every rank, each
                  // quantising its own experts' weights, and every R gives one rank's bits.
};

// What a caller may choose. A zero means "choose for me" (see resolve_config). Every path is
// deterministic: the same inputs give the same bits, every call.
struct Config {
  int64_t schedule_capacity = 0;    // most routed rows (after padding) one call may schedule; 0: the worst case
  bool save_forward_context = true; // forward keeps what backward needs (else: recompute_forward_context)
  Backend backend = Backend::kAuto;
  // R > 1: how long a rank waits at a cross-rank barrier for the others before it reports the rank
  // that did not come and stops (its kernel traps, the CUDA context is lost); 0: 30 s.
  int64_t peer_timeout_ms = 0;
  // Where each call takes the workspace's scratch (lynx/allocator.h); it must outlive the workspace.
  // Null: the workspace owns its scratch for its whole life. At R > 1 what other ranks read (the
  // shared region: the token rows, the per-row results) stays the workspace's own.
  ScratchAllocator* scratch_allocator = nullptr;
  // The caller holds each forward's context (lynx::ForwardContext, moe.h): the workspace keeps none, and
  // any number of forwards may be in flight before their backwards; a forward given none keeps none. Needs
  // save_forward_context. At R > 1 every rank of a group makes the same choice, and each rank's backward is
  // given its own forward's context.
  bool caller_context = false;
  Precision precision = Precision::kBf16;
  // kFp8Block: the experts' weight gradients in bf16 (the recipe's option) instead of FP8.
  bool bf16_weight_grads = false;
};

// Rows of every expert's block in the schedule are padded to a multiple of this (the GEMM tile height).
constexpr int64_t kTileRows = 128;

// Limits of what the kernels accept; validate_shape enforces them.
struct Limits {
  static constexpr int64_t kMaxTokens = int64_t(1) << 20;
  static constexpr int64_t kHiddenAlign = 64;
  static constexpr int64_t kMaxHidden = 32768;
  static constexpr int64_t kIntermediateAlign = 64;
  static constexpr int64_t kMaxIntermediate = 65536;
  static constexpr int64_t kMaxExperts = 4096;
  static constexpr int64_t kMaxTopK = 32;
  static constexpr int32_t kMaxRanks = 64;
  static constexpr int64_t kMaxRoutedRows = (int64_t(1) << 31) - 1;  // rows are int32-indexed
  // Precision::kFp8Block: the schedule's rows (the FP8 GEMMs' M, and K of their weight gradients) below 2^30.
  static constexpr int64_t kMaxFp8ScheduleRows = (int64_t(1) << 30) - 128;
};

// What the device offers that the heuristics depend on.
struct DeviceInfo {
  int32_t sm_count = 132;
  int64_t global_memory_bytes = int64_t(141) << 30;
};

// Config with every zero replaced by a concrete choice.
struct ResolvedConfig {
  int64_t schedule_capacity;
  bool save_forward_context;
  Backend backend;
  int64_t peer_timeout_ms;
  ScratchAllocator* scratch_allocator;
  bool caller_context;
  Precision precision;
  bool bf16_weight_grads;
};

// Throws lynx::Error naming the field ("shape.hidden", ...) when the shape is not one the kernels take.
void validate_shape(const LayerShape& shape);

// Most rows a rank's schedule can need: every routed row of every rank lands here, and each local
// expert that receives any row is padded up to kTileRows.
int64_t worst_case_schedule_rows(const LayerShape& shape);

// A schedule capacity for routings that bring this rank at most `max_load` times its balanced share of
// the rows (T·k: every rank's T·k rows spread evenly over the R ranks): max_load·T·k rows with each
// local expert padded, rounded up to kTileRows, never above the worst case. At R > 1 the worst case
// (every rank's rows on this one) sizes the workspace for R times the balanced rows; a call whose
// routing needs more than this capacity computes nothing and reports a capacity overflow
// (Workspace::check). Pure host function; throws lynx::Error ("max_load") unless max_load >= 1.
int64_t schedule_capacity_for_load(const LayerShape& shape, double max_load);

// Pure host function: fills the zeros of `config` for `shape` on `device`, and throws lynx::Error
// naming the field ("config.schedule_capacity", ...) for values that are out of range.
ResolvedConfig resolve_config(const LayerShape& shape, const Config& config, const DeviceInfo& device);

}  // namespace lynx
