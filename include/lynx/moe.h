// lynx: the MoE layer's public entry points.
//
//   y[t] = shared(x[t]) + Σ_j topk_weights[t,j] · f_e(x[t]),  e = topk_ids[t,j]
//   f_e(v) = w_down[e] · (silu(w_gate[e]·v) ⊙ (w_up[e]·v))
//
// A slot (t, j) whose id is -1 is not routed: it adds no term to y[t], its router weight is not read
// (any value), and its d_topk_weights is 0. Dropped tokens, and, with expert parallelism, a rank with
// fewer tokens than the others: it pads its tokens to the group's T with rows whose ids are all -1,
// and every output of its real tokens keeps the bits of one rank holding only the real tokens.
//
// Every call validates all its arguments on the host before it launches anything, and throws
// lynx::Error naming the argument at fault; among the checks, no output (y; dx, d_topk_weights and the
// weight gradients) may share a byte with another output or with an input of the call. Routing values that live on the device (expert ids out of
// range, non-finite router weights) are checked by the first kernel of the call; the error is
// reported by the call itself (paths that read back from the device) or by Workspace::check().
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "lynx/config.h"
#include "lynx/tensor.h"

namespace lynx {

// Expert weights, nn.Linear layout ("out × in", row-major, contiguous).
// The routed experts' weights are bf16, or (Config::precision == kFp8Block) the E4M3 tensors last given
// to set_quantized_weights. bf16 w_gate and w_up (and the gradients dw_gate and dw_up) may also have
// their experts at a stride of their own (strides {s, H, 1}, s ≥ I·H, a multiple of 64): the two
// halves of a concatenated [E_loc, 2I, H] gate_up tensor are taken as they lie, without copies.
struct ExpertWeights {
  TensorView w_gate;   // [E_loc, I, H] bf16 (or e4m3)
  TensorView w_up;     // [E_loc, I, H] bf16 (or e4m3)
  TensorView w_down;   // [E_loc, H, I] bf16 (or e4m3)
  TensorView ws_gate;  // [I_s, H] bf16, absent when shape.shared_intermediate == 0
  TensorView ws_up;    // [I_s, H] bf16, absent when shape.shared_intermediate == 0
  TensorView ws_down;  // [H, I_s] bf16, absent when shape.shared_intermediate == 0
};

// The inputs of one layer call on this rank. All tensors are device memory, contiguous (but for the
// expert stride above), 16-byte
// aligned; the expert weights (and their gradients) 128-byte aligned, as TMA needs. Where the memory
// lives is not checked (alignment, shapes and overlaps are): on systems where the GPU reads host memory
// (Grace Hopper, HMM) a pointer's kind says nothing about whether the kernels can read it, so a query
// would refuse memory that works. Elsewhere host memory faults in the first kernel that reads it.
struct LayerInputs {
  TensorView x;             // [T, H] bf16
  TensorView topk_ids;      // [T, k] int32 or int64, global expert ids in [0, E), or -1: not routed
  TensorView topk_weights;  // [T, k] fp32, finite where routed
  ExpertWeights weights;
};

// Outputs of backward. Weight gradients are overwritten, not accumulated. The weight gradients come in
// two groups, the routed experts' (dw_*) and the shared expert's (dws_*): give all three of a group, or
// none of them, and that group is not computed (frozen experts: the GEMMs and the steps that feed only
// them are skipped; the other outputs keep their bits).
struct Gradients {
  TensorView dx;              // [T, H] bf16
  TensorView d_topk_weights;  // [T, k] fp32
  TensorView dw_gate;         // [E_loc, I, H] bf16, or absent (with dw_up and dw_down)
  TensorView dw_up;           // [E_loc, I, H] bf16
  TensorView dw_down;         // [E_loc, H, I] bf16
  TensorView dws_gate;        // [I_s, H] bf16, absent when there is no shared expert (or not wanted)
  TensorView dws_up;          // [I_s, H] bf16
  TensorView dws_down;        // [H, I_s] bf16
};

// The device-side schedule: the ordered routed rows this rank computes (docs/design.md, "The schedule").
// Every pointer is device memory owned by the Workspace, valid until the next call that rebuilds it.
// The row arrays hold rows [0, expert_offset[E_loc]); the rows past that, up to capacity, are not
// written. A schedule over capacity (an error, Workspace::check) places no rows: then only
// expert_offset and expert_rows describe it, and the row arrays and slot_row still hold the last
// schedule that fitted.
struct Schedule {
  const int32_t* row_token_slot = nullptr;  // [capacity]  token*k + j of each row, -1 for padding
  const int32_t* row_src_rank = nullptr;    // [capacity]  source rank of each row, -1 for padding; null
                                            // at one rank (every row's: rank 0)
  const int32_t* expert_offset = nullptr;   // [E_loc + 1] first row of each local expert (padded)
  const int32_t* expert_rows = nullptr;     // [E_loc]     real (unpadded) rows of each local expert
  const int32_t* slot_row = nullptr;        // [T*k]       row of (t, j) when its expert is local, else -1
  int64_t capacity = 0;
  int64_t local_experts = 0;
};

// One forward's context held by the caller (Config::caller_context): device memory of
// Workspace::forward_context_bytes() bytes, 256-byte aligned, that forward or recompute_forward_context
// fills and the backward given it reads. `inputs`, `valid` and `layout` are set on the host by the call
// that filled it: what it was computed from (pointer identity, as has_context_for compares), and the
// filling workspace's context_layout(), which backward's must equal.
struct ForwardContext {
  void* data = nullptr;
  int64_t bytes = 0;
  const void* inputs[7] = {};
  bool valid = false;
  uint64_t layout = 0;
};

class Workspace {
 public:
  // Allocates every buffer the layer needs for `shape` on the current CUDA device; with
  // config.scratch_allocator, only those that live from call to call (lynx/allocator.h).
  Workspace(const LayerShape& shape, const Config& config = {});
  // An FP8 workspace (config.precision == kFp8Block) that reads `fp8_weights_of`'s E4M3 weight copies
  // from the start, as share_quantized_weights(fp8_weights_of, *this) makes it, without first
  // allocating copies of its own (6·E_loc·I·H bytes: 21 GiB at deepseek-v3); the same requirements.
  Workspace(const LayerShape& shape, const Config& config, Workspace& fp8_weights_of);
  // Waits for the workspace's device to finish all queued work (earlier calls may still use the
  // buffers), then frees everything.
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const LayerShape& shape() const;
  const ResolvedConfig& config() const;
  int64_t device_bytes() const;   // device memory this workspace owns
  int64_t scratch_bytes() const;  // device memory each call takes from Config::scratch_allocator (0 without one)
  int64_t forward_context_bytes() const;  // the size of a ForwardContext (0 unless Config::caller_context)
  // With Config::caller_context, a fingerprint of where the context's buffers lie and what fills them
  // (the shape with its rank, capacity, backend and precision): a backward takes a ForwardContext filled
  // by a workspace with the same one. Without it, a value of no meaning.
  uint64_t context_layout() const;
  int64_t context_bytes() const;  // of which: what forward keeps for backward, each buffer rounded up to
                                  // 1 KB (0 until a context exists)
  // The schedule of the last forward / recompute call. With Config::caller_context the schedule is
  // part of the caller's ForwardContext, which the workspace does not hold between calls: null arrays;
  // null arrays too before the first forward or recompute.
  Schedule schedule() const;
  // Whether backward on `in` can use the context this workspace holds: the same x, topk_ids,
  // topk_weights, w_gate, w_up (and shared ws_gate, ws_up) pointers as the forward or recompute that built it. Pointers are all
  // it can compare: a caller that frees and reuses that memory, or changes those tensors in place,
  // must call recompute_forward_context before backward.
  bool has_context_for(const LayerInputs& in) const;

