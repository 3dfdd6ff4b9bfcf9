"""lynx: a fused Mixture-of-Experts layer for training on NVIDIA Hopper GPUs.

    import lynx
    y = lynx.functional.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)   # autograd, torch.compile
    layer = lynx.nn.MoE(hidden=2048, intermediate=768, num_experts=128, top_k=8, device="cuda")
"""

from lynx import functional, nn
from lynx._C import LynxError
from lynx._workspaces import OutOfMemoryError
from lynx.functional import Config, Workspace, check, moe

__all__ = ["Config", "LynxError", "OutOfMemoryError", "Workspace", "check", "functional", "moe", "nn"]
