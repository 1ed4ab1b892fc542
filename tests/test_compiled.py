"""``trace_compiled``: what a ``torch.compile``d step saves, traced on fake tensors, held to real compiled steps.

Fast tests compile with the capture backend (dynamo and AOTAutograd's partitioners, no Inductor): the fake trace
against the same compiled step on real tensors, whose saved tensors are read back from its autograd graph
(exact). The slow test holds the trace to a real Inductor step (``benchmarks/compiled_fidelity.py`` runs them
all: docs/compiled.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import smoke
from recompute import Policy, Workload
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.models.source import ModelSource
from recompute.trace import capture_backend, saved_by_compiled, trace_compiled
from tiny import tiny_gpt, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compiled_fidelity

WL = Workload(micro_batch=2, seq_len=32, dtype="fp32", device="cpu")
GPT = ModelSource.preset(tiny_gpt())  # dropout 0.1: its masks are saved values
LLAMA = ModelSource.preset(tiny_llama())
PLAN = Policy("none", layers=("block", "core_attn"))


OLD_DYNAMO = torch.__version__ < "2.7"
"""torch 2.6's dynamo refuses a model of fake tensors made outside it (Note: [fake models under dynamo])."""
fake_models = pytest.mark.skipif(OLD_DYNAMO, reason="torch 2.6's dynamo does not compile a model of fake tensors")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def hf_llama() -> ModelSource:
    pytest.importorskip("transformers")
    return ModelSource.from_config(smoke.LLAMA, name="hf-llama")


CASES = [
    ("gpt", "none", "default", None),
    ("gpt", "block", "min_cut", 0.5),
    ("llama", "plan", "min_cut", None),
    ("hf-llama", "plan", "min_cut", 0.1),
]


@fake_models
@pytest.mark.parametrize(("model", "policy", "partitioner", "budget"), CASES, ids=lambda v: str(v))
def test_fake_trace_is_the_real_compiled_step_exactly(
    model: str, policy: str, partitioner: str, budget: float | None
) -> None:
    source = {"gpt": GPT, "llama": LLAMA}.get(model) or hf_llama()
    pol = PLAN if policy == "plan" else Policy.parse(policy)
    fake = trace_compiled(source, WL, pol, partitioner=partitioner, budget=budget)
    backend, pairs = capture_backend(partitioner, budget)
    real, _ = compiled_fidelity.real_saved(source, WL, pol, backend, None)
    assert fake.saved == real
    assert fake.graphs == len(pairs) == 1
    assert all(fake.layers)  # every layer's values found by its module path


@fake_models
def test_a_smaller_budget_saves_less_and_block_keeps_each_layer_input() -> None:
    full, tenth = (trace_compiled(LLAMA, WL, budget=b).saved for b in (1.0, 0.1))
    assert full > tenth > 0
    block = trace_compiled(LLAMA, WL, "block")
    spec = LLAMA.spec
    assert spec is not None
    layer_input = WL.micro_batch * WL.seq_len * spec.hidden * 4  # (b, s, h) fp32: what layer 1 recomputes from
    # and the random-number state its attention kernel (tagged nondeterministic) replays from
    assert block.layers[1] == layer_input + torch.get_rng_state().numel()
    assert block.saved < full


@fake_models
@pytest.mark.parametrize(("model", "policy", "partitioner", "budget"), CASES, ids=lambda v: str(v))
def test_per_block_trace_is_the_real_per_block_step_exactly(
    model: str, policy: str, partitioner: str, budget: float | None
) -> None:
    """Each layer compiled on its own (torchtitan's way): the layers' bytes are what the real step's compiled
    regions hold, and the whole step's (the eager embedding and head too) what its autograd saves."""
    source = {"gpt": GPT, "llama": LLAMA}.get(model) or hf_llama()
    pol = PLAN if policy == "plan" else Policy.parse(policy)
    fake = trace_compiled(source, WL, pol, partitioner=partitioner, budget=budget, per_block=True)
    backend, pairs = capture_backend(partitioner, budget)
    regions, every = compiled_fidelity.real_saved(source, WL, pol, backend, None, per_block=True)
    assert (sum(fake.layers), fake.saved) == (regions, every)
    assert fake.per_block and all(fake.layers) and fake.other > 0  # the eager head saves its input
    assert fake.graphs == len(pairs) == (1 if policy != "plan" else 2)  # one graph per kind of block


@fake_models
def test_per_block_budget_is_a_fraction_of_each_block() -> None:
    """The blocks of one kind save alike but for what the layers share (the rotary tables, inputs of every block:
    the first block saves them, whatever the budget); a budget cuts each block's, and the per-block step differs
    from the whole model's (the partitioner sees one block, not the model)."""
    full, half = (trace_compiled(LLAMA, WL, budget=b, per_block=True) for b in (1.0, 0.5))
    assert full.layers[0] - full.layers[1] == half.layers[0] - half.layers[1] > 0
    assert half.layers[1] < full.layers[1] and half.other == full.other  # the eager head: no budget reaches it
    assert half.flops >= full.flops  # what the budget drops is recomputed, never less
    assert not any("ran no compiled graph" in n for n in full.notes)