  // Waits for `stream` (after the workspace's last call, wherever that was queued) and
  // throws lynx::Error if a kernel of an earlier call reported an error. An
  // error stays set until reported here (or by an unfused call, which reports it itself); until then
  // every later fused call on this workspace leaves y and dx unwritten. Its other routed outputs are
  // not to be used: after a schedule over capacity the expert weight gradients are exact zeros and
  // d_topk_weights is unwritten; after a bad route (an id out of range, a non-finite weight) they are
  // computed from the entries as they are and may be partial or NaN. The shared expert's gradients do
  // not depend on the routing and are written as usual. Call check() before anything consumes the
  // gradients (the optimizer step).
  void check(cudaStream_t stream) const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// A workspace's calls (forward, recompute_forward_context, backward, quantize_weights,
// set_quantized_weights) share its device state (the schedule's counters, the GEMMs' tile tickets, the
// status), so they run one after another: each call first makes its stream wait for the workspace's
// last call, wherever that was queued (an event recorded after each call), as check() does.
// Calls captured into a CUDA graph are not ordered so (a graph's launches are the caller's to order), nor
// are workspaces sharing FP8 weight copies against each other. For one layer's passes at once on two
// streams, give each stream a workspace of its own.

// y: [T, H] bf16. Builds the schedule, runs the layer, and (config.save_forward_context) keeps what
// backward needs in the workspace. On a Config::caller_context workspace it keeps no context (inference,
// or a forward no backward follows): what it uses of one (the schedule, the shared expert's gate and up
// products, at R > 1 in bf16 the gathered x rows; on the fused backend not the experts' gate and up
// products, which it does not write; on the unfused one the whole context) is taken for the call from
// config.scratch_allocator, or without one from a memory pool of the workspace's, on `stream`, and given
// back on `stream`.
void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, cudaStream_t stream);

// Rebuilds what backward needs from the inputs without producing y.
void recompute_forward_context(Workspace& ws, const LayerInputs& in, cudaStream_t stream);

// dy: [T, H] bf16. Needs the context of forward (saved) or recompute_forward_context for the same
// inputs.
void backward(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              cudaStream_t stream);

// Which of the weights' E4M3 copies quantize_weights makes: the forward's (w_gate, w_up and w_down in
// 128×128 blocks, read by forward and recompute_forward_context), the backward's (the transposed
// matrices its dgrads read), or both. Each alone reads the bf16 weights and writes its E4M3 copies, so
// that layers sharing a workspace quantise in each pass only what it reads; both at once read the
// weights once (but for w_gate and w_up where I % 128 != 0), a third less memory traffic than the two
// apart.
enum class Fp8Copies : int32_t { kBoth = 0, kForward = 1, kBackward = 2 };

// Config::precision == Precision::kFp8Block: makes the workspace's E4M3 copies of the routed experts'
// weights (one power-of-two scale per 128×128 block of each expert's matrix, and of the transposed
// matrices the backward's dgrads read; docs/fp8.md), which every later forward and backward reads. Call
// it before the first forward and again whenever the weights change (after each optimizer step), on the
// stream of the passes (or with the streams ordered: it rewrites copies a queued backward may still
// read): forward and recompute_forward_context throw unless the forward's copies were last made from
// the same w_gate, w_up and w_down tensors, and backward unless the backward's were (pointer identity,
// which cannot see values changed in place). At R > 1 each rank quantises its own experts' weights. A
// NaN or an infinity in the weights is reported by Workspace::check (the next forward then writes no
// y). No host synchronisation.
void quantize_weights(Workspace& ws, const ExpertWeights& weights, cudaStream_t stream,
                      Fp8Copies copies = Fp8Copies::kBoth);

// The routed experts' weights already in FP8 (made elsewhere): each matrix as E4M3 values with one fp32
// scale per 128×128 block, value = e4m3 · scale (quantize_weights' layout; any finite scale, not only
// powers of two). Scales [E_loc, I/128↑, H/128↑] for gate and up, [E_loc, H/128↑, I/128↑] for down.
struct Fp8ExpertWeights {
  TensorView w_gate, w_up;                // [E_loc, I, H] e4m3
  TensorView w_down;                      // [E_loc, H, I] e4m3
  TensorView w_gate_scales, w_up_scales;  // fp32
  TensorView w_down_scales;               // fp32
};

// Config::precision == kFp8Block, instead of quantize_weights: takes pre-quantised weights as the
// workspace's E4M3 copies (copied, on `stream`), and makes from their values the transposed copies the
// backward's dgrads read (quantised again in 128×128 blocks of the transposed matrices, power-of-two
// scales). Forward and backward are then given these three e4m3 tensors as the routed weights
// (LayerInputs::weights; pointer identity, as for quantize_weights). On the stream of the passes, as
// quantize_weights: it rewrites copies a queued backward may still read, and reads `weights` when the
// stream gets there. At R > 1 each rank gives its own experts'. A NaN scale or value is reported by
// Workspace::check. Weights quantised from bf16 ones by lynx's recipe (power-of-two block scales)
// give the forward quantize_weights gives; the backward too where I % 128 == 0 (each transposed block
// then holds one given block's values), while elsewhere blocks of [w_gate; w_up]ᵀ hold values of two
// given blocks and are rounded again where their scales differ. No host synchronisation.
void set_quantized_weights(Workspace& ws, const Fp8ExpertWeights& weights, cudaStream_t stream);

// Config::precision == kFp8Block: `to` reads `from`'s E4M3 copies of the routed experts' weights from
// now on, and its own are freed: for the workspaces of one layer made for different token counts, so
// that the layer keeps one set of copies (6·E_loc·I·H bytes) however many counts it is called at.
// quantize_weights or set_quantized_weights on any of them then makes the copies, and what they were
// made from, for all of them. Both must be one-rank FP8 workspaces of one device with the same hidden,
// intermediate and experts, and no other workspace may read `to`'s copies (it would go on reading them,
// never made again by a quantisation through `from` or `to`: share `from`'s with it first; sharing
// never splits a group). Use them on one stream (or with the streams ordered), as a new quantisation
// rewrites copies another's queued pass may read. Waits for the device. `to`'s device_bytes() no longer
// counts the copies (`from`'s does). A workspace made to share from the start (the Workspace
// constructor with `fp8_weights_of`) never holds copies of its own. The copies live until the last
// workspace that reads them goes; device_bytes() counts them only in the workspace that made them,
// while it reads them. A NaN or an infinity in the weights is named by the check() of the workspace the
// quantisation ran through, alone: the others' passes read the copies as they are, and their check()
// reports at most a consequence (h, or dg | du, not finite) and nothing for w_down (a NaN y); check
// every workspace of the group.
void share_quantized_weights(Workspace& from, Workspace& to);

// Pure host function: Workspace::forward_context_bytes() of a workspace made with (shape, config) and
// config.caller_context (its value is ignored here): what a ForwardContext needs, with no device.
// Throws where config.save_forward_context is false (no context to size).
int64_t forward_context_bytes(const LayerShape& shape, const Config& config);

// The same three calls with the context in `ctx` (Config::caller_context; recompute_forward_context and
// backward above are then errors, forward keeps no context): forward and recompute fill it, backward
// reads it and throws unless it was filled from these inputs. Each call's kernels use ctx.data; keep it
// alive until they have run.
void forward(Workspace& ws, const LayerInputs& in, const TensorView& y, ForwardContext& ctx, cudaStream_t stream);
void recompute_forward_context(Workspace& ws, const LayerInputs& in, ForwardContext& ctx, cudaStream_t stream);
void backward(Workspace& ws, const LayerInputs& in, const TensorView& dy, const Gradients& grads,
              const ForwardContext& ctx, cudaStream_t stream);

// Host-side argument checks (used by the calls above; public so bindings can check early). validate_inputs
// takes bf16 or e4m3 routed weights: which a workspace takes (its precision, the tensors last given to
// quantize_weights or set_quantized_weights) the calls check themselves.
void validate_inputs(const LayerShape& shape, const LayerInputs& in);
void validate_weights(const LayerShape& shape, const ExpertWeights& weights);  // bf16 routed weights
void validate_fp8_weights(const LayerShape& shape, const Fp8ExpertWeights& weights);
void validate_output(const LayerShape& shape, const TensorView& y);
void validate_gradients(const LayerShape& shape, const TensorView& dy, const Gradients& grads);

}  // namespace lynx
