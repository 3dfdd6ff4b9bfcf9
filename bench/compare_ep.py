#!/usr/bin/env python3
"""Expert parallelism across the GPUs of one machine, lynx against the PyTorch all-to-all path, in one
run: interleaved rounds (lynx, torch, lynx, torch, ...), the same inputs. Rank r of G holds T tokens
(its own x, topk_ids naming experts of every rank, topk_weights) and the experts r·E/G … (r+1)·E/G − 1;
the experts' weights are drawn for all E from one seed and sliced per rank, so both paths compute the
same function.

- lynx: lynx.moe(..., ep_group=WORLD); the tokens travel inside its fused passes. Its workspace is
  sized for twice a rank's balanced share of the rows (functional.schedule_capacity, max_load 2.0).
- torch: the all-to-all path with autograd. This rank's (token, slot) rows sorted by destination rank
  (expert_id // (E/G)); the per-rank counts exchanged first (all_to_all_single of a counts tensor; the
  split sizes must be host lists, so one .tolist() synchronisation is part of this path); the x rows
  and the expert ids sent (all_to_all_single, NCCL); on the receiving rank, sorted by local expert and
  the SwiGLU experts run with torch._grouped_mm (as compare_torch.moe_forward); the results sent back,
  weighted by topk_weights and summed per token with index_add_. The row exchanges go through a small
  autograd.Function whose backward is the reverse all_to_all_single.

Before timing, lynx's y and dx are checked against the torch path's on every rank (relative Frobenius
error below 2e-2 and finite, else exit 1 on every rank). Timing: CUDA events, every rank; per pass the
forward (autograd on, graph dropped) and forward+backward (gradients None before each, dy one fixed
random tensor), a median over --iters after --warmup per round, the median over --rounds per rank,
then the MAX over ranks (the slowest rank sets a step's time). Bytes per GPU: the x rows a rank sends
to other ranks in the dispatch plus the rows it sends back in the combine (bf16, H · 2 bytes a row; the
expert ids and counts not counted), the same count for lynx (it pulls the same rows rather than
pushing them); forward+backward moves it twice. GB/s is those bytes over the pass time, not a link
measurement. The SM clock is read on every rank before and after each shape's timed rounds.

Launch, one process per GPU (NCCL refuses two ranks on one GPU; lynx alone on one GPU can be tested
over gloo, not by this script), with NVLink multicast off (set here too when unset):

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 8 bench/compare_ep.py --shape all --json ep.json
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from compare_torch import _commit, clear_grads, grouped_experts, median_ms, rel_err, sm_clock_mhz  # noqa: E402

import lynx  # noqa: E402

SHAPES = {  # name: (T per GPU, H, I, E, k)
    "deepseek-v3": (4096, 7168, 2048, 256, 8),
    "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
}
TOLERANCE = 2e-2


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows: send_splits[q] rows to rank q, recv_splits[q] from it; backward is the
    reverse exchange of the gradient rows."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        send_splits, recv_splits = ctx.splits
        grad = grad_out.new_empty((sum(send_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad, grad_out.contiguous(), output_split_sizes=send_splits,
                               input_split_sizes=recv_splits, group=ctx.group)
        return grad, None, None, None


def exchange_counts(dest, R, group):
    """(send, recv) per-rank row counts as host lists: one all_to_all_single and one .tolist() sync."""
    send = torch.bincount(dest, minlength=R)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    counts = torch.cat([send, recv]).tolist()  # the host synchronisation of this path
    return counts[:R], counts[R:]


def a2a_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, group=None):
    """This rank's y [T, H] through dispatch (all-to-all), its local experts, combine (all-to-all)."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, k = topk_ids.shape
    E_local = w_gate.shape[0]
    flat = topk_ids.reshape(-1)
    dest = flat // E_local
    order = torch.argsort(dest, stable=True)  # (t, j) rows by destination rank
    token = order // k
    send, recv = exchange_counts(dest, R, group)
    xr = _AllToAll.apply(x[token], send, recv, group)
    ids = torch.empty(sum(recv), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(ids, flat[order].contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    local = ids - r * E_local
    lorder = torch.argsort(local, stable=True)  # the received rows by local expert
    offs = torch.cumsum(torch.bincount(local, minlength=E_local), 0).to(torch.int32)
    ye = grouped_experts(xr[lorder], offs, w_gate, w_up, w_down)
    inverse = torch.empty_like(lorder)
    inverse[lorder] = torch.arange(lorder.numel(), device=lorder.device)
    yb = _AllToAll.apply(ye[inverse], recv, send, group)  # back in this rank's destination order
    yb = yb * topk_weights.reshape(-1)[order].unsqueeze(1).to(yb.dtype)
    return torch.zeros_like(x).index_add_(0, token, yb)


def forward_bytes(topk_ids, H, E_local, group):
    """Bytes of x rows this rank sends to other ranks in one forward: dispatch plus combine."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    send, recv = exchange_counts(topk_ids.reshape(-1) // E_local, R, group)
    return (sum(send) - send[r] + sum(recv) - recv[r]) * H * 2


def make_rank_inputs(T, H, I, E, k, R, r, seed):
    """This rank's x, topk_ids (global ids), topk_weights (seed + 1 + r), and its experts' share of
    weights drawn for all E experts from `seed` (the same draw on every rank)."""
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed + 1 + r)
    x = torch.randn(T, H, device=dev, dtype=bf16, generator=g)
    topk_ids = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :k].contiguous()
    topk_weights = torch.rand(T, k, device=dev, generator=g).softmax(dim=1)
    gw = torch.Generator(device=dev).manual_seed(seed)
    mine = slice(r * E // R, (r + 1) * E // R)
    weights = []
    for shape, scale in (((E, I, H), 2 / H**0.5), ((E, I, H), 2 / H**0.5), ((E, H, I), 2 / I**0.5)):
        full = torch.randn(*shape, device=dev, dtype=bf16, generator=gw) * scale
        weights.append(full[mine].clone())  # an own, aligned tensor; the full draw is freed
        del full
    return (x, topk_ids, topk_weights, *weights)


def max_over_ranks(values):
    """Each value's maximum over the ranks (every rank calls it)."""
    t = torch.tensor(values, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed_ms(fn, args):
    """Median ms of fn over args.iters after args.warmup; the ranks meet before the timed batch."""
    for _ in range(args.warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    return median_ms(fn, 0, args.iters)


def run_shape(name, group, args):
    """Checks and times both paths at one shape; returns (rows or None after a failed check, clocks)."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    T, H, I, E, k = SHAPES[name]
    inputs = make_rank_inputs(T, H, I, E, k, R, r, seed=2026)
    x, topk_ids = inputs[0], inputs[1]
    leaves = [t.requires_grad_() for t in (x, inputs[2], *inputs[3:])]
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16,
                     generator=torch.Generator("cuda").manual_seed(7 + r))
    config = lynx.Config(schedule_capacity=lynx.functional.schedule_capacity(T, H, I, E, k, ep_group=group,
                                                                             max_load=2.0))
    impls = {"lynx": lambda *a: lynx.moe(*a, config=config, ep_group=group),
             "torch": lambda *a: a2a_moe(*a, group=group)}
    if r == 0:
        print(f"{name} (T per GPU, H, I, E, k) = {SHAPES[name]}, G = {R}", flush=True)

    # Correctness: lynx's y and dx against the all-to-all path's, on every rank.
    results = {}
    for impl, fn in impls.items():
        clear_grads(leaves)
        y = fn(*inputs)
        y.backward(dy)
        results[impl] = (y.detach(), x.grad)
        clear_grads(leaves)
    failed = []
    try:
        lynx.check()
    except lynx.LynxError as e:
        failed.append(f"lynx.check: {e}")
    for tensor, i in (("y", 0), ("dx", 1)):
        err = rel_err(results["lynx"][i], results["torch"][i])
        if not err <= TOLERANCE:  # nan fails too
            failed.append(f"{tensor} relative error {err:.3e} (limit {TOLERANCE:g})")
    del results
    if failed:
        print(f"compare_ep: rank {r}, {name}: lynx against the all-to-all path: {'; '.join(failed)}",
              file=sys.stderr, flush=True)
    if max_over_ranks([1.0 if failed else 0.0])[0] > 0:  # every rank learns of any rank's failure
        return None, None
    if r == 0:
        print(f"  y and dx agree on every rank (relative error <= {TOLERANCE:g})", flush=True)

    def fwd(fn):
        return lambda: fn(*inputs)

    def fwd_bwd(fn):
        def run():
            clear_grads(leaves)
            fn(*inputs).backward(dy)
        return run

    times = {impl: ([], []) for impl in impls}
    before = sm_clock_mhz()
    for _ in range(args.rounds):
        for impl, fn in impls.items():
            times[impl][0].append(timed_ms(fwd(fn), args))
            times[impl][1].append(timed_ms(fwd_bwd(fn), args))
            clear_grads(leaves)
            if impl == "lynx":
                lynx.check()
    after = sm_clock_mhz()

    mine = [statistics.median(times[impl][p]) for impl in impls for p in (0, 1)]
    worst = max_over_ranks(mine)
    gathered = [None] * R
    dist.all_gather_object(gathered, (mine, {"sm_mhz_before": before, "sm_mhz_after": after}))
    per_rank, clocks = [m for m, _ in gathered], [c for _, c in gathered]
    nbytes = int(max_over_ranks([forward_bytes(topk_ids, H, E // R, group)])[0])
    rows = []
    for i, impl in enumerate(impls):
        fwd_ms, fwd_bwd_ms = worst[2 * i], worst[2 * i + 1]
        rows.append({"shape": name, "G": R, "T_per_gpu": T, "H": H, "I": I, "E": E, "k": k, "impl": impl,
                     "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
                     "fwd_ms_per_rank": [m[2 * i] for m in per_rank],
                     "fwd_bwd_ms_per_rank": [m[2 * i + 1] for m in per_rank],
                     "bytes_per_gpu_fwd": nbytes, "bytes_per_gpu_fwd_bwd": 2 * nbytes,
                     "gb_per_s_fwd": nbytes / (fwd_ms * 1e-3) / 1e9,
                     "gb_per_s_fwd_bwd": 2 * nbytes / (fwd_bwd_ms * 1e-3) / 1e9})
    return rows, clocks


def print_table(rows):
    print(f"\n{'shape':14} {'G':>2} {'impl':6} {'fwd ms':>8} {'fwd+bwd ms':>10} {'torch/lynx':>16} "
          f"{'MB/GPU fwd':>10} {'GB/s fwd':>9} {'GB/s f+b':>9}")
    for r in rows:
        mine = next(m for m in rows if m["shape"] == r["shape"] and m["impl"] == "lynx")
        ratio = (f"{r['fwd_ms'] / mine['fwd_ms']:6.2f}x {r['fwd_bwd_ms'] / mine['fwd_bwd_ms']:7.2f}x"
                 if r["impl"] == "torch" else f"{'-':>16}")
        print(f"{r['shape']:14} {r['G']:2d} {r['impl']:6} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:10.3f} {ratio:>16} "
              f"{r['bytes_per_gpu_fwd'] / 1e6:10.1f} {r['gb_per_s_fwd']:9.1f} {r['gb_per_s_fwd_bwd']:9.1f}")
    print("(ms: the max over ranks of each rank's median; torch/lynx: fwd, fwd+bwd, above 1 lynx faster;\n"
          " MB/GPU: x rows a GPU sends to others per forward (max over ranks), twice that per fwd+bwd;\n"
          " GB/s: those bytes over the pass time, not a link measurement)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="all", choices=["all", *SHAPES], help="a shape name or 'all'")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (lynx, torch, lynx, ...)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per pass per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before each timed batch")
    parser.add_argument("--json", help="rank 0 writes the results here")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        print("compare_ep: launch with torchrun, one process per GPU (see --help)", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast; read when NCCL initialises
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    R, r = dist.get_world_size(), dist.get_rank()
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    bad = [n for n in names if SHAPES[n][3] % R]
    rows, clocks, status = [], {}, 0
    if bad:
        if r == 0:
            print(f"compare_ep: the expert count E of {', '.join(f'{n} ({SHAPES[n][3]})' for n in bad)} is not "
                  f"divisible by the number of GPUs G = {R}", file=sys.stderr)
        status = 2
    for name in names if not bad else []:
        shape_rows, shape_clocks = run_shape(name, group, args)
        if shape_rows is None:
            status = 1
            break
        rows += shape_rows
        clocks[name] = shape_clocks
        if r == 0:
            for q, c in enumerate(shape_clocks):
                print(f"  rank {q}: SM clock before/after the timed rounds {c['sm_mhz_before']} / "
                      f"{c['sm_mhz_after']} MHz", flush=True)
        gc.collect()
        torch.cuda.empty_cache()  # lynx's expert-parallel workspaces stay (other ranks may read them)
    if r == 0 and rows:
        print_table(rows)
    if r == 0 and args.json and rows:
        out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "G": R,
               "commit": _commit(), "command": " ".join(sys.argv), "torch": torch.__version__,
               "nccl": str(torch.cuda.nccl.version()), "rounds": args.rounds,
               "iters": args.iters, "warmup": args.warmup, "clocks": clocks, "results": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    # Every rank done before any leaves: other ranks read lynx's workspaces until then.
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
