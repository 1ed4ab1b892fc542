"""``trace_compiled``: what a ``torch.compile``d step saves, traced on fake tensors, held to real compiled steps.

Fast tests compile with the capture backend (dynamo and AOTAutograd's partitioners, no Inductor): the fake trace
against the same compiled step on real tensors, whose saved tensors are read back from its autograd graph
(exact). The slow test holds the trace to a real Inductor step (``benchmarks/compiled_fidelity.py`` runs them
all: docs/compiled.md).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import smoke
from recompute import Policy, Workload
from recompute.bench import allocator_peak
from recompute.bench._allocator import _peak
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.models.source import ModelSource
from recompute.trace import capture_backend, saved_by_compiled, saved_by_eager, trace_budgets, trace_compiled
from recompute.trace._compiled import _fused_away, _in_place, _Live
from tiny import tiny_gpt, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compiled_fidelity
import compiled_peak

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
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_per_block_beside_the_chunked_loss_is_the_real_step_exactly(model: str) -> None:
    """Compiled per block, the head and loss run eagerly, so the chunked loss runs beside the blocks: its chunks'
    logits are saved and freed inside the forward (their backward is taken there), and only what the step still
    holds counts (Note: [saved and still held]); the blocks save what they save under the full loss."""
    source = {"gpt": GPT, "llama": LLAMA}[model]
    chunked = dataclasses.replace(WL, loss="chunked", loss_chunk=16)
    fake, full = (trace_compiled(source, w, PLAN, budget=0.5, per_block=True) for w in (chunked, WL))
    backend, _ = capture_backend("min_cut", 0.5)
    regions, every = compiled_fidelity.real_saved(source, chunked, PLAN, backend, None, per_block=True)
    assert (sum(fake.layers), fake.saved) == (regions, every)
    assert fake.layers == full.layers and 0 < fake.other < full.other
    assert source.spec is not None
    logits = WL.micro_batch * WL.seq_len * source.spec.vocab * 4  # fp32: the full loss keeps at least these
    assert full.other - fake.other >= logits


@fake_models
@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
def test_a_transformers_model_without_a_cache_takes_the_real_steps_path(per_block: bool) -> None:
    """Note: [the eager part's path]: with use_cache=False transformers reads the position ids to choose its
    attention path. Compiled whole, the real step's dynamo cannot read them and takes the general path (a mask to
    every layer); per block the mask is made eagerly from real position ids, so there is none. Either way the trace
    saves what the real step saves, and the eager step it is weighed against is the eager trace's."""
    pytest.importorskip("transformers")
    source = ModelSource.from_config({**smoke.LLAMA, "use_cache": False}, name="hf-llama")
    backend, _ = capture_backend("min_cut", None)
    got = trace_budgets(source, WL, PLAN, (None,), eager=True, per_block=per_block)[0]
    regions, every = compiled_fidelity.real_saved(source, WL, PLAN, backend, None, per_block=per_block)
    assert (sum(got.layers) if per_block else got.saved) == regions
    assert every is None or got.saved == every
    built, idx, targets = compiled_fidelity.real_model(source, WL, PLAN)  # real tensors: real position ids
    weights = [*built.model.parameters(), *built.model.buffers(), idx, targets]
    assert got.eager_saved == saved_by_eager(lambda: built.loss_fn(built.model, idx, targets), exclude=weights)


@fake_models
def test_per_block_budget_is_a_fraction_of_each_block() -> None:
    """The blocks of one kind save alike but for what the layers share (the rotary tables, inputs of every block:
    the first block saves them, whatever the budget); a budget cuts each block's, and the per-block step differs
    from the whole model's (the partitioner sees one block, not the model)."""
    full, half = (trace_compiled(LLAMA, WL, budget=b, per_block=True) for b in (1.0, 0.5))
    assert full.layers[0] - full.layers[1] == half.layers[0] - half.layers[1] > 0
    assert half.layers[1] < full.layers[1] and half.other == full.other  # the eager head: no budget reaches it
    assert half.flops >= full.flops  # what the budget drops is recomputed, never less
    assert not full.eager_layers and not full.eager_note and not any("ran no compiled graph" in n for n in full.notes)


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
    assert got.eager_layers == tuple(range(limit, 10)) and eager == [got.eager_note]
    assert got.eager_note.startswith(f"layers {', '.join(str(i) for i in range(limit, 10))} ran")


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


PEAK_CASES = [("gpt", "none", None), ("gpt", "block", 0.5), ("llama", "plan", None), ("hf-llama", "none", 0.5)]


@fake_models
@pytest.mark.parametrize(("model", "policy", "budget"), PEAK_CASES, ids=lambda v: str(v))
def test_the_compiled_peak_is_the_real_step_of_the_same_graphs(model: str, policy: str, budget: float | None) -> None:
    """The graphs' own liveness on fake tensors against the CPU allocator's peak over a real step of the same
    graphs (the capture backend on real tensors): equal, or the real step 12 bytes above (a CPU kernel's own
    scratch, which no dispatch mode sees)."""
    source = {"gpt": GPT, "llama": LLAMA}.get(model) or hf_llama()
    pol = PLAN if policy == "plan" else Policy.parse(policy)
    traced = trace_budgets(source, WL, pol, (budget,), peak=True, unfused=True)[0].peak
    real = compiled_peak.real_peak(source, WL, pol, capture_backend("min_cut", budget)[0], budget)["peak"]
    assert traced is not None and 0 <= real - traced <= 64


