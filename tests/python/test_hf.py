"""lynx as a Hugging Face experts implementation (lynx.hf): a small randomly initialised Qwen3-MoE
model (nothing downloaded) gives the unmodified model's logits and every parameter's gradient."""

import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

TOL = 1e-2  # relative Frobenius error, bf16 operands (docs/testing.md)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiny_model():
    """A small randomly initialised Qwen3-MoE model (eager experts) and a batch of its tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    importlib.import_module("lynx.hf")  # registers "lynx" and "lynx_fp8"
    # NOTES: one decoder layer: its router sees the same inputs on both paths, so both route alike (with a
    # second layer, the first's bf16 differences could flip a near-tie in the second's top-k).
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to("cuda", torch.bfloat16)
    model.set_experts_implementation("eager")
    return model, torch.randint(0, config.vocab_size, (2, 96), device="cuda")


def run_both(implementation):
    """A small Qwen3-MoE model run forward and backward twice from the same weights and tokens: with its
    eager experts, and with `implementation` (after checking that its experts ran on lynx). Returns
    (eager model, its output, the other model, its output)."""
    import lynx.hf

    eager, ids = tiny_model()
    model = copy.deepcopy(eager)
    model.set_experts_implementation(implementation)
    want = eager(ids, labels=ids)
    want.loss.backward()
    got = model(ids, labels=ids)
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(m in lynx.hf._TAGS for m in experts), "the model's experts did not run on lynx"
    got.loss.backward()
    return eager, want, model, got


def test_qwen3_moe_matches_the_eager_experts():
    eager, want, model, got = run_both("lynx")
    assert rel(got.logits, want.logits) < TOL
    for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        assert q.grad is not None and torch.isfinite(q.grad).all(), name
        assert rel(q.grad, p.grad) < TOL, name


def test_qwen3_moe_in_fp8_close_to_the_eager_experts():
    """experts_implementation="lynx_fp8": the same model with its experts in FP8 (docs/fp8.md). NOTES: the
    layer's outputs bear at most a relative error of 0.102 (√(2 × its largest dissimilarity bound),
    tests/gpu/random_case.h, kFp8Bounds); the rest of the model (residual stream, attention, norms) is
    computed alike on both paths and only dilutes it."""
    eager, want, model, got = run_both("lynx_fp8")
    assert rel(got.logits, want.logits) < 0.102
    for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        assert q.grad is not None and torch.isfinite(q.grad).all(), name
        if "experts" in name:  # the layer's own weight gradients: its bound
            assert rel(q.grad, p.grad) < 0.102, name
        else:  # NOTES: through the router's softmax, whose gradient is a difference that can cancel: its direction
            cosine = torch.nn.functional.cosine_similarity(q.grad.float().flatten(), p.grad.float().flatten(), dim=0)
            assert cosine > 0.9, name


@pytest.mark.parametrize("implementation", ["lynx", "lynx_fp8"])
def test_qwen3_moe_without_gradients_keeps_no_context(monkeypatch, implementation):
    """Evaluation or generation (torch.no_grad): the experts run on lynx's forward that keeps no context
    (lynx._C.forward on the autograd pair's workspace, never forward_into), with the logits' bits of the
    forward that keeps one."""
    import lynx

    model, ids = tiny_model()
    model.set_experts_implementation(implementation)
    want = model(ids).logits
    calls = []
    forward_into, forward = lynx._C.forward_into, lynx._C.forward
    monkeypatch.setattr(lynx._C, "forward_into", lambda *a: (calls.append("into"), forward_into(*a))[1])
    monkeypatch.setattr(lynx._C, "forward", lambda *a: (calls.append("none"), forward(*a))[1])
    with torch.no_grad():
        got = model(ids).logits
    lynx.check()
    assert calls == ["none"]
    assert torch.equal(got, want.detach())


def test_fp8_experts_quantise_their_weights_again_only_when_they_change(monkeypatch):
    """experts_implementation="lynx_fp8" reads gate and up as views of gate_up_proj (no copies): their E4M3
    copies are made at the first forward and backward, not again while the parameters are unchanged,
    and again (both copies at once) once an update has changed them in place."""
    import lynx
    from lynx import ops

    model, ids = tiny_model()
    model.set_experts_implementation("lynx_fp8")
    calls = []
    quantize = lynx._C.quantize_weights
    monkeypatch.setattr(lynx._C, "quantize_weights", lambda *a: (calls.append(a[-1]), quantize(*a))[1])
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
    assert calls == [ops.FORWARD_COPIES, ops.BACKWARD_COPIES]
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    with torch.no_grad():
        for m in experts:
            m.gate_up_proj.mul_(0.5)
    model(ids, labels=ids).loss.backward()
    lynx.check()
    assert calls == [ops.FORWARD_COPIES, ops.BACKWARD_COPIES, ops.BOTH_COPIES]


def test_token_multiple_pads_the_experts_calls(monkeypatch):
    """lynx.hf.token_multiple = 128: the experts' 192 tokens run as 256 (64 of them not routed) on one
    workspace of 256 tokens, with the logits' and every gradient's bits of the unpadded calls."""
    import lynx.hf

    eager, ids = tiny_model()
    plain, padded = copy.deepcopy(eager), copy.deepcopy(eager)
    for model in (plain, padded):
        model.set_experts_implementation("lynx")
    want = plain(ids, labels=ids)
    want.loss.backward()
    monkeypatch.setattr(lynx.hf, "token_multiple", 128)
    got = padded(ids, labels=ids)
    got.loss.backward()
    assert torch.equal(got.logits, want.logits)
    for (name, p), (_, q) in zip(plain.named_parameters(), padded.named_parameters()):
        assert torch.equal(q.grad, p.grad), name
    tags = [lynx.hf._TAGS[m] for m in padded.modules() if hasattr(m, "gate_up_proj")]
    assert sorted(s[0] for s in lynx._workspaces._BY_SPEC if s[6].tag in tags) == [256] * len(tags)
