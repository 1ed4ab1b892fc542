"""``apply``: every model x every policy leaves the loss and every gradient unchanged, with dropout on.

Recomputation on the CPU runs the same kernels on the same inputs, so the comparison is bit for bit
(``assert_close`` with zero tolerances). Selections, SAC save-lists, offloading, re-application, state
dicts and the errors for models whose layers cannot be found are covered here too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from grads import Grads, assert_same, grads_of
from recompute import POLICIES, ConfigError, ModelSpec, Policy, Workload
from recompute.check_gradients import loss_of
from recompute.checkpointing import _iter_wrapped, applied_policy, apply, find_layers
from recompute.core.analytic import layer_flops
from recompute.models import build_model
from recompute.models.hf import build_hf_model
from tiny import tiny_gpt, tiny_llama

GPT = tiny_gpt(n_layers=2)
LLAMA = tiny_llama(n_layers=2)
MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt-eager": lambda: build_model(GPT, attention="eager"),
    "gpt-flash": lambda: build_model(GPT, attention="flash"),
    "llama-eager": lambda: build_model(LLAMA, attention="eager"),
    "llama-flash": lambda: build_model(LLAMA, attention="flash"),
    "llama-eager-dropout": lambda: build_model(dataclasses.replace(LLAMA, dropout=0.1), attention="eager"),
    "hf-gpt2-eager": lambda: build_hf_model(GPT, attention="eager"),
    "hf-gpt2-sdpa": lambda: build_hf_model(GPT, attention="flash"),
    "hf-llama-eager": lambda: build_hf_model(LLAMA, attention="eager"),
    "hf-llama-sdpa": lambda: build_hf_model(LLAMA, attention="flash"),
    "hf-llama-eager-dropout": lambda: build_hf_model(dataclasses.replace(LLAMA, dropout=0.1), attention="eager"),
}
B, S = 2, 32


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().train()


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(128, (B, S), generator=g), torch.randint(128, (B, S), generator=g)


def step(model: nn.Module, loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = loss_of) -> Grads:
    """One forward/backward of the test batch with the dropout RNG seeded; the loss and every gradient."""
    return grads_of(model, loss_fn, batch())


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_ref(request: pytest.FixtureRequest) -> tuple[nn.Module, Grads]:
    model = make(request.param)
    return model, step(model)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_keeps_loss_and_gradients(model_and_ref: tuple[nn.Module, Grads], policy: str) -> None:
    model, ref = model_and_ref
    apply(model, policy)
    assert len(list(_iter_wrapped(model))) == {"none": 0, "attn+mlp": 4}.get(policy, 2)
    assert_same(step(model), ref)


SELECTIONS = {
    "block-every-2": (Policy("block", every=2), ["block", "none", "block", "none"]),
    "attn-first-1": (Policy("attn", first=1), ["attn", "none", "none", "none"]),
    "per-layer": (Policy(layers=("core_attn", "mlp", "attn+mlp", "block")), ["core_attn", "mlp", "attn+mlp", "block"]),
    "sac-save-mm": (Policy("block", save_ops=("aten.mm", "aten.addmm")), ["block"] * 4),
    "offload": (Policy("attn+mlp", offload=True), ["attn+mlp"] * 4),
    "sac-offload": (Policy("attn", save_ops=("aten.addmm",), offload=True), ["attn"] * 4),
}


def wrapped_policies(model: nn.Module) -> list[str]:
    """Read back, layer by layer, which policy is in place from what ``apply`` wrapped (recompute's models)."""
    wrapped = {(id(m), attr) for m, attr in _iter_wrapped(model)}
    out = []
    for block in find_layers(model):
        if (id(block), "forward") in wrapped:
            out.append("block")
        elif (id(block.attn), "core") in wrapped:
            out.append("core_attn")
        else:
            parts = [n for n in ("attn", "mlp") if (id(getattr(block, n)), "forward") in wrapped]
            out.append("+".join(parts) or "none")
    return out


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_layer_selections_and_options(arch: str, selection: str) -> None:
    spec = GPT if arch == "gpt" else LLAMA
    torch.manual_seed(0)
    model = build_model(ModelSpec(**{**spec.to_dict(), "n_layers": 4}), attention="eager").train()
    ref = step(model)
    policy, expected = SELECTIONS[selection]
    apply(model, policy)
    assert wrapped_policies(model) == expected
    assert applied_policy(model) == policy
    assert_same(step(model), ref)


def test_none_and_reapplying_restore_the_plain_model() -> None:
    model = make("gpt-eager")
    plain = {n: m.forward for n, m in model.named_modules()}  # bound methods of the classes
    ref = step(model)
    for policy in ["block", "block", "core_attn", "attn+mlp", "mlp"]:
        apply(model, policy)
        assert wrapped_policies(model) == [policy] * 2
    assert_same(step(model), ref)
    apply(model, "none")
    assert list(_iter_wrapped(model)) == []
    assert {n: m.forward for n, m in model.named_modules()} == plain
    assert all("forward" not in m.__dict__ and "core" not in m.__dict__ for m in model.modules())
    assert_same(step(model), ref)


@pytest.mark.parametrize("name", ["gpt-eager", "hf-llama-eager"])
def test_state_dict_keys_unchanged_and_load_into_a_plain_model(name: str) -> None:
    model, plain = make(name), make(name)
    keys = list(model.state_dict())
    apply(model, "attn+mlp" if name.startswith("gpt") else "core_attn")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    state = model.state_dict()
    assert list(state) == keys
    plain.load_state_dict(state)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)


