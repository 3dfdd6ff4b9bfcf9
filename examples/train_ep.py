#!/usr/bin/env python3
"""Trains an MoE layer with expert parallelism and shows that the number of ranks does not change a bit
of the training: the loss curve at R ranks equals the one-rank curve bit for bit.

The layer (a router and E SwiGLU experts, lynx.functional.moe) learns a fixed random nonlinear map of
its input. Every step draws one global batch of N tokens; rank r of R takes tokens r·N/R … and holds
experts r·E/R …; its tokens reach their experts' ranks and come back inside lynx's passes. lynx's
results (y, dx, d_topk_weights, the experts' weight gradients) have the same bits at every R. So that
the rest of the step has too, the example computes the replicated part (the router, the loss) on the
whole batch on every rank, from gathered per-token values: a reduction split across ranks would sum in
another order. Adam then updates each rank's experts and the router element by element.

    torchrun --nproc-per-node 1 examples/train_ep.py --out r1.json      # or plain python3: R = 1
    torchrun --nproc-per-node 2 examples/train_ep.py --out r2.json      # R = 2 (both on GPU 0 of one)
    python3 examples/train_ep.py --compare r1.json r2.json --plot train_ep.png
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import lynx


def gather(t, group):
    """Every rank's t, concatenated in rank order (through the CPU: the group may be gloo's)."""
    if group is None:
        return t
    parts = [torch.empty(t.shape, dtype=torch.float32) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().float().cpu(), group=group)
    return torch.cat(parts).to(device=t.device, dtype=t.dtype)


def train(args):
    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())  # one GPU each where
        # there are enough; several ranks on one GPU otherwise (verified so: two ranks on one H200)
        group = dist.group.WORLD
    R, r = (dist.get_world_size(), dist.get_rank()) if group is not None else (1, 0)
    N, H, I, E, k = args.tokens, args.hidden, args.intermediate, args.experts, args.top_k
    if N % R or E % R:
        raise SystemExit(f"--tokens ({N}) and --experts ({E}) must be multiples of the number of ranks ({R})")
    mine, experts = slice(r * N // R, (r + 1) * N // R), slice(r * E // R, (r + 1) * E // R)

    # Every rank draws the same global model and data; each keeps its share of the experts.
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    teacher = torch.randn(H, H, generator=g, device="cuda") / H**0.5
    router = (torch.randn(E, H, generator=g, **bf) / H**0.5).requires_grad_()
    w = [torch.randn(E, I, H, generator=g, **bf) / H**0.5, torch.randn(E, I, H, generator=g, **bf) / H**0.5,
         torch.randn(E, H, I, generator=g, **bf) / I**0.5]
    w = [t[experts].clone().requires_grad_() for t in w]
    opt = torch.optim.Adam([router, *w], lr=args.lr, foreach=False)

    losses = []
    for step in range(args.steps):
        x = torch.randn(N, H, generator=g, **bf)
        target = torch.tanh(x.float() @ teacher)
        scores = torch.softmax((x @ router.t()).float(), dim=-1)  # the whole batch: the same bits at every R
        topk_weights, topk_ids = scores.topk(k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        # Copies of this rank's rows: lynx takes 16-byte aligned tensors, which a view of rows may not be.
        tw = topk_weights[mine].detach().clone().requires_grad_()
        y = lynx.moe(x[mine].clone(), topk_ids[mine].clone(), tw, *w, ep_group=group)
        loss = (gather(y, group).float() - target).square().mean()
        # d loss / d y, element by element (as autograd would give it at R = 1).
        dy = ((y.float() - target[mine]) * (2.0 / target.numel())).to(torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        y.backward(dy)
        topk_weights.backward(gather(tw.grad, group))  # the router's gradient from every rank's tokens
        opt.step()
        losses.append(loss.item())
        if r == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"R={R} step {step:4d} loss {losses[-1]:.6f}", flush=True)
    lynx.check()
    if group is not None:
        torch.cuda.synchronize()
        dist.barrier()  # no rank frees its workspace while another may still read it
        dist.destroy_process_group()
    if r == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ranks=R, args=vars(args), losses=[v.hex() for v in losses]), f, indent=1)


def compare(paths, plot):
    runs = [json.load(open(p)) for p in paths]
    curves = [[float.fromhex(v) for v in run["losses"]] for run in runs]
    same = all(run["losses"] == runs[0]["losses"] for run in runs)
    for run, curve in zip(runs, curves):
        print(f"R={run['ranks']}: {len(curve)} steps, loss {curve[0]:.6f} -> {curve[-1]:.6f}")
    print("loss curves bitwise equal" if same else "loss curves DIFFER")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for run, curve, style in zip(runs, curves, ["-", "--", ":", "-."]):
            ax.plot(curve, style, label=f"R = {run['ranks']}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("lynx expert parallelism: " + ("identical loss curves" if same else "curves differ"))
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
    return 0 if same else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--tokens", type=int, default=4096, help="global batch, tokens per step")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="rank 0 writes the loss curve here (JSON, exact)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="compare curves written by --out")
    p.add_argument("--plot", help="with --compare: save a plot of the curves")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare, args.plot)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
