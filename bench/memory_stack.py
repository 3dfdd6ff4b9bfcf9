#!/usr/bin/env python3
"""Memory of a stack of MoE layers through a training step, lynx against the PyTorch path: L layers of
one shape (default 24 at qwen3-30b-a3b, T = 8192), every forward, then every backward, each layer's
output feeding the next. Reads torch.cuda.memory_allocated() (lynx's buffers come from PyTorch: the
scratch at each call, the forward contexts as tensors autograd saves; what a workspace allocates itself
is added from Workspace.device_bytes) before the forwards, after them (what is held from forward to
backward), and the peak over the step. Each implementation in its own pass over fresh layers."""

import argparse
import datetime
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import SHAPES, _commit, moe_forward  # noqa: E402

import lynx  # noqa: E402
from lynx import _workspaces  # noqa: E402


def layers(n, T, H, I, E, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    out = []
    for _ in range(n):
        w = [torch.randn(E, I, H, generator=g, **bf) * (2 / H**0.5), torch.randn(E, I, H, generator=g, **bf) * (2 / H**0.5),
             torch.randn(E, H, I, generator=g, **bf) * (1 / I**0.5)]
        ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].contiguous()
        tw = (torch.rand(T, k, device="cuda", generator=g) + 0.05).contiguous()
        out.append((ids, tw, [t.requires_grad_() for t in w]))
    return out


def step(impl, stack, x):
    """Every forward, then one backward through all of them; returns (held MiB, peak MiB) above the start."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = x
    for ids, tw, w in stack:
        h = (lynx.moe(h, ids, tw, *w, workspace_tag=id(w[0]) % 2**30) if impl == "lynx" else
             moe_forward(h, ids, tw, *w))
    torch.cuda.synchronize()
    own = sum(ws.device_bytes() for ws in _workspaces.all_workspaces()) if impl == "lynx" else 0
    held = torch.cuda.memory_allocated() - start + own
    h.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start + own
    return held / 2**20, peak / 2**20, own / 2**20


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--json")
    a = p.parse_args()
    T, H, I, E, k = SHAPES[a.shape]
    rows = []
    for impl in ("torch", "lynx"):
        stack = layers(a.layers, T, H, I, E, k, seed=1)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        held, peak, own = step(impl, stack, x)
        rows.append(dict(impl=impl, held_mib=held, peak_mib=peak, workspace_own_mib=own))
        print(f"{a.shape} x{a.layers} {impl:6s} held forward->backward {held:9.0f} MiB  peak {peak:9.0f} MiB"
              f"  (of which workspaces' own {own:.0f} MiB)")
        del stack, x
        _workspaces._BY_SPEC.clear()
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=str(datetime.date.today()), gpu=torch.cuda.get_device_name(), commit=_commit(),
                           command=" ".join(sys.argv), shape=a.shape, layers=a.layers, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
