"""Policies on mixture-of-experts layers (issue 13 item 5): ``mlp`` wraps the MoE block, ``experts`` its experts.

On transformers' tiny Mixtral and Qwen3-MoE (``test_zoo``'s configs): gradients bit-equal under every
policy; ``experts`` leaves the router out of the replay (it runs once per layer and step, twice under ``mlp``);
the trace keeps exactly the bytes a real step keeps, between ``mlp``'s and ``none``'s. Where ``experts`` cannot
apply (a dense MLP) or cannot be costed (the analytic model), one line says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from recompute import Workload
from recompute.check_gradients import verify
from recompute.checkpointing import _iter_wrapped, apply, find_layers
from recompute.cli import main
from recompute.core.analytic import estimate
from recompute.core.errors import ConfigError
from recompute.core.policy import ALL_POLICIES, MOE_POLICIES, OFFLOAD_POLICIES, POLICIES, Policy
from recompute.core.spec import ModelSpec
from recompute.models.source import build_source, resolve_source
from recompute.trace import trace
from test_zoo import WL, ZOO, config_json, real_saved_per_layer

transformers = pytest.importorskip("transformers")

MOE_KINDS = ["mixtral", "qwen3_moe"]


@pytest.fixture(params=MOE_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def build(kind: str, folder: Path) -> nn.Module:
    torch.manual_seed(0)
    return build_source(resolve_source(str(config_json(kind, folder)))).model.train()


# --- what each policy wraps ---------------------------------------------------------------------------------


def test_mlp_wraps_the_moe_block_and_experts_only_the_experts(kind: str, tmp_path: Path) -> None:
    model = build(kind, tmp_path)
    moe_blocks = [layer.mlp for layer in find_layers(model)]
    apply(model, "mlp")
    assert [m for m, _ in _iter_wrapped(model)] == moe_blocks
    apply(model, "experts")
    assert [(m, name) for m, name in _iter_wrapped(model)] == [(b.experts, "forward") for b in moe_blocks]
    apply(model, "none")
    assert list(_iter_wrapped(model)) == []


@pytest.mark.parametrize("policy", list(ALL_POLICIES))
def test_verify_is_bit_exact(kind: str, policy: str, tmp_path: Path) -> None:
    result = verify(build(kind, tmp_path), policy, micro_batch=2, seq_len=16)
    assert result.passed and result.bit_exact and result.repeatable, result


@pytest.mark.parametrize("policy, runs", [("none", 1), ("experts", 1), ("mlp", 2), ("block", 2)])
def test_router_runs_again_only_when_its_block_is_recomputed(kind: str, policy: str, runs: int, tmp_path: Path) -> None:
    model = build(kind, tmp_path)
    apply(model, policy)
    calls = [0]
    for layer in find_layers(model):
        layer.mlp.gate.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    idx, targets = torch.randint(128, (2, 2, 16))
    model(input_ids=idx, labels=targets).loss.backward()
    assert calls[0] == runs * len(find_layers(model))


# --- bytes --------------------------------------------------------------------------------------------------


def router_kept_bytes(kind: str) -> int:
    """What the router saves for its backward in one layer (fp32, n = b * s tokens, E experts, top-k).

    The softmax output (n, E), the top-k indices (n, k) in int64 and the top-k weights (n, k); Mixtral then
    normalises the weights in place, which keeps the sum (n, 1) and the weights before the division (n, k).
    """
    n, k = WL.micro_batch * WL.seq_len, ZOO[kind]["num_experts_per_tok"]
    e = ZOO[kind].get("num_local_experts") or ZOO[kind]["num_experts"]
    kept = 4 * n * e + 8 * n * k + 4 * n * k
    return kept + (4 * n + 4 * n * k if kind == "mixtral" else 0)


def test_experts_keeps_the_router_output_between_mlp_and_none(kind: str, tmp_path: Path) -> None:
    source = resolve_source(str(config_json(kind, tmp_path)))
    totals = {p: [layer.total for layer in trace(source, WL, p).layers] for p in ("none", "experts", "mlp")}
    assert all(m < x < n for m, x, n in zip(totals["mlp"], totals["experts"], totals["none"]))
    assert [x - m for x, m in zip(totals["experts"], totals["mlp"])] == [router_kept_bytes(kind)] * 2


@pytest.mark.parametrize("policy", ["experts", "mlp"])
def test_trace_equals_a_real_step(kind: str, policy: str, tmp_path: Path) -> None:
    source = resolve_source(str(config_json(kind, tmp_path)))
    traced = [layer.total for layer in trace(source, WL, policy).layers]
    model = build(kind, tmp_path)
    apply(model, policy)
    idx, targets = torch.randint(128, (2, 2, WL.seq_len))
    assert traced == real_saved_per_layer(model, idx, targets)


# --- where experts does not apply -------------------------------------------------------------------------


def test_experts_on_a_dense_model_is_one_line(tmp_path: Path) -> None:
    model = build("llama", tmp_path)
    with pytest.raises(ConfigError, match="LlamaMLP in LlamaDecoderLayer has no 'experts' child") as e:
        apply(model, "experts")
    assert "\n" not in str(e.value) and "use 'mlp'" in str(e.value)
    assert list(_iter_wrapped(model)) == []


def test_dense_layers_of_a_moe_model_take_a_per_layer_policy(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(config_json("qwen3_moe", tmp_path).read_text().replace("{", '{"mlp_only_layers": [1], ', 1))
    torch.manual_seed(0)
    model = build_source(resolve_source(str(path))).model
    with pytest.raises(ConfigError, match="Qwen3MoeMLP in Qwen3MoeDecoderLayer has no 'experts' child"):
        apply(model, "experts")
    assert verify(model, Policy(layers=("experts", "mlp")), micro_batch=2, seq_len=16).bit_exact


def test_the_analytic_model_refuses_experts(capsys: pytest.CaptureFixture[str]) -> None:
    spec = ModelSpec.from_name("gpt2")
    wl = Workload(seq_len=128, micro_batch=1)
    for policy in ("experts", Policy("experts", every=2), Policy(layers=("experts",) + ("none",) * 11)):
        with pytest.raises(ConfigError, match="analytic model has no costs for the mixture-of-experts policy"):
            estimate(spec, wl, policy)
    assert main(["estimate", "--model", "gpt2", "--policy", "experts"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "recompute trace --model <config.json> --policy experts" in err


def test_experts_is_a_policy_name_but_not_a_dense_one() -> None:
    assert "experts" in MOE_POLICIES and "experts" not in POLICIES  # the planner searches POLICIES
    assert list(ALL_POLICIES) == [*POLICIES, *MOE_POLICIES, *OFFLOAD_POLICIES]
    pol = Policy(layers=("experts", "mlp", "experts"))
    assert Policy.from_dict(pol.to_dict()) == pol and Policy.parse("experts") == Policy("experts")
    assert pol.describe() == "per-layer mlp x1, experts x2"


# --- a list of experts --------------------------------------------------------------------------------------


class _ListMoE(nn.Module):
    """Top-1 routing over a list of expert modules, called one by one (the pre-transformers-5 layout)."""

    def __init__(self, h: int, n_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(h, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h)) for _ in range(n_experts)
        )

    def forward(self, x: Tensor) -> Tensor:
        weight, choice = self.gate(x).softmax(-1).max(-1)  # (b, s)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            out[rows] = expert(x[rows]) * weight[rows].unsqueeze(-1)
        return out


class _Layer(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.moe = _ListMoE(h, 3)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.moe(self.norm(x))


class _TinyListMoE(nn.Module):
    """recompute's factory convention: ``forward(idx, targets) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_Layer(16) for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_list_of_experts_gets_each_expert_wrapped() -> None:
    torch.manual_seed(0)
    model = _TinyListMoE()
    assert verify(model, "experts", seq_len=8).bit_exact
    assert [m for m, _ in _iter_wrapped(model)] == [e for layer in model.layers for e in layer.moe.experts]
