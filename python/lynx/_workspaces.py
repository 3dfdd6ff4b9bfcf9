"""Workspaces cached per (shape, config, device), and their release."""

import itertools
import warnings
from typing import NamedTuple

import torch

from lynx import _C, _groups

_BACKENDS = {"auto": 0, "unfused": 1, "fused": 2}  # lynx::Backend
_PRECISIONS = {"bf16": 0, "fp8_block": 1}  # lynx::Precision
# The ops' precision code: _PRECISIONS', and fp8_block with bf16 weight gradients (Config::bf16_weight_grads).
FP8_BF16_WEIGHT_GRADS = 2


class WorkspaceConfig(NamedTuple):
    """What selects a workspace besides its shape and device (a key of the cache below)."""

    backend: int                # _BACKENDS' code
    schedule_capacity: int
    save_forward_context: bool
    tag: int                    # calls with different tags never share a workspace
    caller_context: bool        # the caller holds each forward's context (Config::caller_context)
    ep_group: int               # expert-parallel group id (lynx/_groups.py; 0: none)
    precision: int              # _PRECISIONS' code, or FP8_BF16_WEIGHT_GRADS
_BY_SPEC: dict = {}  # spec -> _C.Workspace
# Tags >= 0 are the caller's (0 is the shared default of lynx.functional.moe); every lynx.nn.MoE and
# lynx.functional.Workspace takes a fresh negative one, so that no caller's tag can collide with it.
_TAGS = itertools.count(-1, -1)
# The tags of the workspaces that an expert-parallel group's layers of one shape share (ops.py,
# _context_workspace), one per CUDA stream: a workspace's passes must run one after another, as the
# passes queued on one stream do. Below every tag new_tag gives, and never released.
_EP_SHARED_TAGS = itertools.count(-(1 << 62), -1)
_EP_SHARED_BY_STREAM: dict = {}
_RELEASED: set = set()
# Released while a CUDA graph was being captured: freeing (which synchronises the device) would break
# the capture, so they wait here until the next lookup outside a capture.
_PENDING: list = []
# A layer with workspaces at this many token counts is warned once (_warn_if_many_token_counts).
MANY_TOKEN_COUNTS = 8
_WARNED: set = set()


# NOTES: every workspace takes its scratch (the per-row intermediates of a call) from PyTorch's caching
# allocator at each call and gives it back on the call's stream when the call is queued: layers that
# run one after another share it, torch.cuda.memory_allocated() counts it while a call runs, and a
# CUDA graph capture takes it from the graph's pool. What a workspace holds between calls is its
# forward context and the schedule (none with the caller's context, Config::caller_context), and in an
# expert-parallel group its shared region.
def _scratch_alloc(nbytes: int, stream: int) -> int:
    return torch.cuda.caching_allocator_alloc(nbytes, torch.cuda.current_device(), stream)


def _scratch_free(ptr: int, nbytes: int, stream: int) -> None:
    torch.cuda.caching_allocator_delete(ptr)


_C.set_scratch_allocator(_scratch_alloc, _scratch_free)


class OutOfMemoryError(torch.OutOfMemoryError, _C.LynxError):
    """A workspace's device memory could not be allocated, even after torch.cuda.empty_cache(): a
    torch.OutOfMemoryError (what PyTorch's out-of-memory handlers catch) and a lynx.LynxError."""


def _out_of_memory(error: Exception) -> bool:
    return "cannot allocate" in str(error) and "out of memory" in str(error)


def _made(make):
    """make() (a _C.Workspace's constructor). NOTES: a workspace's buffers come from cudaMalloc, not from
    PyTorch's caching allocator, which may hold the free memory they need: where the device ran out, its
    unused cached blocks are given back (torch.cuda.empty_cache(), as PyTorch's allocator does before it
    gives up) and make() is tried once more; out again, lynx.OutOfMemoryError."""
    try:
        return make()
    except _C.LynxError as e:
        if not _out_of_memory(e):
            raise
    torch.cuda.empty_cache()
    try:
        return make()
    except _C.LynxError as e:
        if not _out_of_memory(e):
            raise
        raise OutOfMemoryError(f"{e} (after torch.cuda.empty_cache())") from None


