"""``torch.compile`` of an applied model: one graph (no breaks), same loss and gradients as eager.

``aot_eager`` runs dynamo and AOTAutograd's partitioner over the checkpoint tags without code generation, so
several policies stay cheap; one inductor run (slow: it compiles C++) checks the real backend. Dropout is off
here: compiled dropout draws from a different RNG than eager, so masks would differ by design.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from recompute import ModelSpec, Policy
from recompute.checkpointing import apply
from recompute.models import build_model

SPEC = ModelSpec(hidden=32, n_layers=2, n_heads=2, vocab=64, max_positions=16, dropout=0.0)
Grads = tuple[torch.Tensor, dict[str, torch.Tensor]]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def step(model: nn.Module, params: nn.Module) -> Grads:
    params.zero_grad(set_to_none=True)
    idx = torch.randint(64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in params.named_parameters()}


def compiled_matches_eager(
    policy: str | Policy, backend: str, spec: ModelSpec = SPEC, attention: str = "eager"
) -> tuple[Grads, Grads]:
    torch.manual_seed(0)
    model = build_model(spec, attention=attention).train()
    ref = step(model, model)
    apply(model, policy)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: a graph break fails the test
    return step(compiled, model), ref


@pytest.mark.parametrize(
    "policy",
    ["block", "core_attn", "attn+mlp", Policy("block", save_ops=("aten.addmm",))],
    ids=["block", "core_attn", "attn+mlp", "block-save-addmm"],
)
def test_compiled_applied_model_matches_eager(policy: str | Policy) -> None:
    got, ref = compiled_matches_eager(policy, "aot_eager")
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_compiled_applied_model_matches_eager() -> None:
    """One layer, no biases, SDPA: each generated C++ kernel costs seconds to build on a CPU runner."""
    spec = dataclasses.replace(SPEC, n_layers=1, bias=False)
    got, ref = compiled_matches_eager("block", "inductor", spec, attention="flash")
    torch.testing.assert_close(got, ref)
