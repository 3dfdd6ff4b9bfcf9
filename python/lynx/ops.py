"""torch.library custom ops over the C++ API, with fake (meta) kernels for torch.compile:
lynx::moe_forward_saving and lynx::moe_backward_from (the autograd pair: forward returns its context as
a tensor that autograd saves, backward reads it), lynx::moe_forward_keeping_none (the pair's forward when
no gradient is wanted), and lynx::moe_forward, lynx::moe_backward and lynx::moe_recompute_forward_context
(the context kept in the workspace; the explicit API and save_forward_context=False).

Each op finds its workspace from the shape and the trailing plain arguments (backend code, schedule
capacity, save_forward_context, workspace tag, expert-parallel group id, precision code), so that a
traced graph holds no Python objects. In FP8 (precision codes 1 and 2) each op first makes the FP8 copies of
the expert weights that its pass reads (the forward's or the backward's) again when they are not of
these weights as they are now (_fp8_weights)."""

from typing import Optional

import weakref

import torch
from torch import Tensor

from lynx import _C, _groups, _views, _workspaces


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def check_ranks(x, topk_ids, w_gate, ws_gate=None):
    """A ValueError naming the first of x, topk_ids, w_gate, ws_gate (None: absent) of the wrong rank."""
    for t, name, rank, dims in ((x, "x", 2, "[T, H]"), (topk_ids, "topk_ids", 2, "[T, k]"),
                                (w_gate, "w_gate", 3, "[E, I, H]"), (ws_gate, "ws_gate", 2, "[I_s, H]")):
        if t is not None and t.dim() != rank:
            raise ValueError(f"lynx: {name}: must be {dims}, got {list(t.shape)}")


def _shape(x, topk_ids, w_gate, ws_gate, ranks=1):
    """(T, H, I, E, k, I_s) of a call; E counts the experts of every rank (w_gate holds this rank's)."""
    check_ranks(x, topk_ids, w_gate, ws_gate)
    T, H = x.shape
    E_local, I, _ = w_gate.shape
    return T, H, I, E_local * ranks, topk_ids.shape[1], 0 if ws_gate is None else ws_gate.shape[0]


def _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group, dy=None, grads=None):
    """lynx::validate_inputs (and validate_gradients with dy): the call's arguments checked before its
    workspace is looked up or made and before anything is queued (the FP8 weights' quantisation among
    them), each error naming its argument."""
    R, _ = _groups.ranks(ep_group)
    shape = _shape(x, topk_ids, w_gate, ws_gate, R)
    _C.validate_inputs(*shape, R, inputs)
    if dy is not None:
        _C.validate_gradients(*shape, R, dy, grads)


def _workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, save_forward_context, tag, ep_group,
               precision):
    # NOTES: looked up (and created on first use) when the op runs, not when it is traced, so that
    # torch.compile sees only plain arguments. In an expert-parallel group these ops run only without a
    # saved context (moe_autograd), which nothing keeps from call to call: the group's layers share the
    # workspace of their shape and stream, as _context_workspace says.
    if ep_group != 0:
        tag = _workspaces.ep_shared_tag(_stream(x))
    config = _workspaces.WorkspaceConfig(backend, schedule_capacity, save_forward_context, tag, False, ep_group,
                                         precision)
    R, _ = _groups.ranks(ep_group)
    return _workspaces.workspace_for(*_shape(x, topk_ids, w_gate, ws_gate, R), config, x.device)


def _context_workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, tag, ep_group, precision):
    """The workspace of the autograd pair: it keeps no context (Config::caller_context). NOTES: in an
    expert-parallel group it holds nothing of a layer between calls (its scratch is lent, its context
    the caller's) but, in FP8, the E4M3 copies of the weights it was last given, and the group's
    exchange buffers (the shared region, sized by the schedule capacity: rows of every rank, 553 MiB a
    rank at qwen3-30b-a3b shapes, T = 8192, R = 8 and a capacity for a load of 2): the group's layers
    of a shape whose calls run on one stream share one, whatever their tags, and in FP8 each call
    whose weights are not the copies' quantises again
    the copies its pass reads (_fp8_weights: a layer's forward the forward's, its backward the
    backward's, when other layers ran between). That
    is safe because passes on one stream run one after another, each ended by its barrier before the
    next begins; layers on different streams (which may overlap) get different workspaces."""
    if ep_group != 0:
        tag = _workspaces.ep_shared_tag(_stream(x))
    config = _workspaces.WorkspaceConfig(backend, schedule_capacity, True, tag, True, ep_group, precision)
    R, _ = _groups.ranks(ep_group)
    return _workspaces.workspace_for(*_shape(x, topk_ids, w_gate, ws_gate, R), config, x.device)


