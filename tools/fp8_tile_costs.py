#!/usr/bin/env python3
"""The FP8 forward GEMMs' cost a tile and a K block, by a sweep of K (Nsight Compute over lynx-bench).

For each shape (T,H,I,E,k), one `lynx-bench --precision fp8 --routing balanced` run under ncu times
every FP8 GEMM launch (gpu__time_duration and sm__cycles_elapsed.max); the first gate/up launch (the
SwiGLU form, 2) and the first down launch after it (the grouped form, 1) are kept: the forward's.
Balanced routing gives every expert exactly T*k/E rows, so each launch's tiles and K blocks follow from
the shape (src/kernels/fp8/tiles.h): gate/up [128, 128 of gate and up] tiles over K = H, down [128, 256]
tiles over K = I, an expert's rows in whole 128-row blocks. Persistent CTAs, one an SM, take the tiles
in turn, so a launch takes n = ceil(tiles / SMs) tile times, and a tile a + b * k_blocks. The least
squares fit of cycles = a * n + b * n * k_blocks (no intercept) per form says what a tile costs beside
its K-block loop (its start, its epilogue, the pipeline's fill) and what a K block costs; its residuals
say how well the model holds. The default shapes vary H (gate/up's K) and I (down's K) about
qwen3-30b-a3b's.

  usage: tools/fp8_tile_costs.py --bench BUILD/lynx-bench [--sms N] [--out DIR] [--ncu PATH] [SHAPE ...]
  --sms: the GPU's SM count (default 132: H100 SXM and H200)
  --out: where each shape's ncu CSV and the table go (default build/fp8-tile-costs)
"""
import argparse
import csv
import io
import math
import os
import re
import subprocess
import sys

SWIGLU, GROUPED = 2, 1  # src/kernels/fp8/tiles.h, Form
TILE_M, BLOCK = 128, 128
OUT_N = {SWIGLU: 128, GROUPED: 256}
DEFAULT_SHAPES = ["8192,1024,768,128,8", "8192,2048,768,128,8", "8192,4096,768,128,8", "8192,2048,384,128,8",
                  "8192,2048,1536,128,8"]
METRICS = "gpu__time_duration.sum,sm__cycles_elapsed.max"


def parse_shape(text):
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 5 or min(parts) <= 0:
        raise ValueError(f"a shape is T,H,I,E,k of positive integers, got {text!r}")
    return tuple(parts)