@fake_models
def test_inductors_fusion_leaves_out_intermediate_buffers() -> None:
    """The compiled peak (min cut) leaves out what Inductor fuses away, so it is below the graphs' own; the default
    partition's is the real ``aot_eager_default_partitioner`` step's, which runs its graphs as they are."""
    fused = trace_compiled(GPT, WL, budget=0.5, peak=True)
    unfused = trace_budgets(GPT, WL, "none", (0.5,), peak=True, unfused=True)[0]
    assert fused.saved == unfused.saved and fused.peak is not None and unfused.peak is not None
    assert fused.peak < unfused.peak
    default = trace_compiled(GPT, WL, partitioner="default", peak=True)
    assert (
        default.peak == compiled_peak.real_peak(GPT, WL, Policy("none"), "aot_eager_default_partitioner", None)["peak"]
    )
    with pytest.raises(ConfigError, match="unfused is the peak's"):
        trace_budgets(GPT, WL, unfused=True)


@pytest.mark.skipif(
    not hasattr(TorchDispatchMode, "ignore_compile_internals"),
    reason="the counting mode runs only where dynamo runs compiled code under a mode (2.8 on; None before)",
)
def test_the_counting_mode_moves_a_buffer_reused_in_place_and_counts_nested_outputs() -> None:
    live = _Live((), cuda=False, fused=True)
    with live:
        a = torch.empty(1000, dtype=torch.uint8)
        live.skip = True  # b is made over a's buffer (Inductor's in-place reuse)
        b = torch.empty(1000, dtype=torch.uint8)
        live.skip = False
        live.moved(a, b)
        del a
        assert (live.now, live.peak) == (1000, 1000)  # a's bytes are b's
        del b
        assert live.now == 0
        x = torch.randn(1000)
        replay = torch.ops.higher_order.run_and_save_rng_state
        state, (out, mask) = replay(torch.ops.aten.native_dropout.default, x, 0.5, True)
        assert live.now == 4000 + state.nbytes + out.nbytes + mask.nbytes  # (state, (output, mask)) all counted


def test_what_inductor_fuses_and_reuses_in_place() -> None:
    """``_fused_away``: a pointwise op read only by pointwise ops has no buffer; one read by a matmul (an
    external kernel) or returned has. ``_in_place``: a pointwise result takes over the buffer of an input it
    reads last, of its size, made in the graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = x * 2  # read by exp only: fused away
        b = torch.exp(a)  # read by a matmul: a buffer
        c = b @ w
        d = c + 1  # read by a matmul, and c's last reader, of c's size: c's buffer
        return (d @ w).sum()

    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    fused = _fused_away(gm)
    assert {n.name for n in fused} == {"mul"}
    assert {a.name: b.name for a, b in _in_place(gm, fused).items()} == {"add": "mm"}

    def softmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x - 1)  # read by a sum and a division: on the CPU Inductor computes exp once, in a buffer
        return (e / e.sum(-1, keepdim=True)) @ w

    gm = make_fx(softmax)(torch.randn(4, 4), torch.randn(4, 4))
    assert {n.name for n in _fused_away(gm)} == {"sub"}
    assert {n.name for n in _fused_away(gm, cuda=True)} == {"sub", "exp"}  # on a GPU, computed again in each


def test_allocator_peak_is_the_most_allocated_at_once() -> None:
    def step() -> None:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        del a, b
        c = torch.empty(1 << 20, dtype=torch.uint8)
        del c

    got = allocator_peak(step)
    assert (got.peak, got.end) == (3 << 20, 0)


def test_an_allocator_trace_without_memory_events_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="no CPU memory event"):
        _peak({"traceEvents": [{"name": "aten::mm", "ts": 1}]})


@pytest.mark.slow
@fake_models
@pytest.mark.parametrize("per_block", [False, True], ids=["whole", "per-block"])
def test_the_compiled_peak_is_the_real_inductor_steps(per_block: bool) -> None:
    """A tiny Llama's traced compiled peak against the CPU allocator's peak over a real Inductor step: equal,
    compiled whole or per block (at published width: ``benchmarks/compiled_peak.py``, docs/compiled.md)."""
    traced = trace_compiled(LLAMA, WL, peak=True, per_block=per_block).peak
    assert traced == compiled_peak.real_peak(LLAMA, WL, Policy("none"), "inductor", None, per_block)["peak"]


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
    traced = trace_compiled(source, wl, "block", budget=0.5, peak=True)
    assert (got["saved"], got["peak"]) == (traced.saved, traced.peak)
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
        (["--compiled", "--loss", "chunked"], "(per_block=True, --compiled block) or use the full --loss"),
    ],
    ids=["budget-2", "budget-without-compiled", "scale-from", "budget-default-partitioner", "chunked-whole"],
)
def test_bad_compiled_options_exit_2_in_one_line(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "--model", "gpt2", "--seq-len", "32", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