def test_deepcopy_of_an_applied_model_runs_on_its_own_weights() -> None:
    model = make("llama-eager")
    apply(model, "block")
    twin = copy.deepcopy(model)
    assert wrapped_policies(twin) == ["block", "block"]
    assert_same(step(twin), step(model))
    step(twin)
    model.zero_grad(set_to_none=True)
    step(twin)
    assert all(p.grad is None for p in model.parameters())


def test_no_grad_forward_skips_checkpointing() -> None:
    model = make("gpt-eager").eval()
    apply(model, "block")
    idx, _ = batch()
    with torch.no_grad():
        out = model(idx)[0]
    apply(model, "none")
    with torch.no_grad():
        torch.testing.assert_close(out, model(idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["hf-gpt2-eager", "hf-llama-eager"])
@pytest.mark.parametrize("policy", ["attn", "block"])
def test_hf_models_with_their_default_kv_cache(name: str, policy: str) -> None:
    """A training forward that leaves ``use_cache`` on: the replay must not append to the cache again."""

    def default_call(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model(input_ids=idx, labels=targets).loss

    model = make(name)
    assert model.config.use_cache
    ref = step(model, default_call)
    apply(model, policy)
    assert_same(step(model, default_call), ref)


HF_OTHERS: dict[str, Callable[[], nn.Module]] = {
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            attention_dropout=0.1,
            attn_implementation="eager",
        )
    ),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=128,
            attention_dropout=0.1,
            hidden_dropout=0.1,
            attn_implementation="sdpa",
        )
    ),
}


@pytest.mark.parametrize("name", list(HF_OTHERS))
@pytest.mark.parametrize("policy", ["core_attn", "attn+mlp", "block"])
def test_other_hf_decoders_work_by_structure(name: str, policy: str) -> None:
    torch.manual_seed(0)
    model = HF_OTHERS[name]().train()
    ref = step(model)
    apply(model, policy)
    assert len(list(_iter_wrapped(model))) == (4 if policy == "attn+mlp" else 2)
    assert_same(step(model), ref)


def test_find_layers_by_structure() -> None:
    gpt2, llama = make("hf-gpt2-eager"), make("hf-llama-eager")
    assert find_layers(gpt2) is gpt2.transformer.h
    assert find_layers(llama) is llama.model.layers
    assert find_layers(llama, path="model.layers") is llama.model.layers


class _NoStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mixer = nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm(x))
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_unfindable_layers_say_what_exists_and_how_to_name_them() -> None:
    with pytest.raises(ConfigError, match=r"candidates: body \(Sequential of 3 Linear\).*layers='<path>'"):
        apply(_NoStack(), "block")
    with pytest.raises(ConfigError, match=r"not an nn\.ModuleList"):
        apply(_Custom(), "block", layers="blocks.0")


def test_unfindable_sub_blocks_say_what_exists_and_how_to_name_them() -> None:
    model = _Custom()
    apply(model, "block")  # the whole layer needs no sub-modules
    layers = [("_Layer", "forward")] * 3
    assert [(type(m).__name__, a) for m, a in _iter_wrapped(model)] == layers
    with pytest.raises(ConfigError, match=r"children are norm, mixer, fc1, fc2; name it with .*attn='<child>'"):
        apply(model, "attn")
    assert [(type(m).__name__, a) for m, a in _iter_wrapped(model)] == layers  # a failed apply changes nothing
    apply(model, "attn", attn="mixer")
    assert [(type(m).__name__, a) for m, a in _iter_wrapped(model)] == [("Linear", "forward")] * 3
    with pytest.raises(ConfigError, match="core_attn needs"):
        apply(model, "core_attn", attn="mixer")