def new_tag() -> int:
    return next(_TAGS)


def ep_shared_tag(stream: int) -> int:
    """The tag of the expert-parallel workspaces shared by the layers whose calls run on `stream`."""
    tag = _EP_SHARED_BY_STREAM.get(stream)
    if tag is None:
        tag = _EP_SHARED_BY_STREAM[stream] = next(_EP_SHARED_TAGS)
    return tag


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def release(tag: int) -> None:
    """Drops every workspace with this tag; later lookups with it get a fresh workspace that is not
    kept. The C++ destructor waits for the device before freeing."""
    _RELEASED.add(tag)
    # NOTES: no expert-parallel workspace has a layer's tag (their tags are ep_shared_tag's, never released):
    # other ranks read them, so they live while the process runs (lynx/_groups.py says why).
    # NOTES: over a copy of the keys, each popped with a default: a finalizer may release another tag
    # meanwhile (any allocation may run one).
    keys = [s for s in list(_BY_SPEC) if s[6].tag == tag]
    _WARNED.difference_update([k for k in list(_WARNED) if k[5].tag == tag])
    dropped = [w for w in (_BY_SPEC.pop(s, None) for s in keys) if w is not None]
    if _capturing():
        _PENDING.extend(dropped)


def workspace_for(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, config, device):
    """The workspace for this shape (num_experts: over every rank), config (a WorkspaceConfig) and CUDA
    device, created on first use. A released tag (its layer or Workspace is gone, e.g. before a pending backward) gets
    a new workspace that is not cached: it lives as long as the caller holds it.

    In an expert-parallel group, creating a workspace is collective: every rank of the group creates
    its own in the same order (as it does when every rank runs the same sequence of calls), and they
    are connected through the group before their first pass. Their shared region (what the other
    ranks read and write) is their own; their scratch is PyTorch's, as at one rank."""
    if _PENDING and not _capturing():
        _PENDING.clear()
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    spec = (tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, config, index)
    ws = _BY_SPEC.get(spec)
    if ws is None and _capturing():
        # NOTES: making a workspace allocates and waits for the device, which a CUDA graph capture cannot
        # hold: the capture would end with a raw CUDA error.
        # An expert-parallel group's workspaces belong to a stream (ep_shared_tag): one warmed up on another
        # stream is not this one's.
        where = ("on this stream: an expert-parallel group's workspace belongs to the stream its calls run on, so "
                 "capture on the stream the warm-up ran on (torch.cuda.graph(g, stream=s), the warm-up inside "
                 "torch.cuda.stream(s))" if config.ep_group != 0 else
                 "first (a layer whose tag was released gets a new workspace at each call, so it cannot be "
                 "captured)")
        raise RuntimeError(f"lynx: no workspace yet for this call's shape (T = {tokens}, H = {hidden}, I = "
                           f"{intermediate}, E = {num_experts}, k = {top_k}) and configuration, and none can be made "
                           f"while a CUDA graph is captured: run the call once outside the capture {where}")
    if ws is None:
        R, rank = _groups.ranks(config.ep_group)
        copies_of = (_fp8_copies_owner(spec) if R == 1 and config.precision != _PRECISIONS["bf16"] and config.tag < 0
                     and config.tag not in _RELEASED else None)
        with torch.cuda.device(index):
            ws = _made(lambda: _C.Workspace(
                tokens=tokens, hidden=hidden, intermediate=intermediate, num_experts=num_experts, top_k=top_k,
                shared_intermediate=shared_intermediate, backend=config.backend,
                schedule_capacity=config.schedule_capacity, save_forward_context=config.save_forward_context,
                scratch_from_allocator=True, caller_context=config.caller_context, num_ranks=R, rank=rank,
                peer_timeout_ms=_groups.peer_timeout_ms(config.ep_group), precision=config.precision,
                fp8_weights_of=copies_of))
            if R > 1:
                _C.connect_process_group(ws, _groups.all_gather(config.ep_group))
                _groups.connected(config.ep_group)
            elif copies_of is not None:
                ws._fp8 = fp8_state(copies_of)
        ws._device_index = index  # its device's stream is the one lynx.check() waits for
        if config.tag not in _RELEASED:
            _BY_SPEC[spec] = ws
            _warn_if_many_token_counts(spec)
        else:
            ws._temporary = True  # made for this call alone (check_if_temporary)
    return ws


