"""The reference models: shapes, loss, attention implementations agree, GQA without repeated K/V, HF twins."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from recompute import ConfigError, ModelSpec
from recompute.models import GPT, Llama, build_model
from recompute.models.core import causal_attention
from recompute.models.hf import build_hf_model
from tiny import tiny_gpt, tiny_llama

GPT_SPEC = tiny_gpt(n_layers=2)
LLAMA_SPEC = tiny_llama(n_layers=2)
SPECS = {"gpt": GPT_SPEC, "llama": LLAMA_SPEC}


@pytest.mark.parametrize("name", SPECS)
def test_forward_shapes_and_initial_loss(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(SPECS[name], attention="eager")
    idx, targets = torch.randint(128, (2, 16)), torch.randint(128, (2, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 128)
    assert loss is not None and abs(loss.item() - math.log(128)) < 0.5  # near uniform at init
    assert model(idx)[1] is None


def test_build_model_picks_the_architecture() -> None:
    assert isinstance(build_model(GPT_SPEC, attention="eager"), GPT)
    assert isinstance(build_model(LLAMA_SPEC, attention="eager"), Llama)
    model = build_model(LLAMA_SPEC, dtype=torch.bfloat16, attention="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("name", SPECS)
def test_every_layer_has_the_named_sub_blocks(name: str) -> None:
    model = build_model(SPECS[name], attention="eager")
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    for block in model.layers:
        assert {n for n, _ in block.named_children()} == {"norm1", "attn", "norm2", "mlp"}
        assert callable(block.attn.core)
    assert model.spec is SPECS[name]


def test_tied_embeddings_share_one_tensor() -> None:
    model = build_model(GPT_SPEC, attention="eager")
    assert model.lm_head.weight is model.tok_emb.weight
    assert (
        build_model(LLAMA_SPEC, attention="eager").lm_head.weight
        is not build_model(LLAMA_SPEC, attention="eager").tok_emb.weight
    )


@pytest.mark.parametrize("name", SPECS)
def test_eager_and_flash_attention_agree(name: str) -> None:
    torch.manual_seed(0)
    eager = build_model(SPECS[name], attention="eager").eval()
    flash = build_model(SPECS[name], attention="flash").eval()
    flash.load_state_dict(eager.state_dict())
    idx = torch.randint(128, (2, 24))
    torch.testing.assert_close(flash(idx)[0], eager(idx)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 4], ids=lambda g: f"group{g}")
def test_eager_gqa_matches_sdpa_with_repeated_kv(groups: int) -> None:
    torch.manual_seed(0)
    b, a, s, dh = 2, 4, 8, 16
    q, k, v = torch.randn(b, a, s, dh), torch.randn(b, a // groups, s, dh), torch.randn(b, a // groups, s, dh)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), is_causal=True
    )
    torch.testing.assert_close(causal_attention(q, k, v, impl="eager", dropout_p=0.0), expected)
    torch.testing.assert_close(causal_attention(q, k, v, impl="flash", dropout_p=0.0), expected)


def test_eager_gqa_saves_unexpanded_kv() -> None:
    """Autograd keeps K and V at (b, kv, s, dh): no tensor of the repeated (b, a, s, dh) K/V is saved."""
    b, a, kv, s, dh = 1, 8, 2, 8, 4
    q = torch.randn(b, a, s, dh, requires_grad=True)
    k, v = torch.randn(b, kv, s, dh, requires_grad=True), torch.randn(b, kv, s, dh, requires_grad=True)
    storages: dict[int, int] = {}  # data pointer -> elements; views of one storage count once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        causal_attention(q, k, v, impl="eager", dropout_p=0.0)
    # q, K, V, and the softmax output (saved by softmax and by att @ v)
    assert sorted(storages.values()) == sorted([b * a * s * dh, b * kv * s * dh, b * kv * s * dh, b * a * s * s])


def test_dropout_is_active_in_training_only() -> None:
    torch.manual_seed(0)
    model = build_model(GPT_SPEC, attention="eager")
    idx = torch.randint(128, (2, 16))
    model.eval()
    torch.testing.assert_close(model(idx)[0], model(idx)[0], rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(idx)[0], model(idx)[0])


def test_too_long_sequences_are_refused() -> None:
    with pytest.raises(ValueError, match="64"):
        build_model(GPT_SPEC, attention="eager")(torch.zeros(1, 65, dtype=torch.long))


def test_build_model_rejects_mismatched_spec_and_attention() -> None:
    with pytest.raises(ConfigError, match="position='learned'"):
        build_model(ModelSpec(hidden=64, n_heads=4, n_layers=1, position="rotary"), attention="eager")
    with pytest.raises(ConfigError, match="attention"):
        build_model(GPT_SPEC, attention="flex")


@pytest.mark.parametrize(
    ("name", "cls"), [("gpt", transformers.GPT2LMHeadModel), ("llama", transformers.LlamaForCausalLM)]
)
def test_hf_twin_has_the_spec_shape(name: str, cls: type) -> None:
    spec = SPECS[name]
    model = build_hf_model(spec, attention="eager")
    assert isinstance(model, cls)
    assert model.config._attn_implementation == "eager"
    ours = sum(p.numel() for p in build_model(spec, attention="eager").parameters())
    assert sum(p.numel() for p in model.parameters()) == ours


def test_hf_twin_refuses_other_shapes() -> None:
    with pytest.raises(ConfigError, match="Llama shaped"):
        build_hf_model(ModelSpec(hidden=64, n_heads=4, n_layers=1, mlp="swiglu", norm="layernorm"), attention="eager")