# The error for e4m3 weights on a workspace that set_quantized_weights did not give them (functional.moe
# raises it before making one).
E4M3_WEIGHTS_NEED_A_WORKSPACE = ("lynx: w_gate, w_up, w_down: e4m3 weights go to an explicit lynx.Workspace that "
                                 "lynx.functional.set_quantized_weights gave them (lynx.moe without workspace= and "
                                 "lynx.nn.MoE take bf16 weights)")
# Whether an FP8 call has been captured in a CUDA graph in this process: see _fp8_weights.
_FP8_CAPTURED = False
# lynx::Fp8Copies: the weights' E4M3 copies a pass reads, the forward's or the backward's (transposed),
# or both.
BOTH_COPIES, FORWARD_COPIES, BACKWARD_COPIES = 0, 1, 2


class _Owner:
    """A weak reference to the tensor that owns a weight's memory, equal to another to the same tensor
    while it lives."""

    def __init__(self, t):
        self.ref = weakref.ref(t)

    def __eq__(self, other):
        return isinstance(other, _Owner) and self.ref() is not None and self.ref() is other.ref()


def _weight_key(t):
    """What the E4M3 copies of weight t are compared by: the tensor that owns its memory (t, or the one t
    is a view of: lynx.hf gives gate and up as fresh views of gate_up_proj at each call), its address and
    strides, and its version counter (a view shares its base's)."""
    return (_Owner(t if t._base is None else t._base), t.data_ptr(), tuple(t.stride()), t._version)


def _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, stream, copies):
    """FP8: makes the workspace's E4M3 copies of the expert weights that a pass reads (`copies`: the
    forward's or the backward's; lynx::quantize_weights) unless they are of these very tensors, at the
    same addresses, unchanged since (weak references to them or to the tensors they view, data pointers,
    strides and version counters, as the
    context's inputs are compared in functional.Workspace): layers sharing a workspace quantise in each
    pass only what it reads. NOTES: always inside a CUDA graph capture (a replay must requantise what
    the optimizer has changed in place since, which no host check sees), and on every call once an FP8
    call has been captured in this process (a graph's replays, an optimizer step among them, change
    weights without bumping their version counters, and may run the kernels that overwrite the copies);
    always for inference tensors, which keep no version counter. A change no counter records (through
    `.data`, or an optimizer writing through raw pointers) is not seen: functional.fp8_weights_changed()
    forces new copies."""
    global _FP8_CAPTURED
    if precision == _workspaces._PRECISIONS["bf16"]:
        return
    now = (w_gate, w_up, w_down)
    state = _workspaces.fp8_state(ws)
    if w_gate.dtype == torch.float8_e4m3fn:  # given by functional.set_quantized_weights: never quantised here
        if not state.prequantized:
            raise ValueError(E4M3_WEIGHTS_NEED_A_WORKSPACE)
        given = state.given  # the six tensors given (values, scales): weak refs, versions (None: inference)
        if not (all(ref() is t for (ref, _), t in zip(given, now)) and
                all(ref() is not None and (v is None or ref()._version == v) for ref, v in given)):
            raise ValueError("lynx: w_gate, w_up, w_down: e4m3 weights that are not those given to "
                             "set_quantized_weights, unchanged since: call it again with them")
        return
    if torch.cuda.is_current_stream_capturing():
        _FP8_CAPTURED = True
    untracked = _FP8_CAPTURED or any(t.is_inference() for t in now)
    kept = state.weights or {}  # copies -> the weights they were made from
    made = kept.get(copies)
    same = not untracked and made is not None and all(_weight_key(t) == k for k, t in zip(made, now))
    if not same:
        # NOTES: a forward whose workspace's backward copies are of the weights at these addresses (as they
        # were before an optimizer step) makes both: its backward will read these weights' too, and both
        # copies from one read of the weights cost a third less than each pass reading them
        # (lynx::Fp8Copies::kBoth). Where that guess is wrong, the backward still checks its own.
        theirs = kept.get(BACKWARD_COPIES)
        both = (copies == FORWARD_COPIES and not untracked and theirs is not None and
                all(k[1:3] == _weight_key(t)[1:3] for k, t in zip(theirs, now)))
        _C.quantize_weights(ws, inputs, stream, BOTH_COPIES if both else copies)
        state.prequantized = False  # the copies are (or are becoming) of bf16 weights
        key = tuple(_weight_key(t) for t in now)
        state.weights = None if untracked else {**kept, copies: key, **({BACKWARD_COPIES: key} if both else {})}


