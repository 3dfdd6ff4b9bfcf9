"""The PyTorch binding against a plain-PyTorch MoE, on fresh random inputs (run on a Hopper GPU;
skipped elsewhere)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import lynx  # noqa: E402
from moe_weights import expert_weights  # noqa: E402

TOL = 1e-2  # relative Frobenius error, bf16 operands (docs/testing.md)


def reference_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None, ws_down=None):
    """Plain PyTorch, fp32: a loop over experts."""
    x32 = x.float()
    y = torch.zeros_like(x32)
    for e in range(w_gate.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.silu(x32[token] @ w_gate[e].float().t()) * (x32[token] @ w_up[e].float().t())
        y.index_add_(0, token, (h @ w_down[e].float().t()) * topk_weights[token, slot].unsqueeze(1))
    if ws_gate is not None:
        y = y + (F.silu(x32 @ ws_gate.float().t()) * (x32 @ ws_up.float().t())) @ ws_down.float().t()
    return y


def rel(a, b):
    """‖a − b‖ / ‖b‖ (Frobenius); a must be all finite."""
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_d_topk(got, want, magnitude):
    """Every value within TOL of the magnitude of its dot product's terms, and, for 32 values or more,
    the plain relative error (see d_topk_magnitude)."""
    assert torch.isfinite(got).all(), "non-finite values"
    err = (got.float() - want.float()).abs()
    assert (err <= TOL * magnitude).all(), f"worst error / magnitude {(err / magnitude).max().item():.3e}"
    if got.numel() >= 32:
        assert rel(got, want) < TOL


def d_topk_magnitude(x, topk_ids, w_gate, w_up, w_down, dy):
    """[T, k] Σ_i |da_i · h_i| with da = w_down[e]ᵀ dy[t], h = silu(g) ⊙ u: the magnitude of the terms of
    each topk_weights gradient. NOTES: that gradient is one dot product of bf16-rounded factors, so its
    error scales with this, not with its (possibly cancelled) value: a single cancelled value can fail
    a plain relative error (tests/gpu/layer_check.cpp (expect_matches_reference) says more)."""
    x32, dy32 = x.detach().float(), dy.float()
    mag = torch.zeros(topk_ids.shape, device=x.device)
    for e in range(w_gate.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.silu(x32[token] @ w_gate[e].detach().float().t()) * (x32[token] @ w_up[e].detach().float().t())
        da = dy32[token] @ w_down[e].detach().float()
        mag[token, slot] = (da * h).abs().sum(dim=1)
    return mag


def make(T, H, I, E, k, Is=0, routing="random", seed=None):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else torch.seed() % 2**31)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, generator=g, **bf)
    if routing == "random":
        topk_ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k]
    elif routing == "one":
        topk_ids = torch.full((T, k), E // 2, device="cuda")
    else:  # two experts only: the others get no rows
        topk_ids = torch.tensor([0, E - 1], device="cuda").repeat(T, (k + 1) // 2)[:, :k]
    topk_weights = torch.rand(T, k, device="cuda", generator=g) + 0.05
    w, s = expert_weights(g, E, I, H, Is)
    return x, topk_ids.contiguous(), topk_weights, w, s


def expect_plain_pytorch(y, grads, leaves, ids, dy):
    """y and the gradients of `leaves` (x, topk_weights, w_gate, w_up, w_down, then the shared expert's
    three if any) within TOL of reference_moe's, the topk_weights gradient per value (check_d_topk)."""
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    rx, rtw, *rw = ref_leaves
    ref_s = rw[3:] if len(rw) > 3 else [None, None, None]
    y_ref = reference_moe(rx, ids, rtw, *rw[:3], *ref_s)
    ref_grads = torch.autograd.grad(y_ref, ref_leaves, dy.float())
    assert rel(y, y_ref) < TOL
    names = ["x", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"]
    mag = d_topk_magnitude(leaves[0], ids, *leaves[2:5], dy)
    for name, got, want in zip(names, grads, ref_grads):
        if name == "topk_weights":
            check_d_topk(got, want, mag)
        else:
            assert rel(got, want) < TOL, name


CASES = [
    dict(T=200, H=128, I=64, E=8, k=2, Is=64),
    dict(T=130, H=128, I=128, E=4, k=1, Is=0),
    dict(T=257, H=64, I=64, E=8, k=2, Is=0, routing="two"),
    dict(T=300, H=128, I=64, E=8, k=1, Is=64, routing="one"),
    dict(T=1, H=64, I=64, E=1, k=1, Is=64),
]


# How the autograd path keeps the forward's context: as a tensor autograd saves (the default), in the
# workspace (save_forward_context=False: backward recomputes it), in an explicit Workspace.
CONTEXTS = ["saved", "recomputed", "workspace"]


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("backend", ["fused", "unfused"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_forward_and_gradients_match_plain_pytorch(case, backend, context):
    x, ids, tw, w, s = make(**case)
    leaves = [x, tw, *w] + ([t for t in s] if case["Is"] else [])
    for t in leaves:
        t.requires_grad_()
    config = lynx.Config(backend=backend, save_forward_context=context != "recomputed")
    if context == "workspace":
        T, H = x.shape
        E, I, _ = w[0].shape
        ws = lynx.Workspace(T, H, I, E, ids.shape[1], case["Is"], config=config)
        y = lynx.moe(x, ids, tw, *w, *s, workspace=ws)
    else:
        y = lynx.moe(x, ids, tw, *w, *s, config=config)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    lynx.check()
    expect_plain_pytorch(y, grads, leaves, ids, dy)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
@pytest.mark.parametrize("saved", [True, False], ids=["saved", "recomputed"])
def test_explicit_workspace_forward_recompute_backward(backend, saved):
    T, H, I, E, k, Is = 300, 128, 64, 8, 2, 64
    x, ids, tw, w, s = make(T=T, H=H, I=I, E=E, k=k, Is=Is)
    ws = lynx.Workspace(T, H, I, E, k, Is, config=lynx.Config(backend=backend, save_forward_context=saved))
    y = lynx.functional.forward(ws, x, ids, tw, *w, *s)
    assert (ws.context_bytes > 0) == saved  # kept by forward only when the config says so
    counts = None
    if not saved:
        counts = lynx.functional.recompute_forward_context(ws, x, ids, tw, *w, *s)
        assert ws.context_bytes > 0
    dy = torch.randn_like(y)
    g = lynx.functional.backward(ws, dy, x, ids, tw, *w, *s)
    ws.check()

    leaves = [t.detach().float().requires_grad_() for t in [x, tw, *w, *s]]
    y_ref = reference_moe(leaves[0], ids, leaves[1], *leaves[2:])
    ref_grads = torch.autograd.grad(y_ref, leaves, dy.float())
    assert rel(y, y_ref) < TOL
    mag = d_topk_magnitude(x, ids, *w, dy)
    for name, got, want in zip(g._fields, g, ref_grads):
        if name == "d_topk_weights":
            check_d_topk(got, want, mag)
        else:
            assert rel(got, want) < TOL, name

    # The schedule: every (t, j) slot exactly once, experts in order, padded to 128-row blocks.
    sched = ws.schedule()
    want_rows = torch.bincount(ids.flatten(), minlength=E).int()
    assert torch.equal(sched.expert_rows, want_rows)
    if counts is not None:
        assert torch.equal(counts, want_rows)
    offsets = sched.expert_offset.long()
    assert offsets[0] == 0 and (offsets % 128 == 0).all()
    assert torch.equal(offsets[1:] - offsets[:-1], (want_rows.long() + 127) // 128 * 128)
    rows = sched.slot_row.long()
    assert torch.equal(sched.row_token_slot[rows].long(), torch.arange(T * k, device="cuda"))
    assert torch.equal(offsets[ids.flatten()] <= rows, torch.ones_like(rows, dtype=torch.bool))
    assert torch.equal(rows < offsets[ids.flatten() + 1], torch.ones_like(rows, dtype=torch.bool))


def test_explicit_backward_recomputes_a_stale_context():
    """x changed in place after forward: the kept context no longer matches, and backward must not use
    it (the C++ side sees the same pointers)."""
    T, H, I, E, k = 200, 128, 64, 8, 2
    x, ids, tw, w, s = make(T=T, H=H, I=I, E=E, k=k)
    ws = lynx.Workspace(T, H, I, E, k)
    lynx.functional.forward(ws, x, ids, tw, *w)
    x.mul_(-0.5)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    g = lynx.functional.backward(ws, dy, x, ids, tw, *w)
    ws.check()
    leaves = [t.detach().float().requires_grad_() for t in [x, tw, *w]]
    ref_grads = torch.autograd.grad(reference_moe(leaves[0], ids, leaves[1], *leaves[2:]), leaves, dy.float())
    for name in ("dx", "dw_gate", "dw_up", "dw_down"):
        assert rel(getattr(g, name), ref_grads[g._fields.index(name)]) < TOL, name


def test_scratch_comes_from_the_caching_allocator_and_goes_back():
    T, H, I, E, k = 256, 128, 64, 8, 2
    x, ids, tw, w, s = make(T=T, H=H, I=I, E=E, k=k)
    ws = lynx.Workspace(T, H, I, E, k)
    assert ws.scratch_bytes > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = lynx.functional.forward(ws, x, ids, tw, *w)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before >= ws.scratch_bytes  # taken from PyTorch during the call
    assert torch.cuda.memory_allocated() - before < ws.scratch_bytes  # and given back (y stays)
    assert rel(y, reference_moe(x.float(), ids, tw, *[t.float() for t in w])) < TOL


def _params(layer):
    return [p for p in layer.parameters() if p.requires_grad]


def _grads_of(layer, xs, dys):
    """Every forward of `layer` first (their contexts in flight together), then each one's gradients
    (the parameters', then x's), the last forward's first."""
    ys = [layer(x) for x in xs]
    got = [torch.autograd.grad(y, _params(layer) + [x], dy) for y, x, dy in reversed(list(zip(ys, xs, dys)))]
    return got[::-1]


def _one_at_a_time(layer, xs, dys):
    return [torch.autograd.grad(layer(x), _params(layer) + [x], dy) for x, dy in zip(xs, dys)]


def _inputs(n, T, H):
    xs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
    dys = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    return xs, dys


def _fresh(xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def _expect_equal(got, want):
    """The same kernels on the same rows: the same bits, forward by forward. NOTES: per forward, not
    accumulated in .grad: autograd sums the forwards' gradients in the order it runs the backwards,
    and a sum of three in another order may round differently."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [2, 3])
def test_forwards_in_flight_give_one_at_a_time_gradients(n):
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    xs, dys = _inputs(n, 100, 128)
    _expect_equal(_grads_of(layer, _fresh(xs), dys), _one_at_a_time(layer, _fresh(xs), dys))


def test_context_offloaded_to_the_cpu_and_checkpointing():
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    xs, dys = _inputs(2, 100, 128)
    want = _one_at_a_time(layer, _fresh(xs), dys)
    with torch.autograd.graph.save_on_cpu():
        got = _grads_of(layer, _fresh(xs), dys)
    _expect_equal(got, want)
    fresh = _fresh(xs)
    ys = [torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) for x in fresh]
    got = [torch.autograd.grad(y, _params(layer) + [x], dy) for y, x, dy in zip(ys, fresh, dys)]
    _expect_equal(got, want)


def test_workspace_lifetime_and_tags():
    ws = lynx.Workspace(64, 64, 64, 4, 2)
    assert ws.tag < 0 and ws.device_bytes > 0
    ws.close()
    with pytest.raises(ValueError, match="after close"):
        ws.device_bytes
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    with pytest.raises(ValueError, match="workspace_tag"):
        lynx.moe(x, ids, tw, *w, workspace_tag=-3)


def test_copied_layers_get_their_own_workspaces():
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    twin = copy.deepcopy(layer)
    assert twin.workspace_tag != layer.workspace_tag
    x = torch.randn(50, 128, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), twin(x))


def test_explicit_forward_under_inference_mode():
    T, H, I, E, k = 100, 64, 64, 4, 2
    with torch.inference_mode():
        x, ids, tw, w, s = make(T=T, H=H, I=I, E=E, k=k)
        ws = lynx.Workspace(T, H, I, E, k)
        y = lynx.functional.forward(ws, x, ids, tw, *w)
    ws.check()
    assert rel(y, reference_moe(x, ids, tw, *w)) < TOL


def test_workspace_schedule_before_any_forward_is_an_error():
    ws = lynx.Workspace(64, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="holds no schedule"):
        ws.schedule()


def test_workspace_rejects_another_shape():
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    ws = lynx.Workspace(128, 64, 64, 4, 2)
    with pytest.raises(ValueError, match="is not the workspace's"):
        lynx.functional.forward(ws, x, ids, tw, *w)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_unrouted_slots_add_nothing(backend):
    """A topk_ids of -1: the slot is not routed. Its router weight (NaN here) is not read, it adds no
    term, and its topk_weights gradient is exactly 0; the last tokens, with no slot routed, get the
    shared expert alone (a rank with fewer tokens pads this way)."""
    x, ids, tw, w, s = make(T=256, H=128, I=64, E=8, k=2, Is=64)
    ids = ids.clone()
    ids[::3, 1] = -1
    ids[200:] = -1
    tw = tw.masked_fill(ids < 0, float("nan"))
    leaves = [x, tw, *w, *s]
    for t in leaves:
        t.requires_grad_()
    y = lynx.moe(x, ids, tw, *w, *s, config=lynx.Config(backend=backend))
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    lynx.check()
    assert (grads[1][ids < 0] == 0).all()
    expect_plain_pytorch(y, grads, leaves, ids, dy)


def test_experts_without_rows_get_zero_gradients():
    x, ids, tw, w, s = make(T=100, H=64, I=64, E=8, k=2, routing="two")
    for t in w:
        t.requires_grad_()
    y = lynx.moe(x, ids, tw, *w)
    dwg, dwu, dwd = torch.autograd.grad(y, w, torch.randn_like(y))
    for e in range(1, 7):
        assert (dwg[e] == 0).all() and (dwu[e] == 0).all() and (dwd[e] == 0).all()


def test_int64_ids_and_bitwise_determinism():
    x, ids, tw, w, s = make(T=200, H=128, I=64, E=8, k=2)
    for t in w:
        t.requires_grad_()
    dy = torch.randn(200, 128, device="cuda", dtype=torch.bfloat16)
    first = None
    for _ in range(5):
        y = lynx.moe(x, ids.long(), tw, *w)
        out = [y, *torch.autograd.grad(y, w, dy)]
        if first is None:
            first = out
        for a, b in zip(out, first):
            assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_gate_and_up_as_views_of_one_tensor(precision):
    """w_gate and w_up as the halves of one [E, 2I, H] tensor (strided views, as lynx.hf gives them): y and
    every gradient have the bits of the same call on contiguous copies, the halves' gradient flowing
    into the joined tensor."""
    x, ids, tw, w, s = make(T=200, H=128, I=128, E=8, k=2)
    gate_up = torch.cat([w[0], w[1]], dim=1).requires_grad_()
    down = w[2].requires_grad_()
    gate, up = w[0].requires_grad_(), w[1].requires_grad_()
    dy = torch.randn(200, 128, device="cuda", dtype=torch.bfloat16)
    config = lynx.Config(precision=precision)
    want = lynx.moe(x, ids, tw, gate, up, down, config=config, workspace_tag=61)
    want_grads = torch.autograd.grad(want, [gate, up, down], dy)
    got = lynx.moe(x, ids, tw, gate_up[:, :128], gate_up[:, 128:], down, config=config, workspace_tag=62)
    got_grads = torch.autograd.grad(got, [gate_up, down], dy)
    lynx.check()
    assert torch.equal(got, want)
    assert torch.equal(got_grads[0], torch.cat(want_grads[:2], dim=1))
    assert torch.equal(got_grads[1], want_grads[2])


def test_torch_compile_fullgraph():
    x, ids, tw, w, s = make(T=256, H=128, I=128, E=8, k=2)

    def f(x, ids, tw, wg, wu, wd):
        return lynx.moe(x * 2, ids, tw, wg, wu, wd) + 1

    compiled = torch.compile(f, fullgraph=True)
    assert rel(compiled(x, ids, tw, *w), f(x, ids, tw, *w)) < 1e-6


def test_torch_compile_dynamic_shapes_with_backward():
    """Symbolic token counts: the saving op's fake kernel gives its context a size the op will tell."""
    def f(x, ids, tw, wg, wu, wd):
        return lynx.moe(x, ids, tw, wg, wu, wd)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for T in (256, 320):
        x, ids, tw, w, s = make(T=T, H=128, I=128, E=8, k=2, seed=T)
        leaves = [x, tw, *w]
        for t in leaves:
            t.requires_grad_()
        dy = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
        y = compiled(x, ids, tw, *w)
        got = torch.autograd.grad(y, leaves, dy)
        y_eager = f(x, ids, tw, *w)
        want = torch.autograd.grad(y_eager, leaves, dy)
        assert torch.equal(y, y_eager)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def capture_moe_step(config=lynx.Config()):
    """lynx.moe's forward and backward on a random problem (T = 256, H = I = 128, E = 8, k = 2) captured in a
    CUDA graph, after a warm-up outside the capture: the graph, the tensors its replays write (y, and the
    gradients of x and w) and its inputs (x, the routing tensors the replays read, w, dy)."""
    x, ids, tw, w, _ = make(T=256, H=128, I=128, E=8, k=2)
    for t in w:
        t.requires_grad_()
    x.requires_grad_()
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = lynx.moe(x, ids, tw, *w, config=config)
        torch.autograd.grad(y, [x, *w], dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lynx.moe(x, ids, tw, *w, config=config)
        grads = torch.autograd.grad(y, [x, *w], dy)
    return graph, y, grads, (x, ids, tw, w, dy)


def test_cuda_graph_capture_replays_with_new_routing():
    graph, y, grads, (x, static_ids, static_tw, w, dy) = capture_moe_step()
    for _ in range(2):
        _, new_ids, new_tw, _, _ = make(T=256, H=128, I=128, E=8, k=2)
        static_ids.copy_(new_ids)
        static_tw.copy_(new_tw)
        graph.replay()
        torch.cuda.synchronize()
        ref = [t.detach().float().requires_grad_() for t in [x, *w]]
        y_ref = reference_moe(ref[0], static_ids, static_tw, *ref[1:])
        ref_grads = torch.autograd.grad(y_ref, ref, dy.float())
        assert rel(y, y_ref) < TOL
        for got, want in zip(grads, ref_grads):
            assert rel(got, want) < TOL


def record_forward_contexts(monkeypatch):
    """The context bytes each forward through the binding is given, in order (0: lynx._C.forward, which on
    the autograd pair's workspace is the forward that keeps no context)."""
    seen = []
    forward_into, forward = lynx._C.forward_into, lynx._C.forward

    def into(ws, inputs, y, context, context_bytes, stream):
        seen.append(context_bytes)
        return forward_into(ws, inputs, y, context, context_bytes, stream)

    def plain(ws, inputs, y, stream):
        seen.append(0)
        return forward(ws, inputs, y, stream)

    monkeypatch.setattr(lynx._C, "forward_into", into)
    monkeypatch.setattr(lynx._C, "forward", plain)
    return seen


def _no_gradient(mode):
    return torch.inference_mode() if mode == "inference_mode" else torch.no_grad()


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_forward_without_gradients_keeps_no_context(monkeypatch, precision, mode):
    """Where no gradient is wanted, lynx.nn.MoE runs the forward that keeps no context: y has the bits of
    the saving forward's, and the call takes from PyTorch less than that forward by g's and u's bytes,
    which it neither writes nor is lent."""
    T, H, I, E, k = 512, 256, 256, 8, 2
    layer = lynx.nn.MoE(hidden=H, intermediate=I, num_experts=E, top_k=k, device="cuda", precision=precision)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    seen = record_forward_contexts(monkeypatch)

    def peak(run):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = run()
        torch.cuda.synchronize()
        return y, torch.cuda.max_memory_allocated() - before

    want, saving = peak(lambda: layer(x))
    assert seen[-1] > 0, "the saving forward, weights requiring grad"
    if mode == "nothing_requires_grad":
        layer.requires_grad_(False)
        got, keeping_none = peak(lambda: layer(x))
    else:
        with _no_gradient(mode):
            got, keeping_none = peak(lambda: layer(x))
    assert seen[-1] == 0, "the forward that keeps no context"
    lynx.check()
    assert torch.isfinite(got).all() and torch.equal(got, want)
    gate_up = 2 * 2 * T * k * I  # g and u by slot, bf16
    assert keeping_none <= saving - gate_up, (keeping_none, saving)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_torch_compile_of_a_forward_without_gradients(monkeypatch, mode):
    """A compiled forward in a mode without gradients runs the forward that keeps no context, though the
    weights require grad; the same function outside the mode, the saving one; both with eager's bits."""
    x, ids, tw, w, _ = make(T=256, H=128, I=128, E=8, k=2)
    for t in w:
        t.requires_grad_()

    def f(x, ids, tw, wg, wu, wd):
        return lynx.moe(x, ids, tw, wg, wu, wd) * 2

    want = f(x, ids, tw, *w)
    compiled = torch.compile(f, fullgraph=True)
    seen = record_forward_contexts(monkeypatch)
    with _no_gradient(mode):
        got = compiled(x, ids, tw, *w)
    assert seen == [0]
    assert torch.equal(got, want.detach())
    again = compiled(x, ids, tw, *w)
    assert seen[-1] > 0 and again.requires_grad and torch.equal(again, want)


@pytest.mark.parametrize("precision", ["bf16", "fp8_block"])
def test_cuda_graph_captures_a_forward_without_gradients(monkeypatch, precision):
    """A forward under torch.no_grad captured in a CUDA graph (weights requiring grad) is the forward that
    keeps no context; its replays on new routing give the bits of an eager saving forward."""
    config = lynx.Config(precision=precision)
    x, ids, tw, w, _ = make(T=256, H=128, I=128, E=8, k=2)
    for t in w:
        t.requires_grad_()
    seen = record_forward_contexts(monkeypatch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            lynx.moe(x, ids, tw, *w, config=config)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lynx.moe(x, ids, tw, *w, config=config)
    assert seen == [0, 0]
    for _ in range(2):
        _, new_ids, new_tw, _, _ = make(T=256, H=128, I=128, E=8, k=2)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        graph.replay()
        torch.cuda.synchronize()
        want = lynx.moe(x, ids, tw, *w, config=config)
        assert seen[-1] > 0
        assert torch.isfinite(y).all() and torch.equal(y, want.detach())
    lynx.check()


def test_module_trains_its_router():
    torch.manual_seed(0)
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, shared_intermediate=64, device="cuda")
    x = torch.randn(4, 50, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    y.float().square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bad_arguments_are_named():
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    with pytest.raises(ValueError, match="topk_weights"):
        lynx.moe(x, ids, tw.double(), *w)
    with pytest.raises(ValueError, match="w_down"):
        lynx.moe(x, ids, tw, w[0], w[1], w[2].transpose(1, 2))
    with pytest.raises(ValueError, match="shape.hidden"):
        lynx.moe(x[:, :32].contiguous(), ids, tw, w[0][:, :, :32].contiguous(), w[1][:, :, :32].contiguous(),
                 w[2][:, :32].contiguous())
    bad = ids.clone()
    bad[3, 1] = 99
    lynx.moe(x, bad, tw, *w)
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 99 is out of range"):
        lynx.check()


def test_frozen_experts_skip_their_weight_gradients():
    """Experts (or the shared expert) that do not require grad: their weight gradients are not computed,
    and every other gradient keeps the bits of the backward that computes them all."""
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, shared_intermediate=64, device="cuda")
    x = torch.randn(50, 128, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(50, 128, device="cuda", dtype=torch.bfloat16)
    names = ["x"] + [n for n, _ in layer.named_parameters()]

    def gradients():
        xi = x.clone().requires_grad_()
        layer(xi).backward(dy)
        got = [xi.grad] + [None if p.grad is None else p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return got

    want = gradients()
    experts, shared = ("w1", "w2", "w3"), ("shared_w1", "shared_w2", "shared_w3")
    for frozen in (experts, shared, experts + shared):
        for n in frozen:
            getattr(layer, n).requires_grad_(False)
        got = gradients()
        for n in frozen:
            getattr(layer, n).requires_grad_(True)
        for name, g, w in zip(names, got, want):
            if name in frozen:
                assert g is None, name
            else:
                assert torch.equal(g, w), f"{name} with {frozen} frozen"


def test_a_released_tags_call_raises_its_own_errors():
    """A call whose tag was released runs on a workspace made for it alone, which lynx.check() never
    sees: the call raises its kernels' errors itself."""
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    lynx._workspaces.release(91)
    bad = ids.clone()
    bad[5, 0] = 17
    with pytest.raises(ValueError, match=r"topk_ids\[5, 0\] = 17 is out of range"):
        lynx.moe(x, bad, tw, *w, workspace_tag=91)
    lynx.check()  # nothing left over


def test_check_reports_every_workspace_and_clears_each():
    """Two workspaces with errors: one lynx.check() names both (by shape), and leaves neither set."""
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    bad = ids.clone()
    bad[5, 0] = 17
    lynx.moe(x, bad, tw, *w, workspace_tag=93)
    lynx.moe(x[:40], bad[:40], tw[:40], *w, workspace_tag=93)
    with pytest.raises(ValueError, match=r"2 workspaces reported errors.*"
                                         r"topk_ids\[5, 0\] = 17 is out of range.*T = 64, H = 64.*"
                                         r"topk_ids\[5, 0\] = 17 is out of range.*T = 40, H = 64"):
        lynx.check()
    lynx.check()  # both cleared
    assert rel(lynx.moe(x, ids, tw, *w, workspace_tag=93), reference_moe(x, ids, tw, *w)) < TOL
    lynx.check()


def test_check_inside_a_capture_is_refused():
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    lynx.moe(x, ids, tw, *w)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="lynx.check: waits for the device"):
        with torch.cuda.graph(graph):
            lynx.check()
    lynx.check()


def test_a_workspace_larger_than_the_device_is_out_of_memory():
    """FP8 copies of 2048 experts of 16384 × 16384 (3.3 TB): lynx.OutOfMemoryError, which PyTorch's
    out-of-memory handlers catch, also a lynx.LynxError; nothing is left made."""
    made = len(lynx._workspaces.all_workspaces())
    with pytest.raises(lynx.OutOfMemoryError, match="cannot allocate") as caught:
        lynx.Workspace(256, 16384, 16384, 2048, 2, config=FP8)
    assert isinstance(caught.value, torch.OutOfMemoryError) and isinstance(caught.value, lynx.LynxError)
    assert len(lynx._workspaces.all_workspaces()) == made
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    assert rel(lynx.moe(x, ids, tw, *w), reference_moe(x, ids, tw, *w)) < TOL  # the device still works


def test_mismatched_rows_are_named_with_the_counts_given():
    """topk_ids or topk_weights of another token count than x: the error gives the counts the caller
    passed, not those after padding to token_multiple."""
    x, ids, tw, w, s = make(T=100, H=64, I=64, E=4, k=2)
    config = lynx.Config(token_multiple=64)
    with pytest.raises(ValueError, match=r"topk_ids: shape must be \[100, k\].*got \[99, 2\]"):
        lynx.moe(x, ids[:99], tw[:99], *w, config=config)
    with pytest.raises(ValueError, match=r"topk_weights: shape must be \[100, 2\], got \[100, 1\]"):
        lynx.moe(x, ids, tw[:, :1], *w, config=config)


def test_bad_arguments_are_refused_before_a_workspace_is_made():
    x, ids, tw, w, s = make(T=72, H=64, I=64, E=4, k=2)  # a shape no other test runs
    made = len(lynx._workspaces.all_workspaces())
    with pytest.raises(ValueError, match="x: must be a CUDA tensor"):
        lynx.moe(x.cpu(), ids, tw, *w)
    with pytest.raises(ValueError, match="topk_weights: must be a CUDA tensor"):
        lynx.moe(x, ids, tw.cpu(), *w)
    # Shapes too, in FP8 before any weight is quantised, and a dy of another shape before the backward
    # looks up its workspace.
    with pytest.raises(ValueError, match=r"topk_weights.*shape must be \[72, 2\], got \[72, 1\]"):
        lynx.moe(x, ids, tw[:, :1].contiguous(), *w, config=FP8)
    with pytest.raises(ValueError, match=r"x: must be \[T, H\], got \[1, 72, 64\]"):
        lynx.moe(x.unsqueeze(0), ids, tw, *w)
    assert len(lynx._workspaces.all_workspaces()) == made
    with pytest.raises(ValueError, match=r"dy.*shape must be \[72, 64\], got \[72, 32\]"):
        lynx.ops.moe_backward(torch.zeros(72, 32, device="cuda", dtype=torch.bfloat16), x, ids, tw, *w, None, None,
                              None, *lynx.functional._op_config(lynx.Config(), 0))
    assert len(lynx._workspaces.all_workspaces()) == made


def test_explicit_calls_and_config_name_a_bad_argument():
    T, H, I, E, k = 64, 128, 128, 4, 2
    x, ids, tw, w, _ = make(T=T, H=H, I=I, E=E, k=k)
    ws = lynx.Workspace(T, H, I, E, k)
    with pytest.raises(ValueError, match=r"x: must be \[T, H\], got \[1, 64, 128\]"):
        lynx.functional.forward(ws, x.unsqueeze(0), ids, tw, *w)
    with pytest.raises(ValueError, match=r"topk_ids: must be \[T, k\], got \[128\]"):
        lynx.functional.backward(ws, torch.zeros_like(x), x, ids.flatten(), tw, *w)
    given = lynx.Workspace(T, H, I, E, k, config=FP8)
    blocks = [e4m3_blocks(t) for t in w]
    with pytest.raises(ValueError, match="w_up_scales: must be a tensor, got NoneType"):
        lynx.functional.set_quantized_weights(given, *(b for b, _ in blocks), blocks[0][1], None, blocks[2][1])
    for bad in (-1, 3_600_001):
        with pytest.raises(ValueError, match=r"config.peer_timeout_ms: must be in \[0, 3600000\]"):
            lynx.Config(peer_timeout_ms=bad)


def test_a_workspaces_calls_on_two_streams_run_in_the_order_queued():
    """Behind a long kernel on stream a, a forward on a and its backward on stream b give the bits of the
    two on one stream (a call waits for the workspace's last call where that was on another stream:
    include/lynx/moe.h), and Workspace.check() on the default stream reports the error of a forward
    queued on a behind such a kernel."""
    T, H, I, E, k = 200, 128, 64, 8, 2
    x, ids, tw, w, _ = make(T=T, H=H, I=I, E=E, k=k)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    one_stream = lynx.Workspace(T, H, I, E, k)
    want_y = lynx.functional.forward(one_stream, x, ids, tw, *w)
    want = lynx.functional.backward(one_stream, dy, x, ids, tw, *w)
    # The workspace holds another routing's context first: a backward run before its forward would read it.
    ws = lynx.Workspace(T, H, I, E, k)
    lynx.functional.forward(ws, x, ids.roll(1, dims=0), tw, *w)
    bad = ids.clone()
    bad[3, 1] = E
    torch.cuda.synchronize()
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        torch.cuda._sleep(1 << 29)  # cycles: a few tenths of a second
        y = lynx.functional.forward(ws, x, ids, tw, *w)
    with torch.cuda.stream(b):
        got = lynx.functional.backward(ws, dy, x, ids, tw, *w)
    torch.cuda.synchronize()
    assert torch.equal(y, want_y)
    for name, g, h in zip(want._fields, got, want):
        assert (g is None and h is None) or torch.equal(g, h), name
    with torch.cuda.stream(a):
        torch.cuda._sleep(1 << 29)
        lynx.functional.forward(ws, x, bad, tw, *w)
    with pytest.raises(ValueError, match=r"topk_ids\[3, 1\] = 8 is out of range"):
        ws.check()
    torch.cuda.synchronize()
    ws.check()


def test_token_multiple_pads_calls_onto_a_few_workspaces():
    """Config(token_multiple=64): a layer called at 40, 50 and 64 tokens keeps one workspace (T = 64) and
    gives, for every call, the bits of a layer without padding (y, dx and every parameter's gradient: the
    padding rows are not routed); lynx.moe likewise."""
    torch.manual_seed(11)
    padded = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda",
                         config=lynx.Config(token_multiple=64))
    torch.manual_seed(11)
    plain = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    for T in (40, 50, 64):
        x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [layer(xi) for layer, xi in zip((padded, plain), xs)]
        assert ys[0].shape == (T, 128) and torch.equal(ys[0], ys[1]), T
        dy = torch.randn_like(ys[0])
        for y in ys:
            y.backward(dy)
        assert torch.equal(xs[0].grad, xs[1].grad), T
        for (name, p), (_, q) in zip(padded.named_parameters(), plain.named_parameters()):
            assert torch.equal(p.grad, q.grad), f"{name} at T = {T}"
            p.grad = q.grad = None
    kept = [s for s in lynx._workspaces._BY_SPEC if s[6].tag == padded.workspace_tag]
    assert [s[0] for s in kept] == [64]
    x, ids, tw, w, _ = make(T=50, H=64, I=64, E=4, k=2)
    assert torch.equal(lynx.moe(x, ids, tw, *w, config=lynx.Config(token_multiple=32), workspace_tag=5),
                       lynx.moe(x, ids, tw, *w, workspace_tag=5))
    assert sorted(s[0] for s in lynx._workspaces._BY_SPEC if s[6].tag == 5 and s[1:3] == (64, 64)) == [50, 64]
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="config.token_multiple: must be an int >= 1"):
            lynx.Config(token_multiple=bad)


def test_a_call_of_no_tokens_gives_empty_outputs_and_zero_gradients():
    """No tokens (an empty batch): y of x's shape, dx empty and zero gradients for every weight, through
    lynx.nn.MoE (with a shared expert and the router) with and without token_multiple; through lynx.moe
    (and its forward alone), an empty topk_weights gradient too."""
    for config in (lynx.Config(), lynx.Config(token_multiple=64)):
        layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, shared_intermediate=64,
                            device="cuda", config=config)
        for shape in ((0, 128), (3, 0, 128)):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = layer(x)
            assert y.shape == x.shape
            y.sum().backward()
            assert x.grad.shape == x.shape
            for name, p in layer.named_parameters():
                assert p.grad is not None and not p.grad.any(), name
                p.grad = None
    x, ids, tw, w, _ = make(T=1, H=64, I=64, E=4, k=2)
    x, ids, tw = x[:0].detach().requires_grad_(), ids[:0], tw[:0].detach().requires_grad_()
    w = [t.detach().requires_grad_() for t in w]
    y = lynx.moe(x, ids, tw, *w)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64) and tw.grad.shape == (0, 2)
    assert all(t.grad is not None and not t.grad.any() for t in w)
    with torch.no_grad():
        assert lynx.moe(x, ids, tw, *w).shape == (0, 64)


def test_a_layer_at_many_token_counts_is_warned_once():
    """A layer called at MANY_TOKEN_COUNTS token counts (a workspace each) is told of token_multiple, once;
    with token_multiple, the same calls make one workspace and no warning."""
    many = lynx._workspaces.MANY_TOKEN_COUNTS
    plain = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    padded = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda",
                         config=lynx.Config(token_multiple=64))
    for layer, want in ((plain, 1), (padded, 0)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for T in range(1, many + 3):
                layer(torch.randn(T, 128, device="cuda", dtype=torch.bfloat16))
        told = [str(w.message) for w in seen if "token counts" in str(w.message)]
        assert len(told) == want, told
        assert all(f"workspaces for {many} token counts" in m and "token_multiple" in m for m in told)
    assert len([s for s in lynx._workspaces._BY_SPEC if s[6].tag == padded.workspace_tag]) == 1


def test_module_checks_its_sizes_and_its_input():
    with pytest.raises(ValueError, match="shape.hidden"):
        lynx.nn.MoE(hidden=100, intermediate=64, num_experts=8, top_k=2, device="cuda")
    with pytest.raises(ValueError, match="shape.top_k"):
        lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=9, device="cuda")
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]"):
        layer(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))  # as many numbers as 8 tokens
    with pytest.raises(ValueError, match="bfloat16"):
        layer(torch.randn(4, 128, device="cuda"))


