"""One rank of an expert-parallel group, started by test_expert_parallel.py through torchrun (rank r on
GPU r mod the GPUs there are, so all on one GPU where there is one; their workspaces connected through
CUDA IPC, bootstrapped over a gloo group).
Each rank also runs the whole problem on one rank, in its own process, and checks that its share of
every result has the same bits."""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

import lynx
from lynx import _workspaces
from moe_weights import expert_weights

TOL = 1e-2


def rel(a, b):
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problem(N, H, I, E, k, Is, routing, seed):
    """The global problem (every rank draws the same): N = R·T tokens, rank-major."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(N, H, generator=g, **bf)
    if routing == "rank0":  # every token on rank 0's experts, none on the others'
        E0 = max(k, E // int(os.environ["WORLD_SIZE"]))
        ids = torch.rand(N, E0, device="cuda", generator=g).argsort(dim=1)[:, :k]
    else:
        ids = torch.rand(N, E, device="cuda", generator=g).argsort(dim=1)[:, :k]
    tw = torch.rand(N, k, device="cuda", generator=g) + 0.05
    w, s = expert_weights(g, E, I, H, Is)
    dy = torch.randn(N, H, generator=g, **bf)
    return x, ids.int().contiguous(), tw, w, s, dy


def run(x, ids, tw, w, s, dy, group, forwards=1, config=lynx.Config(), offload=False):
    """y and every gradient (x, topk_weights, experts, shared expert) of `forwards` forwards, the i-th of
    (i + 1)·x routed to experts (id + i) mod E with weights (i + 1)·topk_weights, all made before their
    backwards (each backward given its own forward's context, which autograd saved; with `offload`
    moved to the CPU and back by a saved-tensor hook). Every forward has routing of its own, so a
    backward that read a later forward's (its slot_row, its staged ids or weights) would differ."""
    E = w[0].shape[0] * (1 if group is None else dist.get_world_size(group))
    leaves = [t.clone().requires_grad_() for t in (x, tw, *w)] + [t.clone().requires_grad_() if t is not None else None
                                                                  for t in s]
    with torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext():
        ys = [lynx.moe(leaves[0] * (i + 1), ((ids.long() + i) % E).int(), leaves[1] * (i + 1), *leaves[2:5],
                       *leaves[5:], config=config, ep_group=group)
              for i in range(forwards)]
    grads = torch.autograd.grad(ys, [t for t in leaves if t is not None], [dy] * forwards)
    return ys[0].detach(), list(grads)


