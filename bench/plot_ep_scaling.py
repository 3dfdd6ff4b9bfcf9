#!/usr/bin/env python3
"""The scaling picture of expert parallelism across GPUs: time per pass against the number of GPUs G,
the same tokens per GPU, lynx and the all-to-all path as bench/compare_ep.py measured them (one JSON
per G, tools/gpu-multi writes them), one panel per shape and pass, with a model of lynx beside them.

The model (docs/expert-parallel.md), labelled as one: each GPU computes as many routed rows at any G as
at G = 1 (uniform routing), so its compute is lynx's G = 1 time t1; on top come the row bytes a GPU
sends over its links, the dispatch's and the combine's (compare_ep's bytes_per_gpu_fwd holds both; the
backward moves as many again) at --link-gbps per direction. Two curves bound it: nothing overlapped (t1 + bytes /
bandwidth) and everything overlapped (max(t1, bytes / bandwidth)).

    python3 bench/plot_ep_scaling.py build/gpu-multi/compare_ep_*.json --out docs/img/ep-scaling.png
"""

import argparse
import json
import sys


def load(paths):
    """rows[(shape, impl)][G] = the compare_ep row, and the runs' descriptions."""
    rows, runs = {}, []
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        runs.append(f"G = {run['G']}: {run['date']}, {run['gpu']}, commit {run['commit']}")
        for r in run["results"]:
            rows.setdefault((r["shape"], r["impl"]), {})[r["G"]] = r
    return rows, runs


def model(lynx_rows, G, key, link_bytes_per_s):
    """(no overlap, full overlap) ms at G for pass `key` ("fwd_ms" or "fwd_bwd_ms"), from lynx's G = 1."""
    t1 = lynx_rows[1][key]
    sent = lynx_rows[G]["bytes_per_gpu_fwd"] if G in lynx_rows else 0.0  # dispatch and combine
    link_ms = (1 if key == "fwd_ms" else 2) * sent / link_bytes_per_s * 1e3
    return t1 + link_ms, max(t1, link_ms)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", nargs="+", help="compare_ep.py --json files, one per G")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--link-gbps", type=float, default=450.0, help="link bandwidth per direction, GB/s")
    args = parser.parse_args()
    rows, runs = load(args.json)
    shapes = sorted({s for s, _ in rows})
    if not shapes:
        print("plot_ep_scaling: no results in the files given", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward"))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(10, 3.6 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        lynx_rows = rows.get((shape, "lynx"), {})
        for j, (key, title) in enumerate(passes):
            ax = axes[i][j]
            for impl, style in (("lynx", "o-"), ("torch", "s--")):
                by_g = rows.get((shape, impl), {})
                gs = sorted(by_g)
                ax.plot(gs, [by_g[g][key] for g in gs], style,
                        label="lynx" if impl == "lynx" else "all-to-all + grouped GEMM")
            if 1 in lynx_rows:
                gs = sorted(lynx_rows)
                bounds = [model(lynx_rows, g, key, args.link_gbps * 1e9) for g in gs]
                ax.plot(gs, [b[0] for b in bounds], ":", color="gray", label="model: nothing overlapped")
                ax.plot(gs, [b[1] for b in bounds], "-.", color="gray", label="model: all overlapped")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs (same tokens per GPU)")
            ax.set_ylabel("ms")
            ax.set_title(f"{shape}, {title}")
            ax.legend(fontsize=7)
    fig.suptitle("Expert parallelism across GPUs\n" + "\n".join(runs), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