def test_module_in_a_one_rank_group_takes_ep_tokens():
    """A group of one rank is no expert parallelism, yet takes ep_tokens as lynx.moe does: the layer pads
    its tokens and gives the bits of the same layer without a group."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(7)
        plain = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
        torch.manual_seed(7)
        grouped = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda",
                              ep_group=dist.group.WORLD, ep_tokens=48)
        x = torch.randn(40, 128, device="cuda", dtype=torch.bfloat16)
        y = grouped(x)
        assert y.shape == (40, 128) and torch.equal(y, plain(x))
        with pytest.raises(ValueError, match="ep_tokens: 32 is below"):
            lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda",
                        ep_group=dist.group.WORLD, ep_tokens=32)(x)
        # An empty batch, as without a group: y [0, H] (lynx.moe and the module alike).
        xs, ids, tw, w, _ = make(T=8, H=128, I=64, E=8, k=2)
        assert lynx.moe(xs[:0], ids[:0], tw[:0], *w, ep_group=dist.group.WORLD).shape == (0, 128)
        assert grouped(x[:0]).shape == (0, 128)
    finally:
        dist.destroy_process_group()


def test_module_backward_takes_a_gradient_at_any_offset():
    layer = lynx.nn.MoE(hidden=128, intermediate=64, num_experts=8, top_k=2, device="cuda")
    x = torch.randn(50, 128, device="cuda", dtype=torch.bfloat16)
    grads = []
    for pad in (0, 1):  # 1: y's gradient a view 2 bytes into cat's, not 16-byte aligned
        xi = x.clone().requires_grad_()
        y = layer(xi)
        torch.cat([torch.zeros(pad, device="cuda", dtype=y.dtype), y.flatten()]).float().sum().backward()
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])


def test_capture_of_a_shape_never_run_is_refused():
    x, ids, tw, w, s = make(T=88, H=64, I=64, E=4, k=2)  # a shape no other test runs
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="no workspace yet"):
        with torch.cuda.graph(graph):
            lynx.moe(x, ids, tw, *w)
    assert rel(lynx.moe(x, ids, tw, *w), reference_moe(x, ids, tw, *w)) < TOL


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_two_gpus_are_refused_and_any_current_device_works():
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    with pytest.raises(ValueError, match="w_gate: on cuda:1, but x is on cuda:0"):
        lynx.moe(x, ids, tw, w[0].to("cuda:1"), w[1], w[2])
    want = lynx.moe(x, ids, tw, *w)
    with torch.cuda.device(1):  # the call runs on x's device whatever the current one is
        got = lynx.moe(x, ids, tw, *w)
    assert torch.equal(got, want)
    # A bad route on cuda:1 is found by lynx.check() with cuda:0 current (it waits for each device's own
    # stream), and not by a check of cuda:0 alone.
    x1, tw1, w1 = x.to("cuda:1"), tw.to("cuda:1"), [t.to("cuda:1") for t in w]
    bad = ids.to("cuda:1")
    bad[5, 0] = -7
    lynx.moe(x1, bad, tw1, *w1)
    lynx.check("cuda:0")
    with pytest.raises(ValueError, match=r"topk_ids\[5, 0\] = -7 is out of range"):
        lynx.check()
    # Pre-quantised weights: on the workspace's device, given with any current device.
    given = lynx.Workspace(64, 64, 64, 4, 2, config=FP8, device="cuda:1")
    blocks = [e4m3_blocks(t) for t in w1]
    q, scales = [b for b, _ in blocks], [sc for _, sc in blocks]
    with pytest.raises(ValueError, match="w_up_scales: on cuda:0, but the workspace is on cuda:1"):
        lynx.functional.set_quantized_weights(given, *q, scales[0], scales[1].to("cuda:0"), scales[2])
    lynx.functional.set_quantized_weights(given, *q, *scales)  # cuda:0 current
    y1 = lynx.functional.forward(given, x1, ids.to("cuda:1"), tw1, *q)
    lynx.check()
    assert torch.isfinite(y1).all()


def test_check_of_one_device():
    x, ids, tw, w, s = make(T=64, H=64, I=64, E=4, k=2)
    bad = ids.clone()
    bad[2, 1] = 4
    lynx.moe(x, bad, tw, *w)
    with pytest.raises(ValueError, match="device: must be a CUDA device, got cpu"):
        lynx.check("cpu")
    with pytest.raises(ValueError, match=r"topk_ids\[2, 1\] = 4 is out of range"):
        lynx.check(torch.cuda.current_device())
    lynx.check("cuda")  # reported once


FP8 = lynx.Config(precision="fp8_block")
FP8_MAX_DISSIMILARITY = 1 / 256  # tests/gpu/test_fp8_layer.cpp derives it


def dissimilarity(a, b):
    """1 − 2⟨a,b⟩/(|a|²+|b|²) in float64; a must be all finite."""
    assert torch.isfinite(a).all(), "non-finite values"
    a, b = a.double().flatten(), b.double().flatten()
    return (1 - 2 * (a @ b) / (a @ a + b @ b)).item()


@pytest.mark.parametrize("bf16_weight_grads", [False, True], ids=["fp8-wgrad", "bf16-wgrad"])
def test_fp8_forward_and_gradients_close_to_the_exact_layer(bf16_weight_grads):
    x, topk_ids, topk_weights, w, s = make(256, 256, 192, 8, 2, Is=64)
    leaves = [x, topk_weights, *w, *s]
    for t in leaves:
        t.requires_grad_(True)
    config = lynx.Config(precision="fp8_block", bf16_weight_grads=bf16_weight_grads)
    y = lynx.moe(x, topk_ids, topk_weights, *w, *s, config=config)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    lynx.check()
    y_ref = reference_moe(x, topk_ids, topk_weights, *w, *s)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy.float())
    assert dissimilarity(y, y_ref) < FP8_MAX_DISSIMILARITY
    with torch.no_grad():  # it is FP8: not the bf16 path's bits
        assert not torch.equal(y, lynx.moe(x, topk_ids, topk_weights, *w, *s))
    # dx's GEMMs bear two more quantised operands, the weight gradients' one to three more
    # (tests/gpu/test_fp8_layer.cpp derives each bound)
    bounds = {"dx": 1 / 192, "dw_gate": 3 / 512, "dw_up": 7 / 1536, "dw_down": 7 / 1536}
    for name, got, want in zip(["dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up",
                                "dws_down"], grads, grads_ref):
        assert dissimilarity(got, want) < bounds.get(name, FP8_MAX_DISSIMILARITY), name


def test_fp8_torch_compile_with_backward():
    """FP8 under torch.compile (fullgraph): the compiled forward and backward have the eager FP8 bits."""
    def f(x, ids, tw, wg, wu, wd):
        return lynx.moe(x, ids, tw, wg, wu, wd, config=FP8)

    compiled = torch.compile(f, fullgraph=True)
    x, ids, tw, w, _ = make(T=256, H=128, I=128, E=8, k=2)
    leaves = [x, tw, *w]
    for t in leaves:
        t.requires_grad_()
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    y = compiled(x, ids, tw, *w)
    got = torch.autograd.grad(y, leaves, dy)
    y_eager = f(x, ids, tw, *w)
    want = torch.autograd.grad(y_eager, leaves, dy)
    lynx.check()
    assert torch.isfinite(y).all() and torch.equal(y, y_eager)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fp8_cuda_graph_replays_see_new_routing_and_weights():
    """A captured FP8 forward and backward: each replay quantises the weights again inside the graph,
    so weights changed in place between replays (an optimizer step) are seen; every replay has the bits
    of an eager FP8 call (another workspace) on the same inputs."""
    graph, y, grads, (x, static_ids, static_tw, w, dy) = capture_moe_step(FP8)
    previous = None
    for step in range(2):
        _, new_ids, new_tw, _, _ = make(T=256, H=128, I=128, E=8, k=2)
        static_ids.copy_(new_ids)
        static_tw.copy_(new_tw)
        with torch.no_grad():
            w[step].mul_(1.5)  # in place, as an optimizer step
        graph.replay()
        torch.cuda.synchronize()
        y_eager = lynx.moe(x, static_ids, static_tw, *w, config=FP8, workspace_tag=7)
        want = torch.autograd.grad(y_eager, [x, *w], dy)
        lynx.check()
        assert torch.isfinite(y).all() and torch.equal(y, y_eager), f"replay {step}: y"
        for name, got, ref in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, want):
            assert torch.equal(got, ref), f"replay {step}: {name}"
        assert previous is None or not torch.equal(y, previous)
        previous = y.clone()


def e4m3_blocks(w):
    """w [E, R, C] quantised by lynx's recipe (docs/fp8.md): per 128×128 block the smallest power-of-two
    scale 2^e with amax <= 448·2^e (2^-126 at least, 1 for a block of zeros), values rounded to nearest
    even: (float8_e4m3fn [E, R, C], fp32 scales [E, R/128↑, C/128↑])."""
    E, R, C = w.shape
    rb, cb = -(-R // 128), -(-C // 128)
    padded = torch.zeros(E, rb * 128, cb * 128, dtype=torch.float32, device=w.device)
    padded[:, :R, :C] = w.float()
    amax = padded.view(E, rb, 128, cb, 128).abs().amax(dim=(2, 4))
    m, p = torch.frexp(amax)  # amax = m·2^p, m in [0.5, 1); 448 = 0.875·2^9
    e = torch.where(m <= 0.875, p - 9, p - 8).clamp(min=-126)
    scales = torch.ldexp(torch.ones_like(amax), torch.where(amax > 0, e, torch.zeros_like(e)))
    full = scales.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :R, :C]
    return (w.float() / full).to(torch.float8_e4m3fn), scales


def test_fp8_prequantized_weights_give_quantize_weights_bits():
    """Weights quantised outside lynx by its recipe, given with their scales (set_quantized_weights), give
    the bits of lynx quantising the bf16 weights itself: y, and with I a multiple of 128 every gradient."""
    T, H, I, E, k = 256, 320, 256, 8, 2
    x, ids, tw, w, _ = make(T, H, I, E, k)
    blocks = [e4m3_blocks(t) for t in w]
    q = [b for b, _ in blocks]
    given = lynx.Workspace(T, H, I, E, k, config=FP8)
    lynx.functional.set_quantized_weights(given, *q, *(s for _, s in blocks))
    by_lynx = lynx.Workspace(T, H, I, E, k, config=FP8)
    y = lynx.functional.forward(given, x, ids, tw, *q)
    y_ref = lynx.functional.forward(by_lynx, x, ids, tw, *w)
    dy = torch.randn_like(y)
    got = lynx.functional.backward(given, dy, x, ids, tw, *q)
    want = lynx.functional.backward(by_lynx, dy, x, ids, tw, *w)
    lynx.check()
    assert torch.isfinite(y).all() and torch.equal(y, y_ref)
    for name in ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.dw_gate.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="set_quantized_weights"):  # other e4m3 tensors than those given
        lynx.functional.forward(given, x, ids, tw, q[0].clone(), q[1], q[2])
    with pytest.raises(ValueError, match="e4m3"):  # e4m3 weights on a bf16 workspace
        lynx.functional.forward(lynx.Workspace(T, H, I, E, k), x, ids, tw, *q)
    blocks[1][1].mul_(2)  # a scale changed in place since: refused until given again
    with pytest.raises(ValueError, match="set_quantized_weights"):
        lynx.functional.forward(given, x, ids, tw, *q)
    # bf16 weights after pre-quantised ones: quantised again (nothing kept from before)
    assert torch.equal(lynx.functional.forward(given, x, ids, tw, *w), y_ref)
    made = len(lynx._workspaces.all_workspaces())
    with pytest.raises(ValueError, match="explicit lynx.Workspace"):  # lynx.moe's own workspaces: bf16 weights
        lynx.moe(x, ids, tw, *q, config=FP8, workspace_tag=71)
    with pytest.raises(ValueError, match="w_gate, w_up, w_down: must have one dtype"):
        lynx.moe(x, ids, tw, w[0], q[1], w[2], config=FP8, workspace_tag=71)
    assert len(lynx._workspaces.all_workspaces()) == made  # refused before a workspace was made
    with torch.inference_mode():  # inference tensors keep no version counter: their identity is still checked
        made = [e4m3_blocks(t) for t in w]
        qi = [b for b, _ in made]
        lynx.functional.set_quantized_weights(given, *qi, *(s for _, s in made))
        assert torch.equal(lynx.functional.forward(given, x, ids, tw, *qi), y_ref)
        with pytest.raises(ValueError, match="set_quantized_weights"):
            lynx.functional.forward(given, x, ids, tw, qi[0], qi[1].clone(), qi[2])
    with pytest.raises(ValueError, match="require grad"):  # autograd would hand back e4m3 weight gradients
        lynx.moe(x, ids, tw, q[0].detach().requires_grad_(), q[1], q[2], workspace=given)


def test_fp8_weights_changed_in_place_are_quantised_again(monkeypatch):
    # As in a process that never captured an FP8 call (after one, every call quantises: _fp8_weights), so
    # that what is tested is the version counters.
    monkeypatch.setattr(lynx.ops, "_FP8_CAPTURED", False)
    made = []
    quantize = lynx._C.quantize_weights
    monkeypatch.setattr(lynx._C, "quantize_weights",
                        lambda ws, inputs, stream, copies: (made.append(copies), quantize(ws, inputs, stream, copies)))
    x, topk_ids, topk_weights, w, _ = make(128, 256, 128, 4, 2)
    layer_ws = lynx.Workspace(128, 256, 128, 4, 2, config=FP8)
    y0 = lynx.functional.forward(layer_ws, x, topk_ids, topk_weights, *w)
    assert torch.equal(lynx.functional.forward(layer_ws, x, topk_ids, topk_weights, *w), y0)
    assert len(made) == 1  # the second call, weights unchanged, kept the copies
    with torch.no_grad():
        w[2].mul_(2)  # an optimizer step, in place: same tensor, new version
    y1 = lynx.functional.forward(layer_ws, x, topk_ids, topk_weights, *w)
    assert len(made) == 2
    fresh = lynx.Workspace(128, 256, 128, 4, 2, config=FP8)
    assert torch.equal(y1, lynx.functional.forward(fresh, x, topk_ids, topk_weights, *w))
    assert not torch.equal(y0, y1)


def test_fp8_layers_sharing_a_workspace_quantise_what_each_pass_reads(monkeypatch):
    """Two FP8 layers of one shape through lynx.moe share a workspace: each forward makes the forward's
    copies of its weights, each backward the backward's, nothing more, and every gradient has the bits
    of the layer run alone."""
    T, H, I, E, k = 128, 256, 128, 4, 2
    x, ids, tw, wa, _ = make(T, H, I, E, k)
    _, _, _, wb, _ = make(T, H, I, E, k)
    dy = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def forward(w, tag):
        leaves = [x.detach().clone().requires_grad_(), *(t.detach().clone().requires_grad_() for t in w)]
        return lynx.moe(leaves[0], ids, tw, *leaves[1:], config=FP8, workspace_tag=tag), leaves

    want = []
    for w, d in zip((wa, wb), dy):  # each layer alone (a tag of its own: a workspace of its own)
        y, leaves = forward(w, 12 + len(want))
        want.append(torch.autograd.grad(y, leaves, d))
    made = []
    quantize = lynx._C.quantize_weights
    monkeypatch.setattr(lynx._C, "quantize_weights",
                        lambda ws, inputs, stream, copies: (made.append(copies), quantize(ws, inputs, stream, copies)))
    ya, la = forward(wa, 11)
    yb, lb = forward(wb, 11)
    got_b = torch.autograd.grad(yb, lb, dy[1])
    got_a = torch.autograd.grad(ya, la, dy[0])
    lynx.check()
    assert made == [lynx.ops.FORWARD_COPIES] * 2 + [lynx.ops.BACKWARD_COPIES] * 2
    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), got_a, want[0]):
        assert torch.isfinite(g).all() and torch.equal(g, r), f"layer a: {name}"
    for name, g, r in zip(("dx", "dw_gate", "dw_up", "dw_down"), got_b, want[1]):
        assert torch.isfinite(g).all() and torch.equal(g, r), f"layer b: {name}"


def test_fp8_training_makes_both_copies_from_one_read(monkeypatch):
    """A layer trained in FP8: from the second step on, each forward makes its weights' forward and
    backward copies at once (lynx::Fp8Copies::kBoth) and its backward none; losses and gradients have the
    bits of the same training with each pass's copies made apart."""
    quantize = lynx._C.quantize_weights
    # As in a process that has captured no FP8 call in a CUDA graph (other tests here have: then every
    # call quantises what its pass reads, ops._fp8_weights says why).
    monkeypatch.setattr(lynx.ops, "_FP8_CAPTURED", False)

    def train(apart):
        made = []

        def spy(ws, inputs, stream, copies):
            made.append(copies)
            if apart and copies == lynx.ops.BOTH_COPIES:
                quantize(ws, inputs, stream, lynx.ops.FORWARD_COPIES)
                quantize(ws, inputs, stream, lynx.ops.BACKWARD_COPIES)
            else:
                quantize(ws, inputs, stream, copies)

        monkeypatch.setattr(lynx._C, "quantize_weights", spy)
        torch.manual_seed(5)
        layer = lynx.nn.MoE(256, 256, 8, 2, precision="fp8_block", device="cuda")
        opt = torch.optim.SGD(layer.parameters(), lr=1e-1)
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        losses, grads = [], []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = layer(x).float().square().mean()
            loss.backward()
            grads.append([layer.get_parameter(n).grad.clone() for n in ("w1", "w2", "w3")])
            opt.step()
            losses.append(loss.item())
        lynx.check()
        return made, losses, grads

    made, losses, grads = train(apart=False)
    made_apart, losses_apart, grads_apart = train(apart=True)
    ops = lynx.ops
    assert made == [ops.FORWARD_COPIES, ops.BACKWARD_COPIES, ops.BOTH_COPIES, ops.BOTH_COPIES]
    assert made_apart == made
    assert losses == losses_apart and losses[-1] != losses[0]
    for step, (g, r) in enumerate(zip(grads, grads_apart)):
        for name, a, b in zip(("w1", "w2", "w3"), g, r):
            assert torch.isfinite(a).all() and torch.equal(a, b), f"step {step}: {name}"