def check_case(name, T, H, I, E, k, Is, routing, seed, group, forwards=1, config=lynx.Config(), offload=False):
    R, r = dist.get_world_size(group), dist.get_rank(group)
    x, ids, tw, w, s, dy = problem(R * T, H, I, E, k, Is, routing, seed)
    y1, g1 = run(x, ids, tw, w, s, dy, None, forwards, config)
    mine, experts = slice(r * T, (r + 1) * T), slice(r * E // R, (r + 1) * E // R)
    # Copies, not views: lynx takes 16-byte aligned tensors, and a view of rank r's rows of topk_ids
    # starts at r·T·k·4 bytes.
    yR, gR = run(x[mine].clone(), ids[mine].clone(), tw[mine].clone(), [t[experts].clone() for t in w], s,
                 dy[mine].clone(), group, forwards, config, offload)
    torch.cuda.synchronize()
    lynx.check()
    assert torch.isfinite(yR).all(), f"{name}: non-finite y"
    assert torch.equal(yR, y1[mine]), f"{name}: y differs from one rank's"
    for what, got, want in (("dx", gR[0], g1[0][mine]), ("d_topk_weights", gR[1], g1[1][mine]),
                            ("dw_gate", gR[2], g1[2][experts]), ("dw_up", gR[3], g1[3][experts]),
                            ("dw_down", gR[4], g1[4][experts])):
        assert torch.equal(got, want), f"{name}: {what} differs from one rank's"
    if Is:  # this rank's tokens' share: summed over the ranks, within bf16 rounding of one rank's sum
        for what, got, want in zip(("dws_gate", "dws_up", "dws_down"), gR[5:], g1[5:]):
            total = got.float().cpu()
            dist.all_reduce(total, group=group)
            assert rel(total.to(want.device), want) < TOL, f"{name}: {what} summed over ranks"
    print(f"rank {r}/{R} {name}: bitwise equal to one rank", flush=True)


def check_fewer_tokens(group):
    """Ranks with 64, 32, 16, … tokens, each padded to 64 by ep_tokens: every rank's y, dx,
    d_topk_weights and its experts' weight gradients have the bits of one rank holding the real tokens."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, Is = 64, 128, 64, 4 * R, 2, 64
    counts = [max(1, T >> q) for q in range(R)]
    x, ids, tw, w, s, dy = problem(sum(counts), H, I, E, k, Is, "random", 6)
    y1, g1 = run(x, ids, tw, w, s, dy, None)
    first = sum(counts[:r])
    mine, experts = slice(first, first + counts[r]), slice(r * E // R, (r + 1) * E // R)
    leaves = [t.clone().requires_grad_() for t in (x[mine], tw[mine], *[t[experts] for t in w], *s)]
    yR = lynx.moe(leaves[0], ids[mine].clone(), *leaves[1:5], *leaves[5:], ep_group=group, ep_tokens=T)
    assert yR.shape[0] == counts[r]
    gR = torch.autograd.grad(yR, leaves, dy[mine].clone())
    torch.cuda.synchronize()
    lynx.check()
    assert torch.equal(yR.detach(), y1[mine]), "fewer tokens: y differs from one rank's"
    for what, got, want in (("dx", gR[0], g1[0][mine]), ("d_topk_weights", gR[1], g1[1][mine]),
                            ("dw_gate", gR[2], g1[2][experts]), ("dw_up", gR[3], g1[3][experts]),
                            ("dw_down", gR[4], g1[4][experts])):
        assert torch.equal(got, want), f"fewer tokens: {what} differs from one rank's"
    print(f"rank {r}/{R} fewer tokens ({counts[r]} of {T}): bitwise equal to one rank", flush=True)


def check_two_layers(name, group, config):
    """Two layers of one shape, the second fed the first's output, then the backward through both: on
    the group's one shared workspace (in FP8 every call quantising its own layer's weights again), every
    rank's results bitwise those of one rank."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, Is = 64, 256, 128, 4 * R, 2, 0
    x, ids, tw, w, _, dy = problem(R * T, H, I, E, k, Is, "random", 12)
    _, ids2, tw2, w2, _, _ = problem(R * T, H, I, E, k, Is, "random", 13)

    def run2(x, ids, tw, w, ids2, tw2, w2, dy, group):
        leaves = [t.clone().requires_grad_() for t in (x, tw, *w, tw2, *w2)]
        h = lynx.moe(leaves[0], ids, leaves[1], *leaves[2:5], config=config, ep_group=group)
        y = lynx.moe(h, ids2, leaves[5], *leaves[6:9], config=config, ep_group=group)
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    want = run2(x, ids, tw, w, ids2, tw2, w2, dy, None)
    mine, experts = slice(r * T, (r + 1) * T), slice(r * E // R, (r + 1) * E // R)
    got = run2(x[mine].clone(), ids[mine].clone(), tw[mine].clone(), [t[experts].clone() for t in w],
               ids2[mine].clone(), tw2[mine].clone(), [t[experts].clone() for t in w2], dy[mine].clone(), group)
    torch.cuda.synchronize()
    lynx.check()
    names = ("y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "d_topk_weights 2", "dw_gate 2", "dw_up 2",
             "dw_down 2")
    for what, a, b in zip(names, got, want):
        part = experts if what.startswith("dw") else mine
        assert torch.isfinite(a).all() and torch.equal(a, b[part]), f"{name}: {what} differs from one rank's"
    print(f"rank {r}/{R} {name}: bitwise equal to one rank", flush=True)


def check_compiled(group):
    """lynx.moe with ep_group under torch.compile, forward and backward, bitwise the eager call's: with
    fullgraph=True where dynamo traces the group's lookup, else with graph breaks (the line printed
    says which)."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, Is = 64, 128, 64, 4 * R, 2, 0
    x, ids, tw, w, _, dy = problem(R * T, H, I, E, k, Is, "random", 11)
    mine, experts = slice(r * T, (r + 1) * T), slice(r * E // R, (r + 1) * E // R)
    x, ids, tw, dy = x[mine].clone(), ids[mine].clone(), tw[mine].clone(), dy[mine].clone()
    w = [t[experts].clone() for t in w]

    # NOTES: a rank compiling longer than another keeps it waiting on the device: a long peer timeout.
    config = lynx.Config(peer_timeout_ms=600_000)

    def f(x, ids, tw, wg, wu, wd):
        return lynx.moe(x, ids, tw, wg, wu, wd, config=config, ep_group=group)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (x, tw, *w)]
        y = fn(leaves[0], ids, *leaves[1:])
        return [y.detach(), *torch.autograd.grad(y, leaves, dy)]

    want = grads(f)
    mode = "fullgraph"
    try:
        got = grads(torch.compile(f, fullgraph=True))
    except torch._dynamo.exc.Unsupported:
        mode = "with graph breaks"
        torch._dynamo.reset()
        got = grads(torch.compile(f))
    torch.cuda.synchronize()
    lynx.check()
    for what, a, b in zip(("y", "dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"), got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"torch.compile: {what} differs from eager"
    print(f"rank {r}/{R} torch.compile ({mode}): bitwise equal to eager", flush=True)


def check_module(group):
    """lynx.nn.MoE(ep_group=...): forward and backward run, within bf16 rounding of one rank's layer with
    the same weights (the router runs on this rank's tokens only, so its bits may differ)."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k, Is = 128, 256, 128, 4 * R, 2, 128
    torch.manual_seed(3)
    full = lynx.nn.MoE(H, I, E, k, Is, device="cuda")
    torch.manual_seed(3)
    layer = lynx.nn.MoE(H, I, E, k, Is, device="cuda", ep_group=group)
    assert layer.w1.shape[0] == E // R and layer.expert_offset == r * E // R
    experts = slice(layer.expert_offset, layer.expert_offset + E // R)
    for name, p in layer.named_parameters():  # the same random state: this rank's share of one rank's layer
        q = dict(full.named_parameters())[name]
        assert torch.equal(p, q[experts] if name in ("w1", "w2", "w3") else q), name
    x = torch.randn(R * T, H, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(5))
    y1 = full(x)
    y1.float().square().sum().backward()
    mine = slice(r * T, (r + 1) * T)
    yR = layer(x[mine])
    # The same layer with ep_tokens = T, rank r holding T - r of its tokens: their rows, padded to T.
    padded = lynx.nn.MoE(H, I, E, k, Is, device="cuda", ep_group=group, ep_tokens=T)
    padded.load_state_dict(layer.state_dict())
    n = T - r
    yP = padded(x[mine][:n].clone())
    assert yP.shape == (n, H) and rel(yP, yR.detach()[:n]) < TOL, "nn.MoE with ep_tokens"
    yR.float().square().sum().backward()
    torch.cuda.synchronize()
    lynx.check()
    # Both layers (one shape) on the group's one shared workspace, which keeps no layer's context.
    specs = [spec for spec in _workspaces._BY_SPEC if spec[6].ep_group != 0 and spec[:6] == (T, H, I, E, k, Is)]
    assert len(specs) == 1 and specs[0][6].caller_context, specs
    assert rel(yR, y1[mine]) < TOL
    for name in ("w1", "w2", "w3"):
        got = getattr(layer, name).grad
        assert rel(got, getattr(full, name).grad[experts]) < TOL, name
    print(f"rank {r}/{R} nn.MoE: within {TOL} of one rank", flush=True)
    return layer  # kept by the caller until every rank is past the barrier (its workspace is read by them)


def main():
    dist.init_process_group("gloo")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    group = dist.group.WORLD
    R = dist.get_world_size()
    E = 4 * R
    check_case("uniform, shared expert", 96, 256, 128, E, 2, 128, "random", 1, group)
    check_case("new routing, same workspace", 96, 256, 128, E, 2, 128, "random", 2, group)
    check_case("every token on rank 0's experts", 64, 128, 64, E, 3, 0, "rank0", 3, group)
    check_case("T = 1 per rank, k = 1", 1, 128, 64, E, 1, 0, "random", 4, group)
    check_case("two forwards in flight", 80, 128, 64, E, 2, 64, "random", 5, group, forwards=2)
    check_case("three forwards in flight, contexts on the CPU", 80, 128, 64, E, 2, 64, "random", 8, group, forwards=3,
               offload=True)
    check_case("contexts recomputed", 80, 128, 64, E, 2, 64, "random", 9, group, forwards=2,
               config=lynx.Config(save_forward_context=False))
    check_case("fp8_block, two forwards in flight", 96, 256, 128, E, 2, 128, "random", 10, group, forwards=2,
               config=lynx.Config(precision="fp8_block"))
    check_case("fp8_block", 96, 256, 128, E, 2, 128, "random", 7, group, config=lynx.Config(precision="fp8_block"))
    check_fewer_tokens(group)
    check_two_layers("two layers", group, lynx.Config())
    check_two_layers("two layers fp8_block", group, lynx.Config(precision="fp8_block"))
    check_compiled(group)
    layer = check_module(group)
    torch.cuda.synchronize()
    dist.barrier()  # no rank frees its workspaces while another may still read them
    del layer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