def launches_of(shape, sms):
    """{form: (tiles, k_blocks, n)} of the forward's gate/up and down at balanced routing."""
    T, H, I, E, k = shape
    if (T * k) % E:
        raise ValueError(f"balanced routing gives every expert T*k/E rows only when E divides T*k: {shape}")
    row_blocks = E * math.ceil(T * k // E / TILE_M)
    out = {}
    for form, n_cols, depth in ((SWIGLU, I, H), (GROUPED, H, I)):
        tiles = row_blocks * math.ceil(n_cols / OUT_N[form])
        out[form] = (tiles, math.ceil(depth / BLOCK), math.ceil(tiles / sms))
    return out


def parse_ncu(text):
    """ncu --csv --print-units base output: [(form, ns, cycles)] of the FP8 GEMM launches in order."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    launches = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        m = re.search(r"gemm_kernel<(\d+)", row["Kernel Name"])
        if not m:
            continue
        entry = launches.setdefault(int(row["ID"]), {"form": int(m.group(1))})
        entry[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    return [(e["form"], e.get("gpu__time_duration.sum"), e.get("sm__cycles_elapsed.max"))
            for _, e in sorted(launches.items())]


def forward_pair(launches):
    """The first gate/up launch and the first down launch after it: (gate/up, down), each (ns, cycles)."""
    for i, (form, ns, cycles) in enumerate(launches):
        if form == SWIGLU:
            for form2, ns2, cycles2 in launches[i + 1:]:
                if form2 == GROUPED:
                    return (ns, cycles), (ns2, cycles2)
            break
    raise ValueError("no gate/up launch followed by a down launch among the FP8 GEMM launches")


def fit(points):
    """points: [(n, k_blocks, cost)]. The least-squares (a, b) of cost = a * n + b * n * k_blocks."""
    s11 = sum(n * n for n, _, _ in points)
    s12 = sum(n * n * k for n, k, _ in points)
    s22 = sum((n * k) ** 2 for n, k, _ in points)
    y1 = sum(n * c for n, _, c in points)
    y2 = sum(n * k * c for n, k, c in points)
    det = s11 * s22 - s12 * s12
    if det == 0:
        raise ValueError("the shapes do not separate a tile's cost from a K block's: vary K")
    return (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det


def table(rows, sms):
    """rows: [(shape, {form: (tiles, k, n)}, {form: (ns, cycles)})]. The measured launches, then per form
    the fit, in cycles (clock-free) and in µs at the measured mean clock, with each shape's residual."""
    out = [f"{'shape':>22} {'form':>8} {'tiles':>6} {'k':>3} {'n':>3} {'us':>8} {'Mcycles':>8}"]
    for shape, geo, meas in rows:
        for form, name in ((SWIGLU, "gate/up"), (GROUPED, "down")):
            tiles, k, n = geo[form]
            ns, cycles = meas[form]
            out.append(f"{','.join(map(str, shape)):>22} {name:>8} {tiles:6d} {k:3d} {n:3d} {ns / 1e3:8.1f} "
                       f"{cycles / 1e6:8.3f}")
    out.append(f"fit per form ({sms} SMs): cycles = n * (a + b * k), n = ceil(tiles / SMs)")
    for form, name in ((SWIGLU, "gate/up"), (GROUPED, "down")):
        points = [(geo[form][2], geo[form][1], meas[form][1]) for _, geo, meas in rows]
        a, b = fit(points)
        mhz = sum(m[form][1] / m[form][0] * 1e3 for _, _, m in rows) / len(rows)
        out.append(f"  {name}: a = {a:8.0f} cycles a tile ({a / mhz:6.2f} us at {mhz:.0f} MHz), "
                   f"b = {b:6.0f} cycles a K block ({b / mhz:5.2f} us)")
        residuals = ", ".join(f"{100 * (n * (a + b * k) / c - 1):+.1f}%" for n, k, c in points)
        out.append(f"    model against measured, shape by shape: {residuals}")
    return "\n".join(out)


def main(argv):
    ap = argparse.ArgumentParser(description="The FP8 forward GEMMs' cost a tile and a K block, by K sweep.")
    ap.add_argument("--bench", required=True, help="lynx-bench")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--out", default="build/fp8-tile-costs")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("shapes", nargs="*", default=DEFAULT_SHAPES)
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes]
        geos = [launches_of(s, args.sms) for s in shapes]
    except ValueError as e:
        print(f"fp8_tile_costs: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape, geo in zip(shapes, geos):
        name = ",".join(map(str, shape))
        cmd = [args.ncu, "--clock-control", "none", "--kernel-name-base", "demangled", "-k",
               "regex:fp8::impl::gemm_kernel", "--csv", "--print-units", "base", "--metrics", METRICS, args.bench,
               "--shape", name, "--routing", "balanced", "--precision", "fp8", "--rounds", "1", "--iters", "1",
               "--warmup", "0", "--check-tokens", "0"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(args.out, f"ncu-{name}.csv"), "w") as f:
            f.write(run.stdout)
        try:
            gate_up, down = forward_pair(parse_ncu(run.stdout))
        except (ValueError, KeyError) as e:
            print(f"fp8_tile_costs: shape {name}: {e} (ncu exit {run.returncode}; {run.stderr.strip()[-300:]})",
                  file=sys.stderr)
            return 1
        rows.append((shape, geo, {SWIGLU: gate_up, GROUPED: down}))
    text = table(rows, args.sms)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
