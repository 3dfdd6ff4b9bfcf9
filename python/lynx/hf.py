"""lynx as a Hugging Face Transformers (5.x) experts implementation. After `import lynx.hf`, a model
whose MoE experts use Transformers' experts interface with concatenated gate and up weights
(`gate_up_proj` [E, 2I, H], gate first, and `down_proj` [E, H, I], bf16; Qwen3-MoE among others) runs
them on lynx with `experts_implementation="lynx"` (at `from_pretrained` / `from_config`, or
`model.set_experts_implementation("lynx")`). The router stays the model's."""

import torch
from transformers.integrations.moe import ExpertsInterface

from lynx import _workspaces, ops
from lynx.functional import Config, _op_config


def lynx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    if self.has_bias or not self.has_gate or self.is_transposed or not self.is_concatenated:
        raise NotImplementedError("lynx: experts with biases, without a gate, transposed or interleaved gate/up "
                                  "weights are not supported")
    if self.gate_up_proj.dtype != torch.bfloat16 or hidden_states.dtype != torch.bfloat16:
        raise ValueError("lynx: the experts' weights and hidden states must be bf16")
    I = self.gate_up_proj.shape[1] // 2
    # NOTES: lynx takes gate and up as contiguous [E, I, H] tensors: the two halves of gate_up_proj are
    # copied at each call (autograd carries their gradients back), 2/3 of the experts' weight bytes.
    w_gate = self.gate_up_proj[:, :I].contiguous()
    w_up = self.gate_up_proj[:, I:].contiguous()
    if not hasattr(self, "_lynx_tag"):
        self._lynx_tag = _workspaces.new_tag()  # a workspace of its own, as a lynx.nn.MoE layer has
    y = ops.moe_autograd(hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.float().contiguous(),
                         w_gate, w_up, self.down_proj.contiguous(), None, None, None,
                         *_op_config(Config(), self._lynx_tag))
    return y.to(hidden_states.dtype)


ExpertsInterface.register("lynx", lynx_experts_forward)
