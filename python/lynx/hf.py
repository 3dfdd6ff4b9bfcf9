"""lynx as a Hugging Face Transformers (5.x) experts implementation. After `import lynx.hf`, a model
whose MoE experts use Transformers' experts interface with concatenated gate and up weights
(`gate_up_proj` [E, 2I, H], gate first, and `down_proj` [E, H, I], bf16; Qwen3-MoE among others) runs
them on lynx with `experts_implementation="lynx"` (at `from_pretrained` / `from_config`, or
`model.set_experts_implementation("lynx")`). The router stays the model's."""

import weakref

import torch
from transformers.integrations.moe import ExpertsInterface

from lynx import _workspaces, ops
from lynx.functional import Config, _op_config


class _Experts(torch.autograd.Function):
    """lynx's experts over gate_up_proj [E, 2I, H] (gate first). NOTES: lynx takes gate and up as
    contiguous [E, I, H] tensors, so the two halves are copied for the forward and again for the
    backward: what autograd keeps until the backward is the parameter itself, not the copies (2/3 of
    the experts' weight bytes per layer, 768 MiB at qwen3-30b-a3b)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, gate_up, down, tag):
        backend, capacity, _, _, _, precision = _op_config(Config(), tag)
        gate, up = _halves(gate_up)
        y, context = ops.moe_forward_saving(x, topk_ids, topk_weights, gate, up, down, None, None, None, backend,
                                            capacity, tag, precision)
        ctx.save_for_backward(x, topk_ids, topk_weights, gate_up, down, context)
        ctx.config = (backend, capacity, tag, precision)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, gate_up, down, context = ctx.saved_tensors
        gate, up = _halves(gate_up)
        dx, d_topk, d_gate, d_up, d_down = ops.moe_backward_from(
            dy.to(torch.bfloat16).contiguous(), context, x, topk_ids, topk_weights, gate, up, down, None, None, None,
            *ctx.config)[:5]
        return dx, None, d_topk, torch.cat([d_gate, d_up], dim=1), d_down, None


# Each experts module's workspace tag, released with the module. NOTES: kept here, not as an attribute
# of the module, so that a copy of a model (copy.deepcopy) gets tags of its own.
_TAGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def workspace_tag(module) -> int:
    """The workspace tag of a model's experts module (a workspace of its own, as a lynx.nn.MoE layer
    has), made at its first call."""
    tag = _TAGS.get(module)
    if tag is None:
        tag = _TAGS[module] = _workspaces.new_tag()
        weakref.finalize(module, _workspaces.release, tag)
    return tag


def _halves(gate_up):
    I = gate_up.shape[1] // 2
    return gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()


def lynx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    if self.has_bias or not self.has_gate or self.is_transposed or not self.is_concatenated:
        raise NotImplementedError("lynx: experts with biases, without a gate, transposed or interleaved gate/up "
                                  "weights are not supported")
    if self.gate_up_proj.dtype != torch.bfloat16 or hidden_states.dtype != torch.bfloat16:
        raise ValueError("lynx: the experts' weights and hidden states must be bf16")
    y = _Experts.apply(hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.float().contiguous(),
                       self.gate_up_proj, self.down_proj.contiguous(), workspace_tag(self))
    return y.to(hidden_states.dtype)


ExpertsInterface.register("lynx", lynx_experts_forward)
