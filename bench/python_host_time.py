#!/usr/bin/env python3
"""The host's share of lynx.moe's Python passes, bf16 and FP8, at one shape (--shape, compare_torch.py's
names; qwen3-30b-a3b by default). Each pass (the training forward with autograd on, forward+backward
with every gradient None before it, the forward under torch.no_grad) is timed three ways, --iters calls
each after --warmup, in --rounds rounds (bf16, fp8, bf16, ...):

- synced: CUDA events around one call, the stream idle before it (compare_torch.median_ms, the measure
  of compare_fp8.py and compare_peers.py): the host's time before the first kernel is in it;
- back to back: one pair of events around --iters calls, divided by --iters (the host runs ahead, as in
  a training loop);
- host: the host's wall time of one call (the synced calls' medians).

With --profile, one forward+backward of each precision runs again under torch.profiler (after the timed
rounds) and the host-side operations and CUDA runtime calls that took the most host time are printed."""

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import SHAPES, _commit, clear_grads, make_inputs  # noqa: E402

import lynx  # noqa: E402

CONFIGS = {"bf16": lynx.Config(), "fp8": lynx.Config(precision="fp8_block")}
TAG = 50


def timings(fn, warmup, iters):
    """(synced ms, back-to-back ms, host ms) of fn: medians over iters calls, back to back their mean."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    synced, host = [], []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        stop.record()
        stop.synchronize()
        synced.append(start.elapsed_time(stop))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return statistics.median(synced), start.elapsed_time(stop) / iters, statistics.median(host)


def passes(inputs, leaves, dy, config):
    def forward():
        return lynx.moe(*inputs, config=config, workspace_tag=TAG)

    def forward_backward():
        clear_grads(leaves)
        forward().backward(dy)
    return forward, forward_backward


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="one forward+backward of each under torch.profiler")
    args = parser.parse_args()
    if min(args.rounds, args.iters) < 1 or args.warmup < 0:
        parser.error("--rounds and --iters at least 1, --warmup at least 0")
    T, H, I, E, k = SHAPES[args.shape]
    print(f"{torch.cuda.get_device_name()}, commit {_commit()}, {args.shape} (T, H, I, E, k) = {SHAPES[args.shape]}")
    inputs = make_inputs(T, H, I, E, k, seed=2026)
    leaves = [t.requires_grad_() for t in (inputs[0], inputs[2], inputs[3], inputs[4], inputs[5])]
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(7))
    for r in range(args.rounds):
        for name, config in CONFIGS.items():
            forward, forward_backward = passes(inputs, leaves, dy, config)
            rows = {"forward": timings(forward, args.warmup, args.iters),
                    "forward+backward": timings(forward_backward, args.warmup, args.iters)}
            clear_grads(leaves)
            with torch.no_grad():
                rows["forward, no_grad"] = timings(forward, args.warmup, args.iters)
            for p, (synced, back_to_back, host) in rows.items():
                print(f"round {r} {name:4} {p:17}: synced {synced:.3f} ms, back to back {back_to_back:.3f} ms, "
                      f"host {host:.3f} ms", flush=True)
    lynx.check()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for name, config in CONFIGS.items():
            _, forward_backward = passes(inputs, leaves, dy, config)
            forward_backward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward_backward()
            torch.cuda.synchronize()
            print(f"\n{name} forward+backward, host time by operation (torch.profiler):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
