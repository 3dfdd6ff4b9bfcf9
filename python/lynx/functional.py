"""The functional API: lynx.functional.moe, with autograd, usable under torch.compile and in CUDA
graphs (the default fused backend has no host synchronisation)."""

import dataclasses
from typing import Optional

import torch

from lynx import _workspaces, ops


@dataclasses.dataclass(frozen=True)
class Config:
    """Mirror of lynx::Config (include/lynx/config.h); 0 means "choose for me"."""

    backend: str = "auto"  # "auto" (= "fused"), "fused" or "unfused"
    schedule_capacity: int = 0
    save_forward_context: bool = True

    def __post_init__(self):
        if self.backend not in _workspaces._BACKENDS:
            raise ValueError(f"lynx: config.backend: must be one of {sorted(_workspaces._BACKENDS)}, "
                             f"got {self.backend!r}")


def check(device=None):
    """Waits for the current stream and raises lynx.LynxError if a lynx kernel reported an error
    (an expert id out of range, a non-finite router weight, a schedule over capacity). The fused path
    never synchronises, so such errors surface only here (or as a CUDA error at the next sync). Until
    it is reported, an error stays set and every later call on the same workspace leaves its outputs
    unwritten: call this once per training step (it costs one stream synchronisation)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    for ws in _workspaces.all_workspaces():
        ws.check(stream)


def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
        w_up: torch.Tensor, w_down: torch.Tensor, ws_gate: Optional[torch.Tensor] = None,
        ws_up: Optional[torch.Tensor] = None, ws_down: Optional[torch.Tensor] = None,
        config: Config = Config(), workspace_tag: int = 0) -> torch.Tensor:
    """y[t] = shared(x[t]) + sum_j topk_weights[t,j] * down_e(silu(gate_e x[t]) * up_e x[t]).

    x [T, H] bf16; topk_ids [T, k] int32/int64; topk_weights [T, k] fp32; w_gate, w_up [E, I, H],
    w_down [E, H, I] bf16 (nn.Linear "out x in" per expert, as TorchTitan); the optional shared
    expert ws_gate, ws_up [I_s, H], ws_down [H, I_s]. Differentiable in x, topk_weights and every
    weight. Arguments are validated before anything runs (lynx.LynxError, a ValueError, names the
    argument).

    Calls of the same shape share one workspace (its buffers, and the forward context it keeps for
    backward) unless their `workspace_tag`s differ; a backward whose context was replaced by another
    call recomputes it. lynx.nn.MoE gives every layer its own tag."""
    if x.dim() != 2 or topk_ids.dim() != 2 or w_gate.dim() != 3:
        raise ValueError("lynx: x must be [T, H], topk_ids [T, k] and w_gate [E, I, H]")
    return ops.moe_forward(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                           _workspaces._BACKENDS[config.backend], config.schedule_capacity, config.save_forward_context,
                           workspace_tag)