def test_plan_files_are_applied_and_checked_against_the_model(tmp_path: Path) -> None:
    model = make("gpt-eager")
    path = tmp_path / "plan.json"
    Policy(layers=("block", "mlp"), model="custom").save(path)
    apply(model, path)
    assert wrapped_policies(model) == ["block", "mlp"]
    apply(model, str(path))
    assert wrapped_policies(model) == ["block", "mlp"]
    path.write_text(json.dumps({"policy": {"name": "block", "model": "llama3.1-8b"}}))
    with pytest.raises(ConfigError, match=r"made for 'llama3\.1-8b' but this model is 'custom'"):
        apply(model, path)
    with pytest.raises(ConfigError, match="lists 3 layers but the model has 2"):
        apply(model, Policy(layers=("block",) * 3))


def test_plans_match_hf_models_by_name_or_family() -> None:
    model = make("hf-llama-eager")
    apply(model, Policy("block", model="llama3.1-8b"))  # built from a config: only the family is known
    with pytest.raises(ConfigError, match="made for 'gpt2'"):
        apply(model, Policy("block", model="gpt2"))
    model.config.name_or_path = "meta-llama/Llama-3.1-8B"
    apply(model, Policy("block", model="llama3.1-8b"))


def test_bad_inputs_are_config_errors() -> None:
    model = make("gpt-eager")
    with pytest.raises(ConfigError, match=r"'aten\.nosuchop' is not an operator"):
        apply(model, Policy("block", save_ops=("aten.nosuchop",)))
    with pytest.raises(ConfigError, match="is not a policy"):
        apply(model, "everything")
    hf = make("hf-gpt2-eager")
    hf.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="gradient_checkpointing_disable"):
        apply(hf, "block")
    apply(hf, "none")


def backward_flops(model: nn.Module) -> int:
    """FLOPs of the backward pass alone (recomputed forward matmuls included)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, *batch())
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("spec", [GPT, tiny_gpt(dropout=0.0), LLAMA], ids=["gpt", "gpt-no-dropout", "llama"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_recomputed_flops_equal_the_analytic_model(policy: str, spec: ModelSpec) -> None:
    """Each policy's backward replays exactly the analytic model's ``recomputed`` matmul FLOPs.

    Note: [early stop] non-reentrant checkpoint stops replaying once every tensor the backward needs is back:
    core_attn replays only QK^T, and without dropout a region's last projection is skipped.
    """
    model = build_model(spec, attention="eager")
    base = backward_flops(model)
    apply(model, policy)
    lf = layer_flops(spec, Workload(attention="eager", micro_batch=B, seq_len=S, dtype="fp32", device="cpu"))
    assert backward_flops(model) - base == spec.n_layers * lf.recomputed(policy)


@pytest.mark.parametrize(
    ("save_ops", "recomputed"),
    [
        (("aten.addmm", "aten.bmm"), 0),  # every matmul saved: only cheap ops replay
        (("aten.addmm",), "attn_core"),  # projections saved: QK^T and attention over V replay
        (("aten.bmm",), "projections"),
    ],
    ids=["save-all-matmuls", "save-projections", "save-core"],
)
def test_save_list_keeps_the_named_ops(save_ops: tuple[str, ...], recomputed: int | str) -> None:
    model = make("gpt-eager")
    base = backward_flops(model)
    apply(model, Policy("block", save_ops=save_ops))
    lf = layer_flops(GPT, Workload(attention="eager", micro_batch=B, seq_len=S, dtype="fp32", device="cpu"))
    per_layer = {0: 0, "attn_core": lf.attn_core, "projections": lf.attn_proj + lf.mlp}[recomputed]
    assert backward_flops(model) - base == GPT.n_layers * per_layer


def test_package_reexports_apply_lazily() -> None:
    """``import recompute`` stays torch-free; ``recompute.apply`` works before and after its module loads."""
    code = (
        "import sys, recompute; assert 'torch' not in sys.modules; f = recompute.apply; assert 'torch' in sys.modules; "
        "import recompute.checkpointing as m; assert callable(recompute.apply) and m.find_layers and f is m.apply"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
