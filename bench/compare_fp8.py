#!/usr/bin/env python3
"""lynx's FP8 forward beside lynx BF16 and PyTorch's FP8 MoE paths in one process, same inputs,
interleaved rounds (lynx bf16, lynx fp8, lynx fp8 requant, torchao fp8, torch._scaled_grouped_mm,
lynx bf16, ...): the FP8 speed table. Per shape (--shape:
qwen3-30b-a3b, olmoe-1b-7b and deepseek-v3 by default; any of compare_torch.py's, or gpt-oss-like), the
forward and forward+backward times (CUDA events, median over --iters after --warmup, then median over
--rounds). The forward is the training forward (autograd on, its graph dropped); before every
forward+backward each gradient is None, as after zero_grad(set_to_none=True), and dy is one fixed
random tensor. All but torch._scaled_grouped_mm differentiate x, topk_weights and the three expert
weights.

- lynx bf16: lynx.moe with the default config.
- lynx fp8: lynx.moe with Config(precision="fp8_block") (docs/fp8.md: E4M3 operands for the routed
  experts' forward GEMMs, x and h scaled per 1x128 tile, the weights per 128x128 block, power-of-two
  scales; the backward's GEMMs too, the weight gradients' operands per 1x128 tile along the tokens). lynx makes the weights' FP8 copies itself when the weight tensors
  change (their version counters); they do not change here, so its timed calls reuse the copies.
- lynx fp8 requant: the same, with the weights' version counters bumped before every call
  (torch.autograd.graph.increment_version, no kernel), so that every timed forward makes the FP8 copies
  again, as the two PyTorch paths do and as the first forward after every optimizer step does. It shares
  lynx fp8's workspace; its bumps make lynx fp8 requantise once at its next call (a warm-up call, or
  with --warmup 0 one timed call, which the median absorbs).
- torchao fp8: the PyTorch path of compare_torch.moe_forward (argsort of the flattened topk_ids, rows
  gathered in expert order, SwiGLU experts, index_add_ combine weighted by topk_weights) with each of
  its three expert GEMMs (gate, up and down: three calls, as compare_torch.moe_forward makes them) done by
  torchao's _to_fp8_rowwise_then_scaled_grouped_mm (E4M3, scales per row of A and per (expert, column)
  of B over K, powers of two; FP8 in its backward too), every call quantising its operands, the
  weights included. Each expert's rows are padded with zero rows to a multiple of 16 (the FP8 grouped
  GEMM needs it; torchao's own padding is not supported in its forward), the padding dropped after.
- torch._scaled_grouped_mm: forward only (it has no autograd; run under torch.no_grad()): the same
  path with its GEMMs done by torch._scaled_grouped_mm (use_fast_accum=True) on operands quantised here
  with plain torch ops: E4M3, per row of A and per (expert, output column) of each weight, the
  dequantisation scale amax/448 (not rounded). x's rows are quantised once for gate and up, h once for
  down; the weights' quantisation is in every timed forward, as torchao's is.

Before timing, each implementation's y (and dx, where it has a backward) is checked against the bf16
PyTorch path (compare_torch.moe_forward and its autograd gradients): lynx bf16 by relative Frobenius
error (below 2e-2), the FP8 implementations by the dissimilarity 1 - 2<a,b>/(|a|^2+|b|^2) in float64
(below 1/192); a NaN or an infinity fails. Both measures are reported for all. A lynx implementation
that fails or raises is left out of that shape's timing and makes the exit status 1; a PyTorch path
that fails or raises is left out of that shape and reported (the exit status stays 0 for it); torchao
missing, or a torch without _scaled_grouped_mm, leaves that path out of the whole run, with the reason
printed. The SM clock is read before and after each shape's timed rounds. Per shape the speed-ups of
both lynx fp8 rows over lynx bf16 and over the faster PyTorch FP8 path of each pass (forward: either;
forward+backward: torchao's alone) are printed beside the targets (below). Each shape's rows are
printed, and the JSON rewritten, as soon as that shape is done, so that a run stopped by a time limit
keeps the shapes it finished; --budget-s starts no new shape after that many seconds."""

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import (SHAPES as BENCH_SHAPES, _commit, add_run_arguments, clear_grads, make_inputs,  # noqa: E402
                           median_ms, moe_forward, rel_err, run_each_shape, shape_names, sm_clock_mhz)

