#!/usr/bin/env python3
"""lynx beside its peers in one process, same inputs, interleaved rounds (lynx, SonicMoE, PyTorch path,
lynx, ...): per shape (compare_torch.py's four plus gpt-oss-like), the forward and forward+backward
times (CUDA events, median over --iters after --warmup, then median over --rounds), the memory kept
between forward and backward (memory_allocated() after a forward, y and its graph alive, minus before)
and the peak of forward+backward (max_memory_allocated() minus the start), measured the same way for
all three from a clean state (gradients None, cache emptied). lynx's scratch and forward context come
from PyTorch's caching allocator, so memory_allocated() sees them; what its workspaces allocate
themselves (Workspace.device_bytes) is added to lynx's numbers and shown on its own. The forward is
the training forward (autograd on, its graph dropped); before every forward+backward each gradient
is None, as after zero_grad(set_to_none=True), and dy is one fixed random tensor. topk_weights is
trained too (all three differentiate it). Before timing, each implementation's y and dx are checked
against the PyTorch path's (relative Frobenius error, at most 2e-2): lynx off stops the run (exit 1);
SonicMoE off, or raising, is left out of that shape and reported (exit 1 at the end). The SM clock is
read before and after each shape's timed rounds.

SonicMoE (optional; --no-sonic leaves it out) is called with the given routing through
sonicmoe.moe_general_routing_inputs, gate and up interleaved into one [E, 2I, H] parameter built from
the same values; its first call at a shape compiles and autotunes and is the untimed warm-up: over
150 s at qwen3-30b-a3b on an H200 (2026-12-04), ~80 GEMM configurations of six quack GEMMs and two
Triton autotunes. Its caches (compiled kernels, autotune picks) go to one folder, $SONIC_CACHE
(default /tmp/sonic-cache): kept from one run to the next (archive it after a run, unpack it before
the next), later first calls only look the picks up, and the kernels measured are the same ones. The
compiled kernels do not depend on the shape, the picks do. Without a package registry: unpack
sonic-moe's wheels and their dependencies' (downloaded elsewhere) into a folder, e.g. /tmp/peers, and
`export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/python_packages:$PYTHONPATH` (exported:
SonicMoE's autotuner compiles in subprocesses that must import it too).

Weight gradients (the first CHECK_EXPERTS experts) and topk_weights' gradient are compared too; a
mismatch there is reported and fails the run (exit 1) but does not stop it. Each shape's rows are
printed, and the JSON rewritten, as soon as that shape is done, so that a run stopped by a time limit
keeps the shapes it finished; --budget-s starts no new shape after that many seconds."""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import (SHAPES as BENCH_SHAPES, _commit, add_run_arguments, clear_grads, make_inputs,  # noqa: E402
                           median_ms, moe_forward, rel_err, run_each_shape, shape_names, sm_clock_mhz)

import lynx  # noqa: E402
from lynx import _workspaces  # noqa: E402

SHAPES = dict(BENCH_SHAPES, **{"gpt-oss-like": (8192, 2880, 2880, 32, 4)})  # name: (T, H, I, E, k)
TOLERANCE = 2e-2
MIB = 2**20
CHECK_EXPERTS = 8  # weight gradients compared on this many experts (all of them would need GiBs in fp32)


def load_sonic(skip):
    """(the sonicmoe module or None, why it is missing or None)."""
    if skip:
        return None, "left out (--no-sonic)"
    # NOTES: quack (SonicMoE's GEMMs) keeps compiled kernels and autotune picks in QUACK_CACHE_DIR, and
    # Triton its kernels in TRITON_CACHE_DIR (its picks too with TRITON_CACHE_AUTOTUNING): one folder
    # that can be kept from one run to the next; and quack compiles its candidates on every CPU.
    cache = os.environ.setdefault("SONIC_CACHE", "/tmp/sonic-cache")
    os.environ.setdefault("QUACK_CACHE_DIR", cache + "/quack")
    os.environ.setdefault("TRITON_CACHE_DIR", cache + "/triton")
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("QUACK_COMPILE_WORKERS", str(os.cpu_count() or 8))
    try:
        import sonicmoe
        import sonicmoe.enums  # noqa: F401
    except Exception as e:  # anything from a missing package to the CuTe DSL failing to load
        return None, f"not importable ({type(e).__name__}: {e})"
    return sonicmoe, None


