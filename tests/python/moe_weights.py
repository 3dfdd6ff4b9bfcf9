"""Random expert and shared-expert weights for the binding's tests (scaled so that activations stay
of order one), drawn from a torch.Generator."""

import torch


def expert_weights(g, E, I, H, Is=0):
    """([w_gate, w_up [E, I, H], w_down [E, H, I]], [ws_gate, ws_up [Is, H], ws_down [H, Is]] or Nones)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = [torch.randn(E, I, H, generator=g, **bf) * (2 / H**0.5), torch.randn(E, I, H, generator=g, **bf) * (2 / H**0.5),
         torch.randn(E, H, I, generator=g, **bf) * (1 / I**0.5)]
    s = [None, None, None]
    if Is:
        s = [torch.randn(Is, H, generator=g, **bf) * (2 / H**0.5), torch.randn(Is, H, generator=g, **bf) * (2 / H**0.5),
             torch.randn(H, Is, generator=g, **bf) * (1 / Is**0.5)]
    return w, s
