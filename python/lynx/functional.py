"""The functional API.

- `moe(...)`: the whole layer with autograd, usable under torch.compile and in CUDA graphs (the
  default fused backend has no host synchronisation); workspaces are created and cached for you.
- The C++ API's calls, for code that drives forward and backward itself: `Workspace`, `forward`,
  `backward`, `recompute_forward_context`, `Workspace.schedule()`. They run the same custom ops.
"""

import dataclasses
import weakref
from typing import NamedTuple, Optional

import torch

from lynx import _C, _groups, _views, _workspaces, ops

try:
    from torch.fx.experimental.symbolic_shapes import guard_or_false as _guard_or_false
except ImportError:  # torch before 2.8
    from torch.fx.experimental.symbolic_shapes import guard_size_oblivious as _guard_or_false


def check_token_multiple(value, name: str) -> None:
    """Config.token_multiple's (and lynx.hf.token_multiple's) check: an int >= 1."""
    if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Mirror of lynx::Config (include/lynx/config.h); 0 means "choose for me"."""

    backend: str = "auto"  # "auto" (= "fused"), "fused" or "unfused"
    schedule_capacity: int = 0
    save_forward_context: bool = True
    # With an ep_group: how long a rank waits for the others at a cross-rank barrier before it reports
    # the rank that did not come and stops (its kernel traps; the CUDA context is lost); 0: 30 s.
    # Raise it where one rank may fall behind (a checkpoint or an evaluation on one rank).
    peer_timeout_ms: int = 0
    # "bf16", or "fp8_block": the routed experts' forward GEMMs on E4M3 operands with block scales (the
    # DeepSeek-V3 recipe, docs/fp8.md); the expert weights' FP8 copies are made again whenever they
    # change (their version counters); the backward's GEMMs are FP8 too. The fused backend, with or
    # without an ep_group.
    precision: str = "bf16"
    # fp8_block: the experts' weight gradients in bf16 (the recipe's option) instead of FP8.
    bf16_weight_grads: bool = False
    # Python only (lynx.moe, lynx.nn.MoE): each call's tokens padded to a multiple of this (zero rows,
    # not routed; the call gets back its own rows), so that calls at varying token counts share a few
    # workspaces instead of making one per count (docs/python.md); 1: none. Not with ep_tokens.
    token_multiple: int = 1

    def __post_init__(self):
        if self.backend not in _workspaces._BACKENDS:
            raise ValueError(f"lynx: config.backend: must be one of {sorted(_workspaces._BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.precision not in _workspaces._PRECISIONS:
            raise ValueError(f"lynx: config.precision: must be one of {sorted(_workspaces._PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.bf16_weight_grads and self.precision != "fp8_block":
            raise ValueError("lynx: config.bf16_weight_grads: only with precision=\"fp8_block\"")
        check_token_multiple(self.token_multiple, "lynx: config.token_multiple")
        if not 0 <= self.peer_timeout_ms <= 3_600_000:  # lynx::resolve_config's bound
            raise ValueError(f"lynx: config.peer_timeout_ms: must be in [0, 3600000] (0: 30 s), got "
                             f"{self.peer_timeout_ms}")


class Gradients(NamedTuple):
    """What `backward` returns (lynx::Gradients); the shared expert's are None without one."""

    dx: torch.Tensor
    d_topk_weights: torch.Tensor
    dw_gate: torch.Tensor
    dw_up: torch.Tensor
    dw_down: torch.Tensor
    dws_gate: Optional[torch.Tensor]
    dws_up: Optional[torch.Tensor]
    dws_down: Optional[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A copy of lynx::Schedule (include/lynx/moe.h): the routed rows in the order lynx computes them.
    int32 CUDA tensors; `capacity` rows, experts padded to 128-row blocks. Only the rows before
    expert_offset[-1] are written; after a schedule over capacity (an error, lynx.check) only
    expert_offset and expert_rows describe it."""

    row_token_slot: torch.Tensor  # [capacity] token * k + j of each row, -1 for padding
    row_src_rank: torch.Tensor    # [capacity] source rank of each row, -1 for padding
    expert_offset: torch.Tensor   # [E / R + 1] first row of each of this rank's experts (padded)
    expert_rows: torch.Tensor     # [E / R] rows each of this rank's experts received (unpadded)
    slot_row: torch.Tensor        # [T * k] row of (t, j)


class Workspace:
    """lynx::Workspace: every buffer of one layer shape on one device, and the forward context it keeps
    for backward. It has its own tag (no other call shares it) and is freed with this object, or by
    close(); freeing waits for the device."""

    def __init__(self, tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 shared_intermediate: int = 0, config: Config = Config(), device=None):
        self.shape = (tokens, hidden, intermediate, num_experts, top_k, shared_intermediate)
        self.config = config
        self.tag = _workspaces.new_tag()
        self.device = _cuda_device(device)
        # The key the custom ops look it up by (ops._workspace): this workspace keeps its own context.
        backend, capacity, save, tag, ep, precision = self._op_config()
        config = _workspaces.WorkspaceConfig(backend, capacity, save, tag, False, ep, precision)
        self._ws = _workspaces.workspace_for(*self.shape, config, self.device)
        self._context = None  # what the kept context was built from: [(weakref, version)], or None
        self._closed = False
        weakref.finalize(self, _workspaces.release, self.tag)

    def close(self):
        """Frees the workspace now (after the device has finished with it)."""
        self._closed = True
        self._ws = None
        _workspaces.release(self.tag)

    def _op_config(self):
        """The trailing arguments of the custom ops that select this workspace."""
        return _op_config(self.config, self.tag)

    def _impl(self):
        # NOTES: a plain flag, not the finalizer's state: torch.compile guards on what it reads here.
        if self._closed:
            raise ValueError("lynx: workspace: used after close()")
        return self._ws

    @property
    def device_bytes(self) -> int:
        return self._impl().device_bytes()

    @property
    def scratch_bytes(self) -> int:
        """Device memory each call takes from PyTorch's caching allocator and gives back."""
        return self._impl().scratch_bytes()

    @property
    def context_bytes(self) -> int:
        return self._impl().context_bytes()

    def schedule(self) -> Schedule:
        """The schedule of the last forward or recompute on this workspace, copied on the current stream:
        call it on the stream that ran that call (or after synchronising with it)."""
        arrays = _views.schedule_tensors(self._impl(), self.device)
        return Schedule(**{name: t.clone() for name, t in arrays.items()})

    def check(self):
        """Workspace::check on the current stream of its device: raises lynx.LynxError for an error a kernel
        reported."""
        _check_on_its_device(self._impl(), self.device)

    def _args(self, x, topk_ids, w_gate, ws_gate, tensors):
        self._impl()
        ops.check_ranks(x, topk_ids, w_gate, ws_gate)
        T, H = x.shape
        got = (T, H, w_gate.shape[1], w_gate.shape[0], topk_ids.shape[1], 0 if ws_gate is None else ws_gate.shape[0])
        if got != self.shape:
            raise ValueError(f"lynx: x, topk_ids, w_gate, ws_gate: the shape (T, H, I, E, k, I_s) = {got} is not the "
                             f"workspace's {self.shape}")
        for t in tensors:
            if t is not None and isinstance(t, torch.Tensor) and t.device != self.device:
                raise ValueError(f"lynx: x, topk_ids, topk_weights, weights: on {t.device}, the workspace is on "
                                 f"{self.device}")
        return self._op_config()

    @staticmethod
    def _context_of(tensors):
        """Weak references and version counters of the inputs; None (backward will recompute) when an
        input was made under torch.inference_mode, which keeps no version counter."""
        present = [t for t in tensors if t is not None]
        if any(t.is_inference() for t in present):
            return None
        return [(weakref.ref(t), t._version) for t in present]

    def _has_context(self, tensors) -> bool:
        """Whether the kept context was built from these very tensor objects, unchanged since. NOTES: the
        C++ side can only compare pointers, which PyTorch's allocator reuses; weak references and version
        counters catch a freed-and-reallocated or an in-place-modified input. A new view of the same
        data (x.view(...)) is another object and costs a recompute; a change through `.data` bumps no
        version and is not seen."""
        now = [t for t in tensors if t is not None]
        if self._context is None or len(now) != len(self._context):
            return False
        return all(ref() is t and t._version == v for (ref, v), t in zip(self._context, now))


def _context_inputs(x, topk_ids, topk_weights, w_gate, w_up, ws_gate, ws_up):
    """The inputs a forward context is built from (include/lynx/moe.h, has_context_for)."""
    return (x, topk_ids, topk_weights, w_gate, w_up, ws_gate, ws_up)


def forward(ws: Workspace, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
            ws_down=None) -> torch.Tensor:
    """lynx::forward: y [T, H] bf16; keeps the context for backward when the config says so. For code
    that runs backward itself: pass tensors that do not require grad (`moe` is the autograd entry)."""
    tensors = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    config = ws._args(x, topk_ids, w_gate, ws_gate, tensors)
    y = ops.moe_forward(*tensors, *config)
    ws._context = (Workspace._context_of(_context_inputs(x, topk_ids, topk_weights, w_gate, w_up, ws_gate, ws_up))
                   if ws.config.save_forward_context else None)
    return y


def recompute_forward_context(ws: Workspace, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None,
                              ws_up=None, ws_down=None) -> torch.Tensor:
    """lynx::recompute_forward_context: rebuilds what backward needs without producing y. Returns the
    rows each of this rank's experts received (int32 [E / R]; [E] at one rank)."""
    tensors = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    config = ws._args(x, topk_ids, w_gate, ws_gate, tensors)
    counts = ops.moe_recompute_forward_context(*tensors, *config)
    ws._context = Workspace._context_of(_context_inputs(x, topk_ids, topk_weights, w_gate, w_up, ws_gate, ws_up))
    return counts


def backward(ws: Workspace, dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate=None, ws_up=None,
             ws_down=None) -> Gradients:
    """lynx::backward: every gradient, overwritten (not accumulated). Uses the context of the last
    forward or recompute on `ws` when it was built from these same tensors, unchanged since (same
    objects, same version counters); otherwise it recomputes the context first."""
    tensors = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    config = ws._args(x, topk_ids, w_gate, ws_gate, (dy, *tensors))
    if not ws._has_context(_context_inputs(x, topk_ids, topk_weights, w_gate, w_up, ws_gate, ws_up)):
        recompute_forward_context(ws, *tensors)
    grads = ops.moe_backward(dy, *tensors, *config)
    shared = ws_gate is not None
    return Gradients(*grads[:5], *(g if shared else None for g in grads[5:]))


def set_quantized_weights(ws: Workspace, w_gate, w_up, w_down, w_gate_scales, w_up_scales, w_down_scales):
    """lynx::set_quantized_weights (Config(precision="fp8_block")): the routed experts' weights already in
    FP8, as torch.float8_e4m3fn tensors (w_gate, w_up [E, I, H], w_down [E, H, I]) with fp32 scales per
    128×128 block ([E, I/128↑, H/128↑] for gate and up, [E, H/128↑, I/128↑] for down; value = e4m3 ·
    scale). Then pass these e4m3 tensors as the weights to forward / backward / recompute_forward_context
    on `ws` (the gradients come back in bf16); lynx does not quantise them again, so call this again after
    changing them (a call with other tensors, or with these changed in place since, is refused; for
    inference tensors, which keep no version counter, only other tensors). docs/fp8.md."""
    tensors = (w_gate, w_up, w_down, w_gate_scales, w_up_scales, w_down_scales)
    names = ("w_gate", "w_up", "w_down", "w_gate_scales", "w_up_scales", "w_down_scales")
    impl = ws._impl()
    for t, n in zip(tensors, names):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"lynx: {n}: must be a tensor, got {type(t).__name__}")
    views = tuple(_views.view(t, n) for t, n in zip(tensors, names))
    for t, n in zip(tensors, names):
        if t.device != ws.device:
            raise ValueError(f"lynx: {n}: on {t.device}, but the workspace is on {ws.device}")
    with torch.cuda.device(ws.device):  # whatever the current device
        _C.set_quantized_weights(impl, views, torch.cuda.current_stream(ws.device).cuda_stream)
    # The copies are these: bf16 weights given later are quantised again (ops._fp8_weights), and the e4m3
    # ones are checked to be these, unchanged (scales included).
    state = _workspaces.fp8_state(impl)
    state.weights = None
    state.prequantized = True
    # Inference tensors keep no version counter: for them only the identity is checked.
    state.given = tuple((weakref.ref(t), None if t.is_inference() else t._version) for t in tensors)