def _warn_if_many_token_counts(spec) -> None:
    """Warns once per layer (tag, sizes, configuration and device) whose cached workspaces reach
    MANY_TOKEN_COUNTS token counts: each is kept for the layer's life (its small buffers, a cuBLAS handle,
    pinned host memory, and in some configurations its context: docs/python.md), and making one waited
    for the device."""
    key = spec[1:]
    if key in _WARNED:
        return
    counts = {s[0] for s in list(_BY_SPEC) if s[1:] == key}
    if len(counts) < MANY_TOKEN_COUNTS:
        return
    _WARNED.add(key)
    hidden, intermediate, num_experts, top_k = spec[1:5]
    warnings.warn(f"lynx: a layer (H = {hidden}, I = {intermediate}, E = {num_experts}, k = {top_k}) now has "
                  f"workspaces for {len(counts)} token counts, each kept for the layer's life (making one waits "
                  "for the device); lynx.Config(token_multiple=256) (lynx.hf.token_multiple for a Hugging Face "
                  "model; a larger multiple where the layer already pads) pads each call's tokens to a "
                  "multiple, so that a few workspaces serve every count",
                  stacklevel=2)


class Fp8State:
    """What Python knows of a workspace's FP8 weight copies (ops._fp8_weights): shared by the workspaces
    made on the same copies (_fp8_copies_owner)."""

    def __init__(self):
        self.weights = None        # copies (ops.FORWARD_COPIES / BACKWARD_COPIES) -> the weights they were made from
        self.prequantized = False  # the copies were given in FP8 (functional.set_quantized_weights)
        self.given = None          # those e4m3 tensors and scales: weak references and versions


def fp8_state(ws) -> Fp8State:
    state = getattr(ws, "_fp8", None)
    if state is None:
        state = ws._fp8 = Fp8State()
    return state


def _fp8_copies_owner(spec):
    """The cached FP8 workspace of one rank with the same tag, device and experts (one layer at another
    token count) whose weight copies a new workspace for `spec` is made on (lynx::Workspace with
    fp8_weights_of: it allocates none of its own), so that a layer keeps one set of copies (6·E·I·H
    bytes) however many token counts it is called at; None if there is none. NOTES: only for a layer's
    own tags (negative: lynx.nn.MoE, the HF experts), whose calls run one after another; calls with a
    caller's tag (lynx.moe's default 0) may run on several streams at once, where one's quantisation
    would rewrite copies another's queued pass reads."""
    tokens, hidden, intermediate, num_experts, _, _, config, index = spec
    for other_spec, other in list(_BY_SPEC.items()):  # a release (a finalizer) may run meanwhile
        o_tokens, o_hidden, o_intermediate, o_experts, _, _, o_config, o_index = other_spec
        if (o_config.tag == config.tag and o_index == index and o_config.ep_group == 0 and
                o_config.precision != _PRECISIONS["bf16"] and (o_hidden, o_intermediate, o_experts) ==
                (hidden, intermediate, num_experts)):
            return other
    return None


def check_if_temporary(ws, stream: int) -> None:
    """A workspace made for one call (its tag released: lynx lookups keep none of them) goes with the
    call, and lynx.check() never sees it: its call's errors (a bad route, a schedule over capacity) are
    raised here, at the cost of waiting for the stream. None is made during a capture (workspace_for)."""
    if getattr(ws, "_temporary", False) and not _capturing():
        ws.check(stream)


def all_workspaces():
    return list(_BY_SPEC.values())


def described_workspaces():
    """(what the workspace is, as an error names it; the workspace) of every cached workspace."""
    return [(f"the workspace of T = {spec[0]}, H = {spec[1]}, I = {spec[2]}, E = {spec[3]}, k = {spec[4]}, I_s = "
             f"{spec[5]}, tag {spec[6].tag} on cuda:{spec[7]}", ws) for spec, ws in list(_BY_SPEC.items())]