class _Scaled(torch.nn.Module):
    """A block whose int attribute differs by layer: dynamo guards on it and compiles again for each."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.lin = k, torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.lin(x)) * self.k


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)
        self.layers = torch.nn.ModuleList(_Scaled(i + 1) for i in range(10))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@fake_models
def test_per_block_says_which_layers_ran_eagerly() -> None:
    """Past dynamo's recompile limit (8) the blocks run eagerly: the trace says which, not silently."""
    got = trace_compiled(ModelSource(name="net", origin="a test", factory=_Net), WL, per_block=True)
    limit = torch._dynamo.config.recompile_limit if hasattr(torch._dynamo.config, "recompile_limit") else 8
    eager = [n for n in got.notes if "ran no compiled graph" in n]
    assert len(eager) == 1 and eager[0].startswith(f"layers {', '.join(str(i) for i in range(limit, 10))} ran")


def test_saved_by_compiled_refuses_an_eager_step() -> None:
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ConfigError, match="no compiled region"):
        saved_by_compiled((x * x).sum())


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"budget": 2.0}, "a fraction in \\(0, 1\\], got 2.0"),
        ({"budget": 0}, "a fraction in \\(0, 1\\], got 0"),
        ({"partitioner": "default", "budget": 0.5}, "min-cut partitioner's knob"),
        ({"partitioner": "greedy"}, "one of min_cut, default, got 'greedy'"),
    ],
    ids=["budget-2", "budget-0", "budget-default", "unknown-partitioner"],
)
def test_bad_options_are_refused_in_one_line(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        trace_compiled(GPT, WL, **kwargs)  # type: ignore[arg-type]


def test_what_the_compiled_trace_does_not_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="a CUDA step is traced with Inductor's min cut"):
        trace_compiled(GPT, Workload(seq_len=32, device="cuda"), partitioner="default")
    with pytest.raises(ConfigError, match="offload"):
        trace_compiled(GPT, WL, "offload")


@pytest.mark.skipif(not OLD_DYNAMO, reason="torch 2.6's refusal")
def test_torch_2_6_refuses_in_one_line() -> None:
    with pytest.raises(ConfigError, match="does not compile a model made of fake tensors"):
        trace_compiled(GPT, WL)
    with pytest.raises(ConfigError, match="does not compile a model made of fake tensors"):
        trace_compiled(GPT, WL, per_block=True)


@pytest.mark.slow
@fake_models
def test_trace_is_the_real_inductor_step() -> None:
    """One Inductor compile of a tiny Llama under a budget: the partition it runs is the one traced."""
    fake = trace_compiled(LLAMA, WL, PLAN, budget=0.5)
    real, _ = compiled_fidelity.real_saved(LLAMA, WL, PLAN, "inductor", 0.5)
    assert abs(fake.saved - real) <= 0.02 * real


@pytest.mark.slow
@fake_models
def test_per_block_trace_is_the_real_inductor_step() -> None:
    fake = trace_compiled(LLAMA, WL, PLAN, budget=0.5, per_block=True)
    regions, every = compiled_fidelity.real_saved(LLAMA, WL, PLAN, "inductor", 0.5, per_block=True)
    assert abs(sum(fake.layers) - regions) <= 0.02 * regions and abs(fake.saved - every) <= 0.02 * every


@fake_models
def test_trace_compiled_at_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(smoke.LLAMA))
    argv = ["trace", "--model", str(config), "--seq-len", "32", "--dtype", "fp32", "--policy", "block"]
    assert main([*argv, "--compiled", "--memory-budget", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["partitioner"], got["budget"], got["policy"]) == ("min_cut", 0.5, "block")
    source = ModelSource.from_config(config)
    wl = Workload(seq_len=32, dtype="fp32", device="cpu")
    assert got["saved"] == trace_compiled(source, wl, "block", budget=0.5).saved
    assert main([*argv, "--compiled", "block", "--memory-budget", "0.5", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["per_block"] and got["saved"] == trace_compiled(source, wl, "block", budget=0.5, per_block=True).saved


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--compiled", "--memory-budget", "2"], "a fraction in (0, 1], got 2.0"),
        (["--memory-budget", "0.5"], "--memory-budget is an option of the compiled trace; add --compiled"),
        (["--compiled", "--scale-from", "1"], "drop --scale-from"),
        (["--compiled", "--partitioner", "default", "--memory-budget", "0.5"], "min-cut partitioner's knob"),
    ],
    ids=["budget-2", "budget-without-compiled", "scale-from", "budget-default-partitioner"],
)
def test_bad_compiled_options_exit_2_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "--model", "gpt2", "--seq-len", "32", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