def fp8_weights_changed():
    """FP8 (Config(precision="fp8_block")): the next call of every lynx layer makes its weights' FP8
    copies again. lynx sees a change of the weight tensors through their version counters (any in-place
    op, torch's optimizers); call this after changes no counter records: through `.data`, by an
    optimizer that writes through raw pointers, or by replaying a CUDA graph that captured the optimizer's
    step (torch.optim.Adam(capturable=True)) while lynx's calls run eagerly."""
    for ws in _workspaces.all_workspaces():
        _workspaces.fp8_state(ws).weights = None


def check(device=None):
    """Raises lynx.LynxError if a lynx kernel reported an error (an expert id out of range, a non-finite
    router weight, a schedule over capacity), after waiting for the current stream of each device whose
    workspaces it checks (every device's, or `device`'s alone) and for each workspace's last call, on
    whatever stream it was queued. The fused path never synchronises, so such
    errors surface only here (or as a CUDA error at the next sync). Until it is reported, an error stays
    set and every later call on the same workspace leaves y and dx unwritten and its other routed
    gradients unusable (see lynx::Workspace::check): call this once per training step, before the
    optimizer step (it synchronises with each workspace's stream: the first wait is the costly one).
    Every workspace is checked, each one's error reported and cleared, before one LynxError names all that
    had one (each by its shape, T, H, I, E, k, I_s, and tag: lynx.nn.MoE's are negative, a layer's own).
    Not inside a CUDA graph capture (it waits for the device): a RuntimeError."""
    if _workspaces._capturing():
        raise RuntimeError("lynx.check: waits for the device, which a CUDA graph capture cannot hold: call it "
                           "outside the capture (after a replay)")
    only = None if device is None else _cuda_device(device).index
    errors = []
    for what, ws in _workspaces.described_workspaces():
        if only is None or ws._device_index == only:
            try:
                _check_on_its_device(ws, ws._device_index)
            except _C.LynxError as e:
                errors.append(f"{e} ({what})")
    if len(errors) == 1:
        raise _C.LynxError(errors[0])
    if errors:
        raise _C.LynxError(f"lynx: {len(errors)} workspaces reported errors: " + "; ".join(errors))


