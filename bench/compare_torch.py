#!/usr/bin/env python3
"""The PyTorch path of an MoE layer (argsort + torch._grouped_mm + SwiGLU + index_add_), timed on the
benchmark shapes of bench/shapes.cpp at uniform and skewed routing (lynx-bench's), side by
side with lynx through its PyTorch binding when the `lynx` package is installed (same inputs, same
process; impl "lynx-python", baseline the PyTorch path), and the PyTorch path's two expert GEMMs
alone (pass "forward GEMMs alone"). Passes: forward, backward (alone: autograd through one kept
forward graph) and forward+backward. Writes the results
format of bench/results and, given --lynx-json (lynx-bench's output from the same run), prints
the ratio of each lynx-bench row to the PyTorch path."""

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

try:
    import lynx
except ImportError:  # the binding is optional here: the PyTorch path is timed either way
    lynx = None

SHAPES = {  # name: (T, H, I, E, k)
    "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
    "olmoe-1b-7b": (8192, 2048, 1024, 64, 8),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "deepseek-v3": (4096, 7168, 2048, 256, 8),
}


def _commit():
    """The commit of the checkout this script lives in (it may run from another directory), marked -dirty
    where its tracked files differ from it (as lynx-bench marks its build's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             check=True)
        changed = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True)
        return out.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down):
    """y[t] = sum_j w[t,j] * down_e(silu(gate_e x) * up_e x), experts as [E, out, in] weights."""
    T, k = topk_ids.shape
    E = w_gate.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    ye = grouped_experts(x[token], offs, w_gate, w_up, w_down)
    ye = ye * topk_weights.reshape(-1)[order].unsqueeze(1).to(ye.dtype)
    return torch.zeros_like(x).index_add_(0, token, ye)


def grouped_experts(xs, offs, w_gate, w_up, w_down):
    """Each expert's SwiGLU FFN on its rows of xs (rows in expert order, offs the int32 ends of each
    expert's rows), as three grouped GEMMs."""
    gate = torch._grouped_mm(xs, w_gate.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(xs, w_up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)


def rel_err(a, b):
    """||a - b|| / ||b|| (Frobenius, fp32); nan or inf when either is not finite."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def clear_grads(leaves):
    for t in leaves:
        t.grad = None


def sm_clock_mhz():
    """The SM clock now (MHz), through torch.cuda.clock_rate() (NVML) or nvidia-smi; None if neither answers."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=20).stdout.splitlines()
        uuid = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", "")).lower()
        ours = [line for line in out if uuid and uuid in line.lower()] or out[:1]
        return int(ours[0].split(",")[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def gemms_alone(x, topk_ids, w_gate, w_up, w_down):
    """The PyTorch path's two expert GEMMs alone, on inputs already in expert order: gate and up as one
    grouped GEMM (N = 2I), then down over h. What a fused layer's GEMMs compare with (a target: beat the
    PyTorch path's GEMMs-alone time). Returns the callable to time."""
    T, k = topk_ids.shape
    E, I = w_gate.shape[0], w_gate.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x.detach()[order // k].contiguous()
    w_gu = torch.cat([w_gate.detach(), w_up.detach()], dim=1).transpose(-2, -1)  # [E, H, 2I]
    w_dt = w_down.detach().transpose(-2, -1)                                    # [E, I, H]
    gu = torch._grouped_mm(xs, w_gu, offs=offs)
    h = (F.silu(gu[:, :I]) * gu[:, I:]).contiguous()

    def run():
        torch._grouped_mm(xs, w_gu, offs=offs)
        torch._grouped_mm(h, w_dt, offs=offs)
    return run


def add_run_arguments(parser, shapes, default_shapes):
    """The options of the side-by-side scripts (compare_peers.py, compare_fp8.py): --shape, --rounds,
    --iters, --warmup, --json, --budget-s."""
    parser.add_argument("--shape", default=default_shapes,
                        help=f"'all' or shape names, comma-separated, run in the order given: {', '.join(shapes)}")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A, B, C, A, B, C, ...)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per pass per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before each pass's timing")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new shape once this many seconds have passed (those left are listed as skipped)")


def shape_names(parser, args, shapes):
    """--shape's names, in order; the options add_run_arguments adds checked (parser.error otherwise)."""
    names = list(shapes) if args.shape == "all" else [n.strip() for n in args.shape.split(",") if n.strip()]
    unknown = [n for n in names if n not in shapes]
    if unknown or not names or len(set(names)) != len(names):
        parser.error(f"--shape: 'all' or distinct names among {', '.join(shapes)}; got {args.shape!r}")
    if min(args.rounds, args.iters) < 1 or args.warmup < 0:
        parser.error("--rounds and --iters must be at least 1, --warmup at least 0")
    return names


def run_each_shape(names, budget_s, prog, failures, skipped, body, after):
    """body(i, name) for each shape in turn, then after() (e.g. the JSON rewritten, so that a run stopped
    by a time limit keeps the shapes it finished). No new shape once budget_s seconds have passed (those
    left go to `skipped`); an exception at one shape (e.g. out of memory) goes to `failures`, and the
    others still run (SystemExit is not caught). The caching allocator is emptied after each shape."""
    started = time.perf_counter()
    for i, name in enumerate(names):
        if budget_s is not None and time.perf_counter() - started > budget_s:
            skipped += names[i:]
            print(f"{prog}: --budget-s {budget_s:g} spent; skipped {', '.join(skipped)}", flush=True)
            break
        t0 = time.perf_counter()
        try:
            body(i, name)
        except Exception as e:
            traceback.print_exc()
            failures.append(f"{name}: {type(e).__name__}: {e}")
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {name}: {time.perf_counter() - t0:.0f} s, {time.perf_counter() - started:.0f} s so far", flush=True)
        after()


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def make_inputs(T, H, I, E, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev, dtype=bf16, generator=g)
    topk_ids = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].contiguous()
    topk_weights = torch.rand(T, k, device=dev, generator=g).softmax(dim=1)
    w_gate = torch.randn(E, I, H, device=dev, dtype=bf16, generator=g) * (2 / H**0.5)
    w_up = torch.randn(E, I, H, device=dev, dtype=bf16, generator=g) * (2 / H**0.5)
    w_down = torch.randn(E, H, I, device=dev, dtype=bf16, generator=g) * (2 / I**0.5)
    return x, topk_ids, topk_weights, w_gate, w_up, w_down


def skew(topk_ids, num_experts, seed):
    """lynx-bench's skewed routing (bench/problem.cpp): every fourth token's first pick is one of the 4
    hot experts 0-3, its picks kept distinct (the hot expert swapped into place when the token already
    picked it, else replacing the first pick)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = topk_ids.clone()
    rows = torch.arange(0, ids.shape[0], 4, device=ids.device)
    hot = torch.randint(0, min(4, num_experts), (rows.numel(),), device=ids.device, generator=g, dtype=ids.dtype)
    sub = ids[rows]
    match = sub == hot.unsqueeze(1)
    pos = match.int().argmax(dim=1)
    has = match.any(dim=1)
    first = sub[:, 0].clone()
    sub[has, pos[has]] = first[has]
    sub[:, 0] = hot
    ids[rows] = sub
    return ids.contiguous()


def time_routing(rows, name, routing, flops, x, topk_ids, topk_weights, w_gate, w_up, w_down, params, dy, args):
    """Times the PyTorch path (and lynx through the binding, when installed) at one routing of a shape,
    appending result rows."""
    def fwd():
        with torch.no_grad():
            moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)

    def fwd_bwd():
        y = moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)
        torch.autograd.grad(y, params, dy)

    def make_bwd():
        """The backward alone: one forward, untimed, whose graph every timed run goes back through."""
        y = moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)
        return lambda: torch.autograd.grad(y, params, dy, retain_graph=True)

    # Activations autograd keeps for backward (plus y itself): allocated after forward minus before.
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    torch.cuda.synchronize()
    kept_mib = (torch.cuda.memory_allocated() - before) / 2**20
    del y

    def lynx_fwd():
        with torch.no_grad():
            lynx.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)

    def lynx_fwd_bwd():
        y = lynx.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)
        torch.autograd.grad(y, params, dy)

    with torch.no_grad():
        gemms = gemms_alone(x, topk_ids, w_gate, w_up, w_down)
        ms = median_ms(gemms, args.warmup, args.iters)
    rows.append({"shape": name, "routing": routing, "pass": "forward GEMMs alone", "impl": "torch-grouped-mm",
                 "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "baseline_impl": None, "baseline_ms": None,
                 "dense_gemm_tflops": None, "kept_for_backward_mib": None})
    del gemms
    # NOTES: the backward counts twice the forward's FLOPs; lynx's backward alone comes from lynx-bench
    # (--lynx-json), the binding's rows are the forward and forward+backward.
    for pass_name, make_fn, lynx_fn, mult in (("forward", lambda: fwd, lynx_fwd, 1),
                                              ("backward", make_bwd, None, 2),
                                              ("forward+backward", lambda: fwd_bwd, lynx_fwd_bwd, 3)):
        fn = make_fn()
        ms = median_ms(fn, args.warmup, args.iters)
        del fn
        rows.append({"shape": name, "routing": routing, "pass": pass_name, "impl": "torch-grouped-mm",
                     "ms": ms, "tflops": mult * flops / (ms * 1e-3) / 1e12, "baseline_impl": None,
                     "baseline_ms": None, "dense_gemm_tflops": None, "kept_for_backward_mib": kept_mib})
        if lynx is not None and lynx_fn is not None:
            lms = median_ms(lynx_fn, args.warmup, args.iters)
            lynx.check()
            rows.append({"shape": name, "routing": routing, "pass": pass_name, "impl": "lynx-python",
                         "ms": lms, "tflops": mult * flops / (lms * 1e-3) / 1e12,
                         "baseline_impl": "torch-grouped-mm", "baseline_ms": ms, "dense_gemm_tflops": None,
                         "kept_for_backward_mib": None})


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="all", help="a shape name or 'all'")
    parser.add_argument("--routing", default="all", choices=["uniform", "skewed", "all"],
                        help="uniform, skewed (as lynx-bench's), or all (both; default)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--lynx-json", help="lynx-bench --json output of the same run, for ratios")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("compare_torch: no CUDA GPU available", file=sys.stderr)
        return 2
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    routings = ["uniform", "skewed"] if args.routing == "all" else [args.routing]
    rows = []
    for name in names:
        T, H, I, E, k = SHAPES[name]
        inputs = make_inputs(T, H, I, E, k, seed=2026)
        params = [t.requires_grad_() for t in (inputs[0], inputs[3], inputs[4], inputs[5])]
        x, uniform_ids, topk_weights, w_gate, w_up, w_down = inputs
        flops = 6.0 * T * k * H * I
        dy = torch.randn_like(x)
        for routing in routings:
            topk_ids = uniform_ids if routing == "uniform" else skew(uniform_ids, E, seed=2027)
            time_routing(rows, name, routing, flops, x, topk_ids, topk_weights, w_gate, w_up, w_down, params, dy,
                         args)
        del inputs, params, x, uniform_ids, w_gate, w_up, w_down, dy
        torch.cuda.empty_cache()

    print(f"{'shape':15} {'routing':8} {'pass':19} {'impl':17} {'ms':>9} {'TFLOP/s':>8} {'vs torch':>9} "
          f"{'kept for backward MiB':>22}")
    for r in rows:
        ratio = f"{r['baseline_ms'] / r['ms']:8.2f}x" if r["baseline_ms"] else f"{'-':>9}"
        kept = f"{r['kept_for_backward_mib']:22.0f}" if r["kept_for_backward_mib"] is not None else f"{'-':>22}"
        print(f"{r['shape']:15} {r['routing']:8} {r['pass']:19} {r['impl']:17} {r['ms']:9.3f} {r['tflops']:8.1f} "
              f"{ratio} {kept}")
    commit = _commit()
    if args.lynx_json:
        with open(args.lynx_json) as f:
            lynx_run = json.load(f)
        lynx_rows, commit = lynx_run["results"], lynx_run["commit"]
        print(f"\n{'shape':15} {'routing':8} {'pass':17} {'impl':22} {'lynx ms':>8} {'torch ms':>9} {'torch/lynx':>10}")
        for r in (r for r in rows if r["impl"] == "torch-grouped-mm"):
            for l in lynx_rows:
                if (l["shape"], l["pass"], l["routing"]) == (r["shape"], r["pass"], r["routing"]):
                    impl = l["impl"] + ("" if l.get("regime", "as-found") == "as-found" else f" {l['regime']}")
                    print(f"{r['shape']:15} {r['routing']:8} {r['pass']:17} {impl:22} {l['ms']:8.3f} "
                          f"{r['ms']:9.3f} {r['ms'] / l['ms']:9.2f}x")
    if args.json:
        out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
               "commit": commit, "command": " ".join(sys.argv), "torch": torch.__version__, "results": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