def _context_bytes(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, ep_group) -> int:
    R, _ = _groups.ranks(ep_group)
    return _C.forward_context_bytes(*_shape(x, topk_ids, w_gate, ws_gate, R), backend, schedule_capacity, R)


# The weight-gradient groups a backward computes (its `weight_grads` argument, a bit each): the routed
# experts' three and the shared expert's three. A group left out is not computed (lynx::Gradients: frozen
# experts) and comes back as [0] tensors.
EXPERT_WEIGHT_GRADS, SHARED_WEIGHT_GRADS = 1, 2
ALL_WEIGHT_GRADS = EXPERT_WEIGHT_GRADS | SHARED_WEIGHT_GRADS
# With EXPERT_WEIGHT_GRADS: the gate and up gradients as one [E, 2I, H] tensor, gate first, in dw_gate's
# place (dw_up then [0]), written by lynx as its two halves: the gradient of a concatenated gate_up
# weight without a copy (lynx.hf).
JOINED_GATE_UP = 4


def weight_grads_needed(needs_input_grad) -> int:
    """The groups a backward must compute, from autograd's needs_input_grad of (x, topk_ids, topk_weights,
    w_gate, w_up, w_down, ws_gate, ws_up, ws_down, ...)."""
    return ((EXPERT_WEIGHT_GRADS if any(needs_input_grad[3:6]) else 0) |
            (SHARED_WEIGHT_GRADS if any(needs_input_grad[6:9]) else 0))


def _computed(shared, weight_grads):
    """Which of (dx, d_topk_weights, dw_gate, dw_up, dw_down, dws_gate, dws_up, dws_down) a backward
    computes (`shared`: the layer has a shared expert)."""
    experts = bool(weight_grads & EXPERT_WEIGHT_GRADS)
    shared = shared and bool(weight_grads & SHARED_WEIGHT_GRADS)
    return (True, True) + (experts,) * 3 + (shared,) * 3


def _gradient_buffers(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, weight_grads):
    """Empty gradients ([0] for those not computed) and their views for the binding (None for those)."""
    grads = _empty_gradients(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, weight_grads)
    names = ("dx", "d_topk_weights", "dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up", "dws_down")
    computed = _computed(ws_gate is not None, weight_grads)
    targets = list(grads)
    if computed[2] and weight_grads & JOINED_GATE_UP:
        I = w_gate.shape[1]
        targets[2:4] = grads[2][:, :I], grads[2][:, I:]
    return grads, tuple(_views.view(g, n) if c else None for g, n, c in zip(targets, names, computed))