def _check_on_its_device(impl, device) -> None:
    """Workspace::check of `impl` (a _C.Workspace on `device`) after that device's current stream, with the
    device current. NOTES: the check copies and clears the status on that stream; another device's stream
    would let the status be read before the kernels that write it have run."""
    with torch.cuda.device(device):
        impl.check(torch.cuda.current_stream(device).cuda_stream)


def _cuda_device(device) -> torch.device:
    """`device` (None: the current CUDA device; a string, an index or a torch.device) as a CUDA device with
    its index."""
    d = torch.device("cuda" if device is None else device)
    if d.type != "cuda":
        raise ValueError(f"lynx: device: must be a CUDA device, got {d}")
    return torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)


def padded_tokens(T: int, token_multiple: int = 1, ep_tokens: Optional[int] = None) -> int:
    """The token count a call of T tokens runs at: ep_tokens if given, else T rounded up to a multiple of
    token_multiple, at least one multiple (a call of no tokens runs on one padding row or more: lynx's
    kernels take T >= 1)."""
    if ep_tokens is not None:
        if token_multiple != 1:
            raise ValueError("lynx: ep_tokens: not with config.token_multiple (ep_tokens fixes the count)")
        return ep_tokens
    return max(1, -(-T // token_multiple)) * token_multiple


def no_tokens(T) -> bool:
    """Whether a call has no tokens (an empty batch: pad_for_call then runs it on padding rows). NOTES:
    under torch.compile without adding a guard: a dynamic size is taken to be 2 or more, and one known only
    from the data (x[mask]) is taken to be non-zero (lynx then refuses it if it is)."""
    return _guard_or_false(T == 0)


def pad_tokens(tokens: int, x, topk_ids, topk_weights):
    """(x, topk_ids, topk_weights) padded to `tokens` rows, and the rows there were: zero rows of x,
    topk_ids of -1 (not routed: no expert computes them, their weights are not read), weights of 0."""
    T = x.shape[0]
    if tokens < T:
        raise ValueError(f"lynx: ep_tokens: {tokens} is below this rank's {T} tokens")
    if tokens == T:
        return x, topk_ids, topk_weights, T
    pad = tokens - T
    return (torch.cat([x, x.new_zeros(pad, x.shape[1])]),
            torch.cat([topk_ids, topk_ids.new_full((pad, topk_ids.shape[1]), -1)]),
            torch.cat([topk_weights, topk_weights.new_zeros(pad, topk_weights.shape[1])]), T)


def pad_for_call(x, topk_ids, topk_weights, token_multiple: int = 1, ep_tokens: Optional[int] = None,
                 pad_empty: bool = True):
    """(x, topk_ids, topk_weights, T) for a call of lynx.moe, lynx.nn.MoE or the HF experts: padded
    (pad_tokens) to ep_tokens, or to a multiple of token_multiple, or, where pad_empty, an empty batch to
    one padding row; T the rows the caller gets back (y[:T]), None where nothing was padded. NOTES: the
    default path computes no token count but whether there are none (no_tokens: no guard under
    torch.compile)."""
    if ep_tokens is None and token_multiple == 1 and not (pad_empty and no_tokens(x.shape[0])):
        return x, topk_ids, topk_weights, None
    return pad_tokens(padded_tokens(x.shape[0], token_multiple, ep_tokens), x, topk_ids, topk_weights)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: torch.Tensor, w_down: torch.Tensor, ws_gate: Optional[torch.Tensor] = None,
        ws_up: Optional[torch.Tensor] = None, ws_down: Optional[torch.Tensor] = None,
        config: Config = Config(), workspace_tag: int = 0, workspace: Optional[Workspace] = None,
        ep_group=None, ep_tokens: Optional[int] = None) -> torch.Tensor:
    """y[t] = shared(x[t]) + sum_j topk_weights[t,j] * down_e(silu(gate_e x[t]) * up_e x[t]).

    x [T, H] bf16; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32; w_gate, w_up [E, I, H],
    w_down [E, H, I] bf16 (nn.Linear "out x in" per expert, as TorchTitan); the optional shared
    expert ws_gate, ws_up [I_s, H], ws_down [H, I_s]. Differentiable in x, topk_weights and every
    weight. Arguments are validated before anything runs: a ValueError names the argument (lynx.LynxError, a
    ValueError, for the C++ checks).

    Calls of the same shape share one workspace unless their `workspace_tag`s differ (lynx.nn.MoE gives
    every layer its own tag); each forward's context is a tensor autograd saves for its backward, or with
    config.save_forward_context=False none is kept and the backward recomputes it. With `ep_group` the
    calls of one shape on one CUDA stream share one workspace whatever their tags. A `workspace` given
    explicitly replaces `config` and `workspace_tag`.

    Expert parallelism: with `ep_group`, a torch.distributed process group of R ranks (one process
    each; several may share a GPU), this process is rank r of the group and holds the experts
    r·E/R … (r+1)·E/R − 1: w_gate, w_up [E/R, I, H], w_down [E/R, H, I], while topk_ids name experts
    of all ranks (0 … E − 1). Its tokens travel to their experts' ranks and back inside the fused
    passes. y, dx and d_topk_weights are this rank's tokens'; the experts' weight gradients are summed
    over every rank's tokens (no further reduction); the shared expert's are over this rank's tokens
    (reduce them across ranks as for any replicated parameter). All bitwise those of one rank holding
    every token (rank-major) and every expert. Every rank of the group must make the same sequence of
    lynx calls with the same shapes; see docs/python.md. Ranks whose token counts differ pass the
    group's largest as `ep_tokens`: a rank with fewer pads its tokens to it (zero rows, not routed) and
    gets back only its own rows, with the bits of one rank holding every rank's real tokens.

    config.token_multiple > 1 pads a call's tokens likewise, to a multiple of it, so that calls at varying
    token counts share a few workspaces (docs/python.md). Without ep_group and workspace, a call of no
    tokens (T = 0) gives y [0, H] and zero weight gradients, from a call of one padding row (token_multiple
    rows); with ep_group, ranks whose counts differ (none among them) pass ep_tokens."""
    ops.check_ranks(x, topk_ids, w_gate, ws_gate)
    # NOTES: checked here, not only by the C++ checks, because those come after padding (which would show
    # the padded counts) or after the workspace is made. Under torch.compile with sizes known only from the
    # data no guard is added (_guard_or_false): the C++ checks still see them.
    if _guard_or_false(topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"lynx: topk_ids: shape must be [{x.shape[0]}, k] (a row for each of x's tokens), got "
                         f"{list(topk_ids.shape)}")
    if isinstance(topk_weights, torch.Tensor) and (topk_weights.dim() != 2 or  # topk_ids is [T, k]
                                                   _guard_or_false(topk_weights.shape[0] != topk_ids.shape[0]) or
                                                   _guard_or_false(topk_weights.shape[1] != topk_ids.shape[1])):
        raise ValueError(f"lynx: topk_weights: shape must be {list(topk_ids.shape)}, got {list(topk_weights.shape)} "
                         "(topk_ids')")
    dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
    if len(set(dtypes)) != 1:
        raise ValueError(f"lynx: w_gate, w_up, w_down: must have one dtype, got {', '.join(map(str, dtypes))}")
    if w_gate.dtype == torch.float8_e4m3fn and workspace is None:
        raise ValueError(ops.E4M3_WEIGHTS_NEED_A_WORKSPACE)
    if w_gate.dtype == torch.float8_e4m3fn and any(t.requires_grad for t in (w_gate, w_up, w_down)):
        # NOTES: autograd casts a gradient to its input's dtype: lynx's bf16 weight gradients would
        # reach the caller as e4m3.
        raise ValueError("lynx: w_gate, w_up, w_down: e4m3 weights that require grad (autograd would cast "
                         "lynx's bf16 weight gradients to e4m3): pass them detached and take the weight "
                         "gradients from lynx.functional.backward (bf16), or give lynx bf16 weights to quantise")
    if ep_tokens is not None and ep_group is None:
        raise ValueError("lynx: ep_tokens: only with an ep_group")
    # NOTES: an empty batch is padded only where no expert-parallel group (a rank alone with none would run
    # a count the others do not: ep_tokens pads ranks to one count) nor explicit workspace (whose shape
    # fixes T) is given.
    # A group of one rank is no group (its id 0), here as in lynx.nn.MoE.
    ep = _groups.group_id(ep_group, config.peer_timeout_ms)
    x, topk_ids, topk_weights, T = pad_for_call(x, topk_ids, topk_weights,
                                                config.token_multiple if workspace is None else 1, ep_tokens,
                                                pad_empty=workspace is None and ep == 0)
    y = _moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, config, workspace_tag,
             workspace, ep)
    return y if T is None else y[:T]