def test_fp8_layer_keeps_one_set_of_weight_copies_across_token_counts():
    """An FP8 layer called at several token counts has a workspace for each, all reading one set of E4M3
    weight copies (6·E·I·H bytes, held by the first), with the bits of a layer that runs each count alone."""
    H, I, E = 1024, 512, 16
    layer = lynx.nn.MoE(H, I, E, 2, precision="fp8_block", device="cuda")
    x = torch.randn(160, H, device="cuda", dtype=torch.bfloat16)
    counts = (64, 96, 160, 64)
    got = [layer(x[:T]) for T in counts]
    wss = [ws for spec, ws in lynx._workspaces._BY_SPEC.items() if spec[6].tag == layer.workspace_tag]
    assert len(wss) == 3
    assert len({id(lynx._workspaces.fp8_state(ws)) for ws in wss}) == 1
    copies = 6 * E * I * H
    assert sorted(ws.device_bytes() >= copies for ws in wss) == [False, False, True]
    for T, y in zip(counts, got):
        alone = copy.deepcopy(layer)  # a tag, and so workspaces and copies, of its own
        assert torch.equal(y, alone(x[:T])), T


def test_fp8_module_trains_and_bad_precision_is_named():
    layer = lynx.nn.MoE(256, 128, 8, 2, precision="fp8_block", device="cuda")
    assert layer.config.precision == "fp8_block"
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    losses = []
    for _ in range(3):  # each step changes the weights in place: the next forward requantises them
        opt.zero_grad(set_to_none=True)
        loss = layer(x).float().square().mean()
        loss.backward()
        for name in ("w1", "w2", "w3", "router.weight"):
            g = layer.get_parameter(name).grad
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    lynx.check()
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="config.precision"):
        lynx.Config(precision="fp8")
    with pytest.raises(ValueError, match="config.precision"):
        lynx.nn.MoE(256, 128, 8, 2, precision="fp8", device="cuda")
    with pytest.raises(ValueError, match="config.bf16_weight_grads"):
        lynx.Config(bf16_weight_grads=True)