import lynx  # noqa: E402
from lynx import _workspaces  # noqa: E402

SHAPES = dict(BENCH_SHAPES, **{"gpt-oss-like": (8192, 2880, 2880, 32, 4)})  # name: (T, H, I, E, k)
DEFAULT_SHAPES = "qwen3-30b-a3b,olmoe-1b-7b,deepseek-v3"
REL_ERR_BOUND = 2e-2            # lynx bf16, as compare_peers.py
DISSIMILARITY_BOUND = 1 / 192   # the FP8 implementations
FP8_MAX = 448.0                 # largest finite E4M3
GROUP_ALIGN = 16                # rows per expert group of an FP8 grouped GEMM: a multiple of this
FP8 = lynx.Config(precision="fp8_block")
LYNX_FP8 = ("lynx fp8", "lynx fp8 requant")
TORCH_FP8 = ("torchao fp8", "torch._scaled_grouped_mm")
# The targets for lynx fp8's speed-up, by pass: over lynx bf16 at two shapes, and over
# the faster PyTorch FP8 path at every shape.
TARGET_OVER_BF16 = {"qwen3-30b-a3b": {"fwd_ms": 1.6, "fwd_bwd_ms": 1.4}, "deepseek-v3": {"fwd_ms": 1.7}}
TARGET_OVER_TORCH = {"fwd_ms": 1.5, "fwd_bwd_ms": 1.3}


class Impl(NamedTuple):
    fn: Callable      # (x, topk_ids, topk_weights, w_gate, w_up, w_down) -> y
    backward: bool    # differentiable (timed forward+backward, dx checked)


def load_torchao():
    """(_to_fp8_rowwise_then_scaled_grouped_mm or None, torchao's version or None, why it is missing or None)."""
    try:
        import torchao
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception as e:  # anything from a missing package to a Triton that fails to load
        return None, None, f"not importable ({type(e).__name__}: {e})"
    return _to_fp8_rowwise_then_scaled_grouped_mm, getattr(torchao, "__version__", None), None


