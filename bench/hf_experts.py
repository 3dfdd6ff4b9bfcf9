#!/usr/bin/env python3
"""lynx.hf's experts at one shape (--shape, compare_torch.py's names; qwen3-30b-a3b by default), bf16 and
FP8: the forward (autograd on; and under torch.no_grad, as in generation) and forward+backward of one
experts module as Transformers calls it, with gate and up read as views of gate_up_proj ("views", what
lynx.hf does), beside the same calls with the two halves copied to contiguous tensors for each pass
("copies": how lynx.hf called lynx before it took views, less that path's torch.cat of the gate and up
gradients; in FP8 the fresh copies also make lynx quantise the weights again at every call). Medians of CUDA-event timings of --iters calls after
--warmup, in --rounds rounds, the four (precision, path) pairs interleaved in each; the module's
parameters unchanged throughout, as between two optimizer steps."""

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import SHAPES, _commit, median_ms  # noqa: E402

import lynx.hf  # noqa: E402


class Experts(torch.nn.Module):
    """The attributes lynx.hf reads of a Transformers experts module (gate_up_proj [E, 2I, H], gate first)."""

    has_bias, has_gate, is_transposed, is_concatenated = False, True, False, True

    def __init__(self, E, H, I, generator):
        super().__init__()
        bf16 = torch.bfloat16
        self.gate_up_proj = torch.nn.Parameter(
            torch.randn(E, 2 * I, H, device="cuda", dtype=bf16, generator=generator) * (2 / H**0.5))
        self.down_proj = torch.nn.Parameter(
            torch.randn(E, H, I, device="cuda", dtype=bf16, generator=generator) * (2 / I**0.5))


def copied_halves(gate_up):
    I = gate_up.shape[1] // 2
    return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=0, help="tokens per call (0: the shape's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    T, H, I, E, k = SHAPES[args.shape]
    T = args.tokens or T
    g = torch.Generator(device="cuda").manual_seed(0)
    module = Experts(E, H, I, g)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
    weights = torch.rand(T, k, device="cuda", generator=g).softmax(dim=1).requires_grad_()
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    forwards = {"bf16": lynx.hf.lynx_experts_forward, "fp8": lynx.hf.lynx_fp8_experts_forward}
    views = lynx.hf._halves

    def passes(precision, path):
        def forward():
            lynx.hf._halves = views if path == "views" else copied_halves
            return forwards[precision](module, x, ids, weights)

        def forward_backward():
            for t in (x, weights, module.gate_up_proj, module.down_proj):
                t.grad = None
            forward().backward(dy)

        def forward_no_grad():
            with torch.no_grad():
                forward()

        return {"forward": forward, "forward, no grad": forward_no_grad, "forward+backward": forward_backward}

    results = {}
    for r in range(args.rounds):
        for precision in ("bf16", "fp8"):
            for path in ("copies", "views"):
                for name, fn in passes(precision, path).items():
                    ms = median_ms(fn, args.warmup, args.iters)
                    lynx.hf._halves = views
                    results.setdefault((precision, path, name), []).append(ms)
                    print(f"round {r}: {precision} {path:6} {name:17} {ms:.3f} ms", flush=True)
    lynx.check()
    print(f"\n{args.shape}, T = {T}: medians of {args.rounds} rounds, ms (copies / views)")
    rows = []
    for precision in ("bf16", "fp8"):
        for name in ("forward", "forward, no grad", "forward+backward"):
            c = statistics.median(results[(precision, "copies", name)])
            v = statistics.median(results[(precision, "views", name)])
            rows.append({"precision": precision, "pass": name, "copies_ms": c, "views_ms": v,
                         "copies_rounds": results[(precision, "copies", name)],
                         "views_rounds": results[(precision, "views", name)]})
            print(f"{precision} {name:17} {c:8.3f} {v:8.3f}  {c / v:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "tokens": T, "commit": _commit(), "gpu": torch.cuda.get_device_name(),
                       "rounds": args.rounds, "warmup": args.warmup, "iters": args.iters, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
