"""Workspaces cached per (shape, config, device)."""

import itertools

import torch

from lynx import _C

_BACKENDS = {"auto": 0, "unfused": 1, "fused": 2}  # lynx::Backend
_BY_KEY: dict = {}
_BY_SPEC: dict = {}
_KEYS = itertools.count()
# Tags >= 0 are the caller's (0 is the shared default of lynx.functional.moe); every lynx.nn.MoE and
# lynx.functional.Workspace takes a fresh negative one, so that no caller's tag can collide with it.
_TAGS = itertools.count(-1, -1)


def new_tag() -> int:
    return next(_TAGS)


def release(tag: int) -> None:
    """Drops every workspace with this tag (its memory is freed once nothing else refers to it; the
    C++ destructor waits for the device first)."""
    for spec in [s for s in _BY_SPEC if s[6][3] == tag]:
        _BY_KEY.pop(_BY_SPEC.pop(spec), None)


def key_for(tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, config, device) -> int:
    """The key of the workspace for this shape, config (backend code, schedule capacity, save context,
    tag: calls with different tags never share a workspace) and CUDA device, created on first use."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    spec = (tokens, hidden, intermediate, num_experts, top_k, shared_intermediate, config, index)
    key = _BY_SPEC.get(spec)
    if key is None:
        with torch.cuda.device(index):
            ws = _C.Workspace(tokens=tokens, hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                              top_k=top_k, shared_intermediate=shared_intermediate, backend=config[0],
                              schedule_capacity=config[1], save_forward_context=config[2])
        key = next(_KEYS)
        _BY_KEY[key] = ws
        _BY_SPEC[spec] = key
    return key


def get(key: int):
    return _BY_KEY[key]


def all_workspaces():
    return list(_BY_KEY.values())