def padded_groups(topk_ids, num_experts):
    """The PyTorch path's routing with each expert's rows padded to a multiple of GROUP_ALIGN:
    (order, token, pos, offs, rows): the slots sorted by expert (stable), their tokens, their rows in
    the padded layout, the int32 ends of the padded groups, and the layout's row count. That count is
    a bound, M + GROUP_ALIGN·E rounded up, known without a host synchronisation (as torchao's own
    padding sizes it); the rows past offs[-1] are in no group: no GEMM reads them, no result comes
    from them."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = torch.cumsum(padded, 0)
    # Sorted slot i of expert e is row i - start[e] of e's group, which starts at padded_start[e].
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)
    pos = torch.arange(flat.numel(), device=flat.device) + shift[flat[order]]
    rows = -(-(flat.numel() + GROUP_ALIGN * num_experts) // GROUP_ALIGN) * GROUP_ALIGN
    return order, order // k, pos, ends.to(torch.int32), rows


def padded_moe(experts):
    """compare_torch.moe_forward with experts(xs, offs, w_gate, w_up, w_down) on GROUP_ALIGN-padded groups."""
    def forward(x, topk_ids, topk_weights, w_gate, w_up, w_down):
        order, token, pos, offs, rows = padded_groups(topk_ids, w_gate.shape[0])
        xs = x.new_zeros(rows, x.shape[1]).index_copy(0, pos, x[token])
        ye = experts(xs, offs, w_gate, w_up, w_down)[pos]
        ye = ye * topk_weights.reshape(-1)[order].unsqueeze(1).to(ye.dtype)
        return torch.zeros_like(x).index_add_(0, token, ye)
    return forward


def torchao_experts(fp8_grouped_mm):
    """SwiGLU experts whose three GEMMs are torchao's differentiable FP8 grouped GEMM. B_t wants [E, K, N]
    per-group column-major: w.transpose(-2, -1) of a contiguous [E, N, K] weight is exactly that."""
    def experts(xs, offs, w_gate, w_up, w_down):
        def mm(a, w):
            return fp8_grouped_mm(a, w.transpose(-2, -1), offs, out_dtype=torch.bfloat16,
                                  float8_dtype=torch.float8_e4m3fn, pad_token_groups_for_grouped_mm=False)
        return mm(F.silu(mm(xs, w_gate)) * mm(xs, w_up), w_down)
    return experts


def quantize_rows(t):
    """E4M3 along the last dimension, one scale per row: (t_fp8, fp32 dequantisation scale amax/448 per
    row). An all-zero row (padding) gets a tiny scale and zeros, not 0/0."""
    scale = t.abs().amax(dim=-1).float().clamp(min=1e-12) / FP8_MAX
    # bf16 / fp32 promotes to fp32: one fp32 temporary, clamped in place.
    return (t / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def scaled_grouped_mm_experts(xs, offs, w_gate, w_up, w_down):
    """SwiGLU experts on torch._scaled_grouped_mm: A [M, K] row-major with scale_a [M], B [E, K, N]
    column-major (the transpose of a weight's [E, N, K] rows) with scale_b [E, N]."""
    def mm(a_quantized, w):
        (a, scale_a), (b, scale_b) = a_quantized, quantize_rows(w)
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
    xq = quantize_rows(xs)
    return mm(quantize_rows(F.silu(mm(xq, w_gate)) * mm(xq, w_up)), w_down)


def torch_fp8_impls(torchao_mm):
    """The PyTorch FP8 paths available here, and {name: why it is left out} for the others."""
    impls, missing = {}, {}
    if torchao_mm is not None:
        impls["torchao fp8"] = Impl(padded_moe(torchao_experts(torchao_mm)), True)
    if hasattr(torch, "_scaled_grouped_mm"):
        impls["torch._scaled_grouped_mm"] = Impl(torch.no_grad()(padded_moe(scaled_grouped_mm_experts)), False)
    else:
        missing["torch._scaled_grouped_mm"] = f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    return impls, missing


def lynx_impls(tag):
    # NOTES: lynx fp8 requant shares lynx fp8's workspace (tag and precision): a second set of E4M3 copies
    # did not fit 80 GB at deepseek-v3.
    def requantising(*inputs):
        for w in inputs[3:6]:
            torch.autograd.graph.increment_version(w)
        return lynx.moe(*inputs, config=FP8, workspace_tag=tag)
    return {"lynx bf16": Impl(lambda *a: lynx.moe(*a, workspace_tag=tag), True),
            "lynx fp8": Impl(lambda *a: lynx.moe(*a, config=FP8, workspace_tag=tag), True),
            "lynx fp8 requant": Impl(requantising, True)}


def dissimilarity(a, b):
    """1 - 2<a,b>/(|a|^2+|b|^2) in float64; nan or inf when either is not finite."""
    a, b = a.double(), b.double()
    return (1 - 2 * (a * b).sum() / (a.square().sum() + b.square().sum())).item()


def run_once(impl, inputs, leaves, dy):
    """(y, dx) of one forward(+backward) from gradients None; dx None without a backward."""
    clear_grads(leaves)
    y = impl.fn(*inputs)
    if not impl.backward:
        return y, None
    y.backward(dy)
    dx = inputs[0].grad
    clear_grads(leaves)
    return y.detach(), dx


def check_values(y, dx, ref_y, ref_dx):
    values = {"y_dissimilarity": dissimilarity(y, ref_y), "y_rel_err": rel_err(y, ref_y),
              "dx_dissimilarity": None, "dx_rel_err": None}
    if dx is not None:
        values.update(dx_dissimilarity=dissimilarity(dx, ref_dx), dx_rel_err=rel_err(dx, ref_dx))
    return values


def out_of_bounds(name, values):
    """The check values past their bound (not finite counts as past): lynx bf16's relative errors, the
    FP8 implementations' dissimilarities."""
    measure, bound = ("rel_err", REL_ERR_BOUND) if name == "lynx bf16" else ("dissimilarity", DISSIMILARITY_BOUND)
    keys = (f"y_{measure}", f"dx_{measure}")
    return [f"{key} {values[key]:.3e} (bound {bound:.3e})" for key in keys
            if values[key] is not None and not values[key] < bound]


def time_round(impl, inputs, leaves, dy, args):
    """(forward ms, forward+backward ms or None) of one round: each a median over args.iters after args.warmup."""
    def fwd():
        impl.fn(*inputs)

    def fwd_bwd():
        clear_grads(leaves)
        impl.fn(*inputs).backward(dy)
    ms = (median_ms(fwd, args.warmup, args.iters),
          median_ms(fwd_bwd, args.warmup, args.iters) if impl.backward else None)
    clear_grads(leaves)
    return ms


def check_all(name, impls, inputs, leaves, dy, failures, peer_failures):
    """Checks every implementation against the bf16 PyTorch path; drops from impls (in place) those that
    fail or raise, recording why (a lynx one in failures, a PyTorch one in peer_failures). Returns
    {implementation: check values} of those kept."""
    def drop(impl, why):
        (failures if impl.startswith("lynx") else peer_failures).append(f"{impl} at {name}: {why}")
        print(f"  {impl}: FAILED at this shape ({why}); left out of it", flush=True)
        del impls[impl]

    reference = Impl(moe_forward, True)
    run_once(reference, inputs, leaves, dy)  # warm-up
    ref_y, ref_dx = run_once(reference, inputs, leaves, dy)
    checks = {}
    for impl in list(impls):
        # Each implementation's first call is its warm-up (Triton autotuning, lynx's workspace); its second is checked.
        t0 = time.perf_counter()
        try:
            run_once(impls[impl], inputs, leaves, dy)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            y, dx = run_once(impls[impl], inputs, leaves, dy)
            if impl.startswith("lynx"):
                lynx.check()
            torch.cuda.synchronize()
        except Exception as e:
            clear_grads(leaves)
            drop(impl, f"{type(e).__name__}: {e}")
            continue
        values = check_values(y, dx, ref_y, ref_dx)
        del y, dx
        print(f"  {impl}: first call {first_s:.1f} s; second's y dissimilarity {values['y_dissimilarity']:.2e}, "
              f"relative error {values['y_rel_err']:.2e}"
              + ("" if values["dx_rel_err"] is None else
                 f"; dx dissimilarity {values['dx_dissimilarity']:.2e}, relative error {values['dx_rel_err']:.2e}"),
              flush=True)
        bad = out_of_bounds(impl, values)
        if bad:
            drop(impl, "wrong against the bf16 PyTorch path: " + ", ".join(bad))
        else:
            checks[impl] = values
    return checks


def speedups(shape, by_impl):
    """Both lynx fp8 rows over lynx bf16 and over the faster PyTorch FP8 path, per pass, with the FP8 targets."""
    out = []
    for mine in (m for m in LYNX_FP8 if m in by_impl):
        for col, pass_name in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
            bases = [("lynx bf16", TARGET_OVER_BF16.get(shape, {}).get(col))] if "lynx bf16" in by_impl else []
            peers = [p for p in TORCH_FP8 if p in by_impl and by_impl[p][col] is not None]
            if peers:
                bases.append((min(peers, key=lambda p: by_impl[p][col]), TARGET_OVER_TORCH[col]))
            for base, target in bases:
                ratio = by_impl[base][col] / by_impl[mine][col]
                out.append({"shape": shape, "impl": mine, "over": base, "pass": pass_name, "speedup": ratio,
                            "target": target, "met": None if target is None else ratio >= target})
    return out


def run_shape(name, tag, peers, args, failures, peer_failures):
    """Checks and times every implementation at one shape; returns (rows, speed-ups, clock readings)."""
    T, H, I, E, k = SHAPES[name]
    inputs = make_inputs(T, H, I, E, k, seed=2026)
    leaves = [t.requires_grad_() for t in (inputs[0], inputs[2], inputs[3], inputs[4], inputs[5])]
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(7))
    impls = {**lynx_impls(tag), **peers}
    print(f"{name} (T, H, I, E, k) = {SHAPES[name]}", flush=True)
    checks = check_all(name, impls, inputs, leaves, dy, failures, peer_failures)

    times = {impl: ([], []) for impl in impls}
    clocks = {"sm_mhz_before": sm_clock_mhz()}
    for _ in range(args.rounds):
        for impl, runner in impls.items():
            fwd_ms, fwd_bwd_ms = time_round(runner, inputs, leaves, dy, args)
            times[impl][0].append(fwd_ms)
            times[impl][1].append(fwd_bwd_ms)
            if impl.startswith("lynx"):
                lynx.check()
    clocks["sm_mhz_after"] = sm_clock_mhz()
    print(f"  SM clock before/after the timed rounds: {clocks['sm_mhz_before']} / {clocks['sm_mhz_after']} MHz")

    rows = []
    for impl, runner in impls.items():
        fwd, fwd_bwd = times[impl][0], times[impl][1] if runner.backward else None
        rows.append({"shape": name, "T": T, "H": H, "I": I, "E": E, "k": k, "impl": impl,
                     "fwd_ms": statistics.median(fwd),
                     "fwd_bwd_ms": None if fwd_bwd is None else statistics.median(fwd_bwd),
                     "fwd_ms_rounds": fwd, "fwd_bwd_ms_rounds": fwd_bwd, **checks[impl]})
    return rows, speedups(name, {r["impl"]: r for r in rows}), clocks