def _moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, config, workspace_tag, workspace,
         ep):
    """moe on tokens already padded; ep the group's id (_groups.group_id)."""
    if workspace is not None and ep != 0:
        raise ValueError("lynx: workspace: an explicit Workspace is one rank's; pass ep_group without it")
    if workspace is not None:
        op_config = workspace._args(x, topk_ids, w_gate, ws_gate, (x, topk_ids, topk_weights, w_gate, w_up, w_down,
                                                                   ws_gate, ws_up, ws_down))
        workspace._context = None  # the autograd path keeps its own inputs alive; see moe_backward
    else:
        if workspace_tag < 0:
            raise ValueError(f"lynx: workspace_tag: must be >= 0 (negative tags are lynx's own), got {workspace_tag}")
        op_config = _op_config(config, workspace_tag, ep)
        return ops.moe_autograd(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *op_config)
    return ops.moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *op_config)


def schedule_capacity(tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                      shared_intermediate: int = 0, ep_group=None, max_load: float = 2.0) -> int:
    """A Config.schedule_capacity for routings that bring a rank at most `max_load` times its balanced
    share of the rows (tokens · top_k: this rank's tokens), each expert padded
    (lynx::schedule_capacity_for_load). num_experts counts the experts of every rank, not this rank's. With an
    ep_group the default capacity is the worst case, every rank's rows on one rank: R times the balanced
    rows in every per-row buffer of the workspace. A call whose routing needs more than the capacity
    computes nothing and is reported by lynx.check(). One rank always needs its worst case."""
    R, _ = _groups.ranks(_groups.group_id(ep_group))
    return _C.schedule_capacity_for_load(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, R,
                                         float(max_load))


def _op_config(config: Config, tag: int, ep_group: int = 0):
    """The trailing arguments of the custom ops: backend code, schedule capacity, save context, tag,
    expert-parallel group id (lynx/_groups.py; 0: none), precision code."""
    return (_workspaces._BACKENDS[config.backend], config.schedule_capacity, config.save_forward_context, tag,
            ep_group, _workspaces.FP8_BF16_WEIGHT_GRADS if config.bf16_weight_grads
            else _workspaces._PRECISIONS[config.precision])