def _forward(ws, inputs, x, w_gate, w_up, w_down, precision):
    """y of lynx::forward on workspace ws, its FP8 forward copies made first where needed (_fp8_weights)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, _stream(x), FORWARD_COPIES)
    _C.forward(ws, inputs, _views.view(y, "y"), _stream(x))
    _workspaces.check_if_temporary(ws, _stream(x))
    return y


@torch.library.custom_op("lynx::moe_forward_saving", mutates_args=())
def moe_forward_saving(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                       w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                       backend: int, schedule_capacity: int, tag: int, ep_group: int,
                       precision: int) -> tuple[Tensor, Tensor]:
    """y, and the forward context backward needs (uint8 [forward_context_bytes]): a tensor like any
    other that autograd saves, so that any number of forwards may be in flight before their backwards,
    under checkpointing or saved-tensor hooks too."""
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group)
    with torch.cuda.device(x.device):
        ws = _context_workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, tag, ep_group, precision)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        context = torch.empty(_context_bytes(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, ep_group),
                              dtype=torch.uint8, device=x.device)
        _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, _stream(x), FORWARD_COPIES)
        _C.forward_into(ws, inputs, _views.view(y, "y"), context.data_ptr(), context.numel(), _stream(x))
        _workspaces.check_if_temporary(ws, _stream(x))
    return y, context


@moe_forward_saving.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend, schedule_capacity, tag,
      ep_group, precision):
    dims = (*x.shape, *w_gate.shape, topk_ids.shape[1], 0 if ws_gate is None else ws_gate.shape[0])
    if all(isinstance(d, int) for d in dims):
        context_bytes = _context_bytes(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, ep_group)
    else:  # symbolic shapes (torch.compile's dynamic shapes): a size the op's output will tell
        context_bytes = torch.library.get_ctx().new_dynamic_size()
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(context_bytes, dtype=torch.uint8, device=x.device))


@torch.library.custom_op("lynx::moe_forward_keeping_none", mutates_args=())
def moe_forward_keeping_none(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                             w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                             ws_down: Optional[Tensor], backend: int, schedule_capacity: int, tag: int, ep_group: int,
                             precision: int) -> Tensor:
    """y of a forward no backward follows (no gradient wanted: moe_autograd), on the autograd pair's
    workspace (in FP8, its weight copies): it keeps no context and is lent only what it uses of one (the
    schedule, not the gate and up products, which it does not write: 0.57 MiB instead of 192.6 at
    qwen3-30b-a3b, one rank; lynx::forward on a caller_context workspace)."""
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group)
    with torch.cuda.device(x.device):
        ws = _context_workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, tag, ep_group, precision)
        return _forward(ws, inputs, x, w_gate, w_up, w_down, precision)


@moe_forward_keeping_none.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend, schedule_capacity, tag,
      ep_group, precision):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("lynx::moe_backward_from", mutates_args=())
def moe_backward_from(dy: Tensor, context: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                      w_gate: Tensor, w_up: Tensor, w_down: Tensor, ws_gate: Optional[Tensor],
                      ws_up: Optional[Tensor], ws_down: Optional[Tensor], backend: int, schedule_capacity: int,
                      tag: int, ep_group: int, precision: int,
                      weight_grads: int = ALL_WEIGHT_GRADS) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                     Tensor, Tensor]:
    # A saved-tensor hook may have handed the context back elsewhere or in another form.
    if context.device != x.device or context.dtype != torch.uint8 or not context.is_contiguous():
        raise ValueError(f"lynx: the saved forward context came back as a {context.dtype} tensor on {context.device}"
                         f"{'' if context.is_contiguous() else ', not contiguous'}; backward needs it as saved: uint8, "
                         f"contiguous, on {x.device}")
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    dy_view = _views.on_device_of_x(_views.aligned(dy), "dy", x)
    with torch.cuda.device(x.device):
        grads, views = _gradient_buffers(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                         weight_grads)
        _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group, dy_view, views)
        ws = _context_workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, tag, ep_group, precision)
        # The FP8 dgrads read the weights' transposed copies: another layer's backward may have made its own.
        _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, _stream(x), BACKWARD_COPIES)
        _C.backward_from(ws, inputs, dy_view, views, context.data_ptr(), context.numel(), _stream(x))
        _workspaces.check_if_temporary(ws, _stream(x))
    return grads


@moe_backward_from.register_fake
def _(dy, context, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend,
      schedule_capacity, tag, ep_group, precision, weight_grads=ALL_WEIGHT_GRADS):
    return _empty_gradients(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, weight_grads)


def _empty_gradients(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, weight_grads):
    """Empty gradients, as the ops return them ([0] for those not computed: a shared expert's without one,
    a group left out; the experts' bf16, also for e4m3 weights)."""
    computed = _computed(ws_gate is not None, weight_grads)

    def empty(i, like, dtype):
        return torch.empty(like.shape, dtype=dtype, device=like.device) if computed[i] else x.new_empty(0)

    experts = tuple(empty(i, w, torch.bfloat16) for i, w in enumerate((w_gate, w_up, w_down), 2))
    if computed[2] and weight_grads & JOINED_GATE_UP:
        E, I, H = w_gate.shape
        experts = (torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device=x.device), x.new_empty(0), experts[2])
    return (torch.empty_like(x), torch.empty(topk_weights.shape, dtype=torch.float32, device=x.device), *experts,
            *(empty(i, w, None if w is None else w.dtype) for i, w in enumerate((ws_gate, ws_up, ws_down), 5)))


@torch.library.custom_op("lynx::moe_forward", mutates_args=())
def moe_forward(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor], backend: int,
                schedule_capacity: int, save_forward_context: bool, tag: int, ep_group: int, precision: int) -> Tensor:
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group)
    with torch.cuda.device(x.device):
        ws = _workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, save_forward_context, tag,
                        ep_group, precision)
        return _forward(ws, inputs, x, w_gate, w_up, w_down, precision)


@moe_forward.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend, schedule_capacity,
      save_forward_context, tag, ep_group, precision):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("lynx::moe_backward", mutates_args=())
