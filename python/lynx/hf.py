"""lynx as a Hugging Face Transformers (5.x) experts implementation. After `import lynx.hf`, a model
whose MoE experts use Transformers' experts interface with concatenated gate and up weights
(`gate_up_proj` [E, 2I, H], gate first, and `down_proj` [E, H, I], bf16; Qwen3-MoE among others) runs
them on lynx with `experts_implementation="lynx"` (at `from_pretrained` / `from_config`, or
`model.set_experts_implementation("lynx")`), or in FP8 with `experts_implementation="lynx_fp8"`
(lynx.Config(precision="fp8_block"), docs/fp8.md). The router stays the model's."""

import weakref

import torch
from transformers.integrations.moe import ExpertsInterface

from lynx import _views, _workspaces, ops
from lynx.functional import Config, _op_config, check_token_multiple, pad_for_call

# As lynx.Config(token_multiple=): each experts call's tokens padded to a multiple of this (zero rows, not
# routed; the call gets back its own rows), so that a model called at varying token counts (dynamic
# padding, prompts of many lengths) keeps a few workspaces an experts module, not one per count; 1: none.
# An int >= 1, read at each call (torch.compile guards on it: a new value recompiles).
token_multiple = 1


class _Experts(torch.autograd.Function):
    """lynx's experts over gate_up_proj [E, 2I, H] (gate first): lynx reads gate and up as the
    parameter's two halves, where they lie (strided views, no copies), and writes their gradient as one
    [E, 2I, H] tensor (ops.JOINED_GATE_UP); in FP8 the E4M3 copies are made again only when the
    parameter has changed (its version counter, which its views share; docs/python.md says where the
    views arrive as tensors of their own)."""

    @staticmethod
    def forward(ctx, x, topk_ids, topk_weights, gate_up, down, tag, config):
        backend, capacity, _, _, _, precision = _op_config(config, tag)
        gate, up = _halves(gate_up)
        y, context = ops.moe_forward_saving(x, topk_ids, topk_weights, gate, up, down, None, None, None, backend,
                                            capacity, tag, 0, precision)
        ctx.save_for_backward(x, topk_ids, topk_weights, gate_up, down, context)
        ctx.config = (backend, capacity, tag, 0, precision)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, topk_ids, topk_weights, gate_up, down, context = ctx.saved_tensors
        gate, up = _halves(gate_up)
        # Frozen experts (gate_up_proj and down_proj not requiring grad): no expert weight gradients.
        experts = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dx, d_topk, d_gate_up, _, d_down = ops.moe_backward_from(
            dy.to(torch.bfloat16).contiguous(), context, x, topk_ids, topk_weights, gate, up, down,
            None, None, None, *ctx.config, ops.EXPERT_WEIGHT_GRADS | ops.JOINED_GATE_UP if experts else 0)[:5]
        if not experts:
            return dx, None, d_topk, None, None, None, None
        return dx, None, d_topk, d_gate_up, d_down, None, None


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
    """gate and up: views of gate_up_proj, each [E, I, H] with its experts 2·I·H elements apart. NOTES: a
    parameter that is not laid out [E, 2I, H] row-major (a transposed or sliced one), or not 128-byte
    aligned as lynx wants its expert weights, is copied first."""
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    elif not torch.compiler.is_compiling() and gate_up.data_ptr() % 128 != 0:  # (a traced tensor has no address)
        gate_up = gate_up.clone()
    I = gate_up.shape[1] // 2
    return gate_up[:, :I], gate_up[:, I:]


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, config):
    if self.has_bias or not self.has_gate or self.is_transposed or not self.is_concatenated:
        raise NotImplementedError("lynx: experts with biases, without a gate, transposed or interleaved gate/up "
                                  "weights are not supported")
    if self.gate_up_proj.dtype != torch.bfloat16 or hidden_states.dtype != torch.bfloat16:
        raise ValueError("lynx: the experts' weights and hidden states must be bf16")
    x = _views.aligned(hidden_states.contiguous())
    ids, tw = top_k_index.contiguous(), top_k_weights.float().contiguous()
    down = self.down_proj.contiguous()
    check_token_multiple(token_multiple, "lynx.hf.token_multiple")
    x, ids, tw, T = pad_for_call(x, ids, tw, token_multiple)
    tag = workspace_tag(self)
    if not ops.gradient_wanted(x, tw, self.gate_up_proj, down):  # generation, evaluation: no context kept
        backend, capacity, _, _, _, precision = _op_config(config, tag)
        gate, up = _halves(self.gate_up_proj)
        y = ops.moe_forward_keeping_none(x, ids, tw, gate, up, down, None, None, None, backend, capacity, tag, 0,
                                         precision)
    else:
        y = _Experts.apply(x, ids, tw, self.gate_up_proj, down, tag, config)
    return y[:T].to(hidden_states.dtype)


_FP8 = Config(precision="fp8_block")


def lynx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, Config())


def lynx_fp8_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, _FP8)


ExpertsInterface.register("lynx", lynx_experts_forward)
ExpertsInterface.register("lynx_fp8", lynx_fp8_experts_forward)
