"""How tensors cross into the C++ API: (data_ptr, dtype code, shape, strides)."""

import torch

# The codes of lynx::DType (include/lynx/tensor.h).
_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.int32: 2, torch.int64: 3, torch.float8_e4m3fn: 4}


def view(t, name):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"lynx: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_CODES:
        raise ValueError(f"lynx: {name}: dtype {t.dtype} is not one lynx takes (bf16, fp32, int32, int64, "
                         "float8_e4m3fn)")
    if not t.is_cuda:
        raise ValueError(f"lynx: {name}: must be a CUDA tensor, got device {t.device}")
    return (t.data_ptr(), _DTYPE_CODES[t.dtype], tuple(t.shape), tuple(t.stride()))


def inputs(x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    """The call's tensors as the binding takes them: each a CUDA tensor on x's device (checked here,
    before any workspace is looked up or made)."""
    names = ("x", "topk_ids", "topk_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down")
    tensors = (x, topk_ids, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
    views = tuple(view(t, n) for t, n in zip(tensors, names))
    for t, n in zip(tensors[1:], names[1:]):
        if t is not None and t.device != x.device:
            raise ValueError(f"lynx: {n}: on {t.device}, but x is on {x.device}: every tensor of a call must be on "
                             "x's device")
    return views


def on_device_of_x(t, name, x):
    """view(t), t being on x's device."""
    v = view(t, name)
    if t.device != x.device:
        raise ValueError(f"lynx: {name}: on {t.device}, but x is on {x.device}: every tensor of a call must be on "
                         "x's device")
    return v


def aligned(t):
    """t, or a copy of it where its data is not 16-byte aligned (a view at an offset: lynx's vector loads
    need the alignment every allocation has). While torch.compile traces, t as it is (a traced tensor has
    no address; the op then checks the one it runs with)."""
    if torch.compiler.is_compiling():
        return t
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _DeviceArray:
    """An int32 device array seen through the CUDA array interface (no copy)."""

    def __init__(self, ptr, length):
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "<i4", "data": (ptr, False), "version": 2}


def schedule_tensors(ws, device):
    """The arrays of the workspace's schedule as int32 tensors that alias its buffers: valid until the
    next call on the workspace rebuilds them (clone to keep). One rank keeps no row_src_rank (a null
    pointer: every row's source is rank 0): it is made from row_token_slot."""
    with torch.cuda.device(device):
        listed = ws.schedule_arrays()
        if listed[0][1] == 0:  # row_token_slot: null before the first forward, or with the caller's context
            raise ValueError("lynx: the workspace holds no schedule: call forward or recompute_forward_context on it "
                             "first (a workspace whose forward context is the caller's keeps none)")
        arrays = {name: torch.as_tensor(_DeviceArray(ptr, length), device=device)
                  for name, ptr, length in listed if ptr != 0}
        if "row_src_rank" not in arrays:
            slots = arrays["row_token_slot"]
            arrays["row_src_rank"] = torch.where(slots >= 0, 0, -1).to(torch.int32)
        return arrays