def sonic_version():
    try:
        from importlib.metadata import version
        return version("sonic-moe")
    except Exception:
        return None


def sonic_impl(sonic, topk_ids, w_gate, w_up):
    """SonicMoE as (x, topk_ids, topk_weights, w_gate, w_up, w_down) -> y, and the leaf it trains in place of
    w_gate and w_up: [E, 2I, H], row 2i gate row i, row 2i+1 up row i, built here once from w_gate and w_up.
    Routing as the peers' README gives it: router_scores = topk_weights flattened (fp32), token_indices =
    each token's index repeated k times (int32, sorted), expert_indices = topk_ids flattened (int32)."""
    T, k = topk_ids.shape
    E, I, H = w_gate.shape
    w1 = torch.stack([w_gate.detach(), w_up.detach()], dim=2).reshape(E, 2 * I, H).contiguous().requires_grad_()
    # token_indices depend on (T, k) alone (a layer would keep them); expert_indices are converted from the
    # topk_ids of each call, as lynx and the PyTorch path take theirs.
    tokens = torch.arange(T, device=topk_ids.device, dtype=torch.int32).repeat_interleave(k)
    swiglu = sonic.enums.ActivationType.SWIGLU

    def run(x, topk_ids, topk_weights, w_gate, w_up, w_down):
        experts = topk_ids.reshape(-1).to(torch.int32)
        y, _ = sonic.moe_general_routing_inputs(x, topk_weights.reshape(-1), tokens, experts, w1.permute(1, 2, 0),
                                                None, w_down.permute(1, 2, 0), None, E,
                                                torch.cuda.current_stream().cuda_stream, swiglu)
        return y
    return run, w1


def workspace_own_bytes():
    return sum(ws.device_bytes() for ws in _workspaces.all_workspaces())


def forward_backward(fn, inputs, leaves, dy, w1=None):
    """One forward+backward from gradients None; returns (y, {gradient name: tensor or None}): dx,
    d_topk_weights, and dw_gate, dw_up, dw_down of the first CHECK_EXPERTS experts (copies). With w1
    (SonicMoE's interleaved gate/up leaf) dw_gate and dw_up are read from w1.grad."""
    clear_grads(leaves)
    y = fn(*inputs)
    y.backward(dy)
    x, _, topk_weights, w_gate, w_up, w_down = inputs
    n = min(CHECK_EXPERTS, w_gate.shape[0])

    def first(g):
        return None if g is None else g[:n].clone()
    if w1 is not None:
        E, I, H = w_gate.shape
        g = None if w1.grad is None else w1.grad.reshape(E, I, 2, H)
        dw_gate, dw_up = (None, None) if g is None else (g[:n, :, 0].clone(), g[:n, :, 1].clone())
    else:
        dw_gate, dw_up = first(w_gate.grad), first(w_up.grad)
    grads = {"dx": x.grad, "d_topk_weights": topk_weights.grad, "dw_gate": dw_gate, "dw_up": dw_up,
             "dw_down": first(w_down.grad)}
    clear_grads(leaves)
    return y.detach(), grads


def grad_err(a, b):
    """rel_err, nan when an implementation gave no gradient."""
    return float("nan") if a is None or b is None else rel_err(a, b)


