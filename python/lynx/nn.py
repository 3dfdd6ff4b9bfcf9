"""lynx.nn.MoE: a TorchTitan-style MoE layer (router + routed experts + optional shared expert)
whose experts run on the fused lynx ops."""

import dataclasses
import math
import weakref
from typing import Optional

import torch
from torch import nn

from lynx import _C, _groups, _views, _workspaces, functional, ops


class MoE(nn.Module):
    """Routes each token to `top_k` of `num_experts` SwiGLU experts (softmax router, top-k, optionally
    renormalised) and adds an optional shared expert.

    Weights, TorchTitan layout ("out x in" per expert, bf16): w1 (gate) and w3 (up) [E, I, H], w2
    (down) [E, H, I]; shared expert shared_w1, shared_w3 [I_s, H], shared_w2 [H, I_s]; router
    weight [E, H]. Input [..., H] bf16, output the same shape. `precision` ("bf16" or "fp8_block")
    replaces config.precision: lynx.nn.MoE(..., precision="fp8_block") runs the experts' GEMMs in FP8
    (docs/fp8.md).

    Expert parallelism: with `ep_group`, a torch.distributed process group of R ranks, this layer is
    this process's rank r of the group: it holds the experts r·E/R … (r+1)·E/R − 1 (w1, w3, w2 have
    E/R experts; `expert_offset` is the first one's global id), while the router and the shared expert
    are replicated. The experts' gradients are already summed over every rank's tokens: reduce only the
    router's and the shared expert's across the group (sum them, to match; DistributedDataParallel
    would average them, and would overwrite every rank's experts with rank 0's at construction unless
    told to ignore w1, w2 and w3). Initialised with the same random state on every rank, each rank's
    experts are its share of the experts one rank's layer would draw. Ranks whose token counts differ
    give the group's largest as `ep_tokens` (lynx.functional.moe). See lynx.functional.moe and
    docs/python.md.

    config.token_multiple > 1: each call's tokens are padded to a multiple of it (zero rows, not routed),
    so that a layer called at varying token counts keeps a few workspaces, not one per count."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, shared_intermediate: int = 0,
                 *, renormalize: bool = True, config: functional.Config = functional.Config(),
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.bfloat16, ep_group=None,
                 ep_tokens: Optional[int] = None, precision: Optional[str] = None):
        super().__init__()
        if precision is not None:  # config's, replaced: "bf16" or "fp8_block" (Config checks it)
            config = dataclasses.replace(config, precision=precision)
        if dtype != torch.bfloat16:
            raise ValueError(f"lynx.nn.MoE: dtype must be torch.bfloat16, got {dtype}")
        self._ep = _groups.group_id(ep_group, config.peer_timeout_ms)
        if ep_tokens is not None and ep_group is None:  # a group of one rank takes it, as lynx.moe does
            raise ValueError("lynx.nn.MoE: ep_tokens: only with an ep_group")
        if ep_tokens is not None and config.token_multiple != 1:
            raise ValueError("lynx.nn.MoE: ep_tokens: not with config.token_multiple (ep_tokens fixes the count)")
        self.ep_tokens = ep_tokens
        ranks, rank = _groups.ranks(self._ep)
        if num_experts % ranks != 0:
            raise ValueError(f"lynx.nn.MoE: num_experts ({num_experts}) must be a multiple of the ep_group's size "
                             f"({ranks})")
        # The sizes the kernels take (lynx::validate_shape; a lynx error naming the field), checked now
        # rather than at the first forward.
        _C.schedule_capacity_for_load(1, hidden, intermediate, num_experts, top_k, shared_intermediate, ranks, 2.0)
        local_experts = num_experts // ranks
        self.expert_offset = rank * local_experts
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k = num_experts, top_k
        self.shared_intermediate = shared_intermediate
        self.renormalize = renormalize
        self.config = config
        # A workspace tag of its own: at one rank a layer's workspace holds the FP8 copies of its weights
        # (in bf16 nothing of the layer: the contexts are autograd's). In an expert-parallel group the
        # layers of one shape share one whatever their tags (ops._context_workspace).
        self._take_workspace_tag()
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(local_experts, intermediate, hidden, **factory))
        self.w3 = nn.Parameter(torch.empty(local_experts, intermediate, hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(local_experts, hidden, intermediate, **factory))
        if shared_intermediate > 0:
            self.shared_w1 = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.shared_w3 = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.shared_w2 = nn.Parameter(torch.empty(hidden, shared_intermediate, **factory))
        else:
            self.shared_w1 = self.shared_w3 = self.shared_w2 = None
        self.reset_parameters()

    def _take_workspace_tag(self):
        """A tag of its own (at one rank a workspace of its own), released when the layer is garbage-collected."""
        self.workspace_tag = _workspaces.new_tag()
        weakref.finalize(self, _workspaces.release, self.workspace_tag)

    def __setstate__(self, state):
        # Copies (copy.deepcopy) and unpickled layers get their own tag: sharing one would make the
        # layers quantise each other's weights again (FP8), or overwrite each other's context where the
        # workspace keeps it (save_forward_context=False recomputes it).
        super().__setstate__(state)
        self._take_workspace_tag()

    @torch.no_grad()
    def reset_parameters(self):
        for w in (self.w1, self.w3, self.shared_w1, self.shared_w3):
            if w is not None:
                self._normal(w, 1.0 / math.sqrt(self.hidden))
        self._normal(self.w2, 1.0 / math.sqrt(self.intermediate))
        if self.shared_w2 is not None:
            nn.init.normal_(self.shared_w2, std=1.0 / math.sqrt(self.shared_intermediate))
        nn.init.normal_(self.router.weight, std=1.0 / math.sqrt(self.hidden))

    def _normal(self, w, std):
        """N(0, std²) into w. Expert weights are drawn expert by expert, every expert's at every R, each
        rank keeping its own: an expert-parallel layer starts as its share of one rank's layer, and no
        rank holds more than one expert's draw at a time."""
        if w.dim() != 3:
            nn.init.normal_(w, std=std)
            return
        draw = torch.empty(w.shape[1:], device=w.device, dtype=w.dtype)
        for e in range(self.num_experts):
            draw.normal_(std=std)
            if self.expert_offset <= e < self.expert_offset + w.shape[0]:
                w[e - self.expert_offset].copy_(draw)

    def route(self, x: torch.Tensor):
        """topk_ids [T, k] and fp32 topk_weights [T, k] for tokens x [T, H]."""
        scores = torch.softmax(self.router(x).float(), dim=-1)
        topk_weights, topk_ids = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 1 or x.shape[-1] != self.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"lynx.nn.MoE: x must be bfloat16 [..., {self.hidden}] (hidden), got {x.dtype} "
                             f"{list(x.shape)}")
        shape = x.shape
        tokens = _views.aligned(x.reshape(-1, self.hidden).contiguous())
        topk_ids, topk_weights = self.route(tokens)
        tokens, topk_ids, topk_weights, T = functional.pad_for_call(tokens, topk_ids, topk_weights,
                                                                    self.config.token_multiple, self.ep_tokens,
                                                                    pad_empty=self._ep == 0)
        y = ops.moe_autograd(tokens, topk_ids, topk_weights.contiguous(), self.w1, self.w3, self.w2, self.shared_w1,
                             self.shared_w3, self.shared_w2,
                             *functional._op_config(self.config, self.workspace_tag, self._ep))
        return y[:T].reshape(shape)