def cell(value, spec, width):
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def print_table(rows, ups):
    print(f"\n{'shape':15} {'impl':26} {'fwd ms':>8} {'fwd+bwd ms':>10} {'y dissim':>9} {'dx dissim':>9}", flush=True)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for r in (r for r in rows if r["shape"] == shape):
            print(f"{shape:15} {r['impl']:26} {r['fwd_ms']:8.3f} {cell(r['fwd_bwd_ms'], '.3f', 10)} "
                  f"{r['y_dissimilarity']:9.2e} {cell(r['dx_dissimilarity'], '.2e', 9)}")
        for u in (u for u in ups if u["shape"] == shape):
            over = u["over"] + ("" if u["over"] == "lynx bf16" else " (the faster PyTorch FP8 path)")
            target = "" if u["target"] is None else f"  target {u['target']:.1f}x: {'met' if u['met'] else 'NOT met'}"
            print(f"{shape:15} {u['impl']} over {over}, {u['pass']}: {u['speedup']:.2f}x{target}")
    print(f"(bounds: lynx bf16 relative error below {REL_ERR_BOUND:g}, FP8 dissimilarity below "
          f"{DISSIMILARITY_BOUND:.3e}; '-': no backward)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, SHAPES, DEFAULT_SHAPES)
    args = parser.parse_args()
    names = shape_names(parser, args, SHAPES)
    if not torch.cuda.is_available():
        print("compare_fp8: no CUDA GPU available", file=sys.stderr)
        return 2
    torchao_mm, torchao_version, torchao_missing = load_torchao()
    peers, missing = torch_fp8_impls(torchao_mm)
    if torchao_missing:
        missing["torchao fp8"] = torchao_missing
    for impl, why in missing.items():
        print(f"{impl}: left out ({why})")
    rows, ups, clocks, failures, peer_failures, skipped = [], [], {}, [], [], []

    def write_json():  # after every shape, so that a run stopped by a time limit keeps what it finished
        if not args.json:
            return
        out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "commit": _commit(),
               "command": " ".join(sys.argv), "torch": torch.__version__, "torchao": torchao_version,
               "left_out": missing, "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
               "bounds": {"lynx_bf16_rel_err": REL_ERR_BOUND, "fp8_dissimilarity": DISSIMILARITY_BOUND},
               "clocks": clocks, "failures": failures, "peer_failures": peer_failures, "skipped": skipped,
               "results": rows, "speedups": ups}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    def shape(i, name):
        tag = 1000 + i  # every lynx row's (their precisions keep bf16's and FP8's workspaces apart)
        try:
            shape_rows, shape_ups, clocks[name] = run_shape(name, tag, peers, args, failures, peer_failures)
        finally:
            _workspaces.release(tag)  # this shape's tensors went with run_shape; its workspaces go now
        rows.extend(shape_rows)
        ups.extend(shape_ups)
        if shape_rows:
            print_table(shape_rows, shape_ups)

    run_each_shape(names, args.budget_s, "compare_fp8", failures, skipped, shape, write_json)
    if len({r["shape"] for r in rows}) > 1:
        print_table(rows, ups)
    write_json()
    if peer_failures:
        print("compare_fp8: PyTorch paths left out of a shape: " + "; ".join(peer_failures))
    if failures:
        print("compare_fp8: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