def measure_memory(name, fn, inputs, leaves, dy):
    """(held, peak, workspace-own, gradients) MiB, read the same way for every implementation; lynx's
    workspace-own bytes are added to its held and peak. The peak counts the gradients that the backward
    allocates (every one is None before it, as after zero_grad(set_to_none=True)): the same bytes for all
    three, given as the fourth number."""
    clear_grads(leaves)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = fn(*inputs)
    torch.cuda.synchronize()
    own = workspace_own_bytes() if name == "lynx" else 0
    held = torch.cuda.memory_allocated() - start + own
    y.backward(dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start + own
    grads = sum(t.grad.numel() * t.grad.element_size() for t in leaves if t.grad is not None)
    del y
    clear_grads(leaves)
    return held / MIB, peak / MIB, own / MIB, grads / MIB


def time_round(fn, inputs, leaves, dy, args):
    """(forward ms, forward+backward ms) of one round: each a median over args.iters after args.warmup."""
    def fwd():
        fn(*inputs)

    def fwd_bwd():
        clear_grads(leaves)
        fn(*inputs).backward(dy)
    ms = median_ms(fwd, args.warmup, args.iters), median_ms(fwd_bwd, args.warmup, args.iters)
    clear_grads(leaves)
    return ms


def run_shape(name, tag, sonic, args, failures):
    """Checks, measures and times every implementation at one shape; returns (rows, clock readings)."""
    T, H, I, E, k = SHAPES[name]
    inputs = make_inputs(T, H, I, E, k, seed=2026)
    x, topk_ids, topk_weights, w_gate, w_up, w_down = inputs
    leaves = [t.requires_grad_() for t in (x, topk_weights, w_gate, w_up, w_down)]
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(7))
    impls = {"lynx": lambda *a: lynx.moe(*a, workspace_tag=tag)}
    w1 = None
    if sonic is not None:
        impls["sonicmoe"], w1 = sonic_impl(sonic, topk_ids, w_gate, w_up)
        leaves.append(w1)
    impls["torch"] = moe_forward
    print(f"{name} (T, H, I, E, k) = {SHAPES[name]}", flush=True)

    # Correctness first. Each implementation's first call is its warm-up (SonicMoE compiles and autotunes
    # then, running its kernels many times over); its second call, as the timed ones run, is checked.
    t0 = time.perf_counter()
    forward_backward(moe_forward, inputs, leaves, dy)
    torch.cuda.synchronize()
    print(f"  torch: first forward+backward {time.perf_counter() - t0:.1f} s", flush=True)
    ref_y, ref_grads = forward_backward(moe_forward, inputs, leaves, dy)
    errors = {"torch": {"y": 0.0, **{g: 0.0 for g in ref_grads}}}
    for impl in [n for n in impls if n != "torch"]:
        if impl == "sonicmoe":
            print("  sonicmoe: warm-up, JIT-compiling and autotuning this shape (over 400 s on a cold cache, 2026-12-05) ...", flush=True)
        t0 = time.perf_counter()
        try:
            forward_backward(impls[impl], inputs, leaves, dy, w1 if impl == "sonicmoe" else None)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            y, grads = forward_backward(impls[impl], inputs, leaves, dy, w1 if impl == "sonicmoe" else None)
            torch.cuda.synchronize()
        except Exception as e:
            if impl != "sonicmoe":
                raise
            failures.append(f"sonicmoe at {name}: {type(e).__name__}: {e}")
            print(f"  sonicmoe: FAILED at this shape ({type(e).__name__}: {e}); left out of it", flush=True)
            del impls[impl]
            leaves = [t for t in leaves if t is not w1]  # not list.remove: it compares tensors with ==
            w1 = None
            continue
        if impl == "lynx":
            lynx.check()
        err = {"y": rel_err(y, ref_y), **{g: grad_err(grads[g], ref_grads[g]) for g in ref_grads}}
        print(f"  {impl}: first forward+backward {first_s:.1f} s; second's relative error vs torch "
              + ", ".join(f"{g} {e:.2e}" for g, e in err.items()), flush=True)
        del y, grads
        if not (err["y"] <= TOLERANCE and err["dx"] <= TOLERANCE):
            why = (f"{impl} at {name} is wrong against the PyTorch path: relative error y {err['y']:.3e}, "
                   f"dx {err['dx']:.3e} (limit {TOLERANCE:g}, non-finite fails)")
            if impl != "sonicmoe":
                sys.exit(f"compare_peers: {why}")
            failures.append(why)
            print("  sonicmoe: WRONG at this shape; left out of it", flush=True)
            del impls[impl]
            leaves = [t for t in leaves if t is not w1]  # not list.remove: it compares tensors with ==
            w1 = None
            continue
        bad = [g for g in ref_grads if g != "dx" and not err[g] <= TOLERANCE]
        if bad:  # reported, and the run fails at its end, but the timing goes on
            failures.append(f"{impl} at {name}: gradients off against the PyTorch path (limit {TOLERANCE:g}): "
                            + ", ".join(f"{g} {err[g]:.3e}" for g in bad))
            print(f"  {impl}: WARNING gradients off: {', '.join(bad)}", flush=True)
        errors[impl] = err
    del ref_y, ref_grads

    memory = {impl: measure_memory(impl, fn, inputs, leaves, dy) for impl, fn in impls.items()}

    times = {impl: ([], []) for impl in impls}
    clocks = {"sm_mhz_before": sm_clock_mhz()}
    for _ in range(args.rounds):
        for impl, fn in impls.items():
            fwd_ms, fwd_bwd_ms = time_round(fn, inputs, leaves, dy, args)
            times[impl][0].append(fwd_ms)
            times[impl][1].append(fwd_bwd_ms)
            if impl == "lynx":
                lynx.check()
    clocks["sm_mhz_after"] = sm_clock_mhz()
    print(f"  SM clock before/after the timed rounds: {clocks['sm_mhz_before']} / {clocks['sm_mhz_after']} MHz")

    rows = []
    for impl in impls:
        held, peak, own, grads_mib = memory[impl]
        rows.append({"shape": name, "T": T, "H": H, "I": I, "E": E, "k": k, "impl": impl,
                     "fwd_ms": statistics.median(times[impl][0]), "fwd_bwd_ms": statistics.median(times[impl][1]),
                     "fwd_ms_rounds": times[impl][0], "fwd_bwd_ms_rounds": times[impl][1],
                     "held_mib": held, "peak_mib": peak, "workspace_own_mib": own, "grads_mib": grads_mib,
                     **{f"rel_err_{g}": e for g, e in errors[impl].items()}})
    return rows, clocks