def moe_backward(dy: Tensor, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                 backend: int, schedule_capacity: int, save_forward_context: bool,
                 tag: int, ep_group: int, precision: int,
                 weight_grads: int = ALL_WEIGHT_GRADS) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                Tensor]:
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    dy_view = _views.on_device_of_x(_views.aligned(dy), "dy", x)
    with torch.cuda.device(x.device):
        grads, views = _gradient_buffers(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                         weight_grads)
        _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group, dy_view, views)
        ws = _workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, save_forward_context, tag,
                        ep_group, precision)
        stream = _stream(x)
        # Another call may have replaced the workspace's forward context (or it was never kept).
        if not ws.has_context_for(inputs):
            _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, stream, FORWARD_COPIES)
            _C.recompute_forward_context(ws, inputs, stream)
        _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, stream, BACKWARD_COPIES)  # as in moe_backward_from
        _C.backward(ws, inputs, dy_view, views, stream)
        _workspaces.check_if_temporary(ws, stream)
    return grads


@torch.library.custom_op("lynx::moe_recompute_forward_context", mutates_args=())
def moe_recompute_forward_context(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                                  w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor],
                                  ws_down: Optional[Tensor], backend: int, schedule_capacity: int,
                                  save_forward_context: bool, tag: int, ep_group: int, precision: int) -> Tensor:
    """Rebuilds in the workspace what backward needs, without producing y; returns the rows each
    local expert received (int32 [E / R]). NOTES: the workspace is state that torch.library cannot name, so
    the per-expert counts are the op's output; an unused call may be dropped by a compiler, which is
    safe because moe_backward recomputes whatever context it lacks."""
    inputs = _views.inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    _validate(inputs, x, topk_ids, w_gate, ws_gate, ep_group)
    with torch.cuda.device(x.device):
        ws = _workspace(x, topk_ids, w_gate, ws_gate, backend, schedule_capacity, save_forward_context, tag,
                        ep_group, precision)
        _fp8_weights(ws, precision, inputs, w_gate, w_up, w_down, _stream(x), FORWARD_COPIES)
        _C.recompute_forward_context(ws, inputs, _stream(x))
        _workspaces.check_if_temporary(ws, _stream(x))
        return _views.schedule_tensors(ws, x.device)["expert_rows"].clone()


@moe_recompute_forward_context.register_fake
def _(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend, schedule_capacity,
      save_forward_context, tag, ep_group, precision):
    return torch.empty(w_gate.shape[0], dtype=torch.int32, device=x.device)


@moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend, schedule_capacity,
      save_forward_context, tag, ep_group, precision, weight_grads=ALL_WEIGHT_GRADS):
    return _empty_gradients(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, weight_grads)


def _autograd_gradients(grads, shared, wanted):
    """The gradients of (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down) for
    autograd: None for topk_ids and for those not computed."""
    dx, dtk, *weights = (g if c else None for g, c in zip(grads, _computed(shared, wanted)))
    return (dx, None, dtk, *weights)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.config = inputs[9:]


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down = ctx.saved_tensors
    dy = dy.to(torch.bfloat16).contiguous()
    wanted = weight_grads_needed(ctx.needs_input_grad)
    grads = moe_backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *ctx.config,
                         wanted)
    return (*_autograd_gradients(grads, ws_gate is not None, wanted), None, None, None, None, None, None)


torch.library.register_autograd("lynx::moe_forward", _backward, setup_context=_setup_context)


def _setup_saving(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9], output[1])
    ctx.config = inputs[9:]


def _backward_saving(ctx, dy, _dcontext):
    x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, context = ctx.saved_tensors
    dy = dy.to(torch.bfloat16).contiguous()
    wanted = weight_grads_needed(ctx.needs_input_grad)
    grads = moe_backward_from(dy, context, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                              *ctx.config, wanted)
    return (*_autograd_gradients(grads, ws_gate is not None, wanted), None, None, None, None, None)


torch.library.register_autograd("lynx::moe_forward_saving", _backward_saving, setup_context=_setup_saving)


def gradient_wanted(*tensors) -> bool:
    """Whether autograd would record a call on `tensors` (None among them ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def moe_autograd(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend,
                 schedule_capacity, save_forward_context, tag, ep_group, precision):
    """y with autograd: with a saved context, the pair that hands autograd the context (at any R: in an
    expert-parallel group each rank's backward is given its own forward's), or its forward that keeps
    none where no gradient is wanted (torch.no_grad, inference_mode, no input requiring one); without
    one, the forward that keeps none in the workspace (its backward recomputes it, on every rank alike)."""
    if save_forward_context and not gradient_wanted(x, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        return moe_forward_keeping_none(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                                        backend, schedule_capacity, tag, ep_group, precision)
    if save_forward_context:
        y, _ = moe_forward_saving(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend,
                                  schedule_capacity, tag, ep_group, precision)
        return y
    return moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, backend,
                       schedule_capacity, save_forward_context, tag, ep_group, precision)