def print_table(rows):
    cols = ("fwd_ms", "fwd_bwd_ms", "held_mib", "peak_mib")
    print(f"\n{'shape':15} {'impl':18} {'fwd ms':>8} {'fwd+bwd ms':>10} {'held MiB':>9} {'peak MiB':>9} "
          f"{'ws own MiB':>10} {'grads MiB':>9}", flush=True)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by_impl = {r["impl"]: r for r in rows if r["shape"] == shape}
        for r in by_impl.values():
            own = f"{r['workspace_own_mib']:10.0f}" if r["impl"] == "lynx" else f"{'-':>10}"
            print(f"{shape:15} {r['impl']:18} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:10.3f} {r['held_mib']:9.0f} "
                  f"{r['peak_mib']:9.0f} {own} {r['grads_mib']:9.0f}")
        mine = by_impl["lynx"]
        for peer in (p for p in ("sonicmoe", "torch") if p in by_impl):
            ratios = [by_impl[peer][c] / mine[c] if mine[c] else float("nan") for c in cols]
            print(f"{shape:15} {peer + '/lynx':18} {ratios[0]:7.2f}x {ratios[1]:9.2f}x {ratios[2]:8.2f}x "
                  f"{ratios[3]:8.2f}x")
    print("(peer/lynx above 1: lynx faster, or lynx holding less memory; the peak counts the gradients, "
          "'grads MiB', the same for all)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, SHAPES, "all")
    parser.add_argument("--no-sonic", action="store_true", help="leave SonicMoE out")
    args = parser.parse_args()
    names = shape_names(parser, args, SHAPES)
    if not torch.cuda.is_available():
        print("compare_peers: no CUDA GPU available", file=sys.stderr)
        return 2
    sonic, missing = load_sonic(args.no_sonic)
    if missing:
        print(f"SonicMoE: {missing}; comparing lynx and the PyTorch path only")
    else:
        print(f"SonicMoE {sonic_version() or '(version unknown)'}: its first call at each shape JIT-compiles "
              f"(minutes on a cold cache: over 400 s at qwen3-30b-a3b, 2026-12-05), untimed")
    rows, clocks, failures, skipped = [], {}, [], []

    def write_json():  # after every shape, so that a run stopped by a time limit keeps what it finished
        if not args.json:
            return
        out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "commit": _commit(),
               "command": " ".join(sys.argv), "torch": torch.__version__,
               "sonicmoe": None if sonic is None else sonic_version(), "sonicmoe_missing": missing,
               "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "clocks": clocks,
               "failures": failures, "skipped": skipped, "results": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)

    def shape(i, name):
        try:
            shape_rows, clocks[name] = run_shape(name, 1000 + i, sonic, args, failures)
        finally:
            _workspaces.release(1000 + i)  # this shape's tensors went with run_shape; its workspace goes now
        rows.extend(shape_rows)
        if shape_rows:
            print_table(shape_rows)

    run_each_shape(names, args.budget_s, "compare_peers", failures, skipped, shape, write_json)
    if len({r["shape"] for r in rows}) > 1:
        print_table(rows)
    write_json()
    if failures:
        print("compare_peers: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
