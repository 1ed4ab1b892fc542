"""torch.compile's memory budget beside recompute's plan (issue 40 item 3): the pieces held to independent counts.

- one trace partitioned under several budgets equals a trace per budget;
- the partitioned graphs' FLOPs equal ``FlopCounterMode`` over a real eager step where nothing is recomputed;
- the eager saved bytes equal ``recompute trace``'s tracker; a CUDA LayerNorm keeps fp32 statistics;
- ``plan --memory-budget``: every option priced as documented, the cheapest that fit checked by a trace of their
  own (the eager step's window counted as the compiled step's is the tracker's; not under FSDP),
  the cheapest that fits chosen, the plan file carries the budget and ``apply`` sets it; bad values refused in one
  line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import smoke
from recompute import Policy, Workload
from recompute.checkpointing import apply
from recompute.cli import main
from recompute.compile_plan import _bandwidth, render_compiled_plan, with_memory_budget
from recompute.core.errors import ConfigError
from recompute.core.export import export
from recompute.core.plan import loss_frontier, plan, uniform_point
from recompute.core.pricing import choose_device
from recompute.models.source import ModelSource, build_source
from recompute.planning import cost_tables
from recompute.runtime import random_batch
from recompute.trace import trace, trace_budgets, trace_compiled, traces_compiled_peaks
from recompute.trace._compiled import _cuda_layer_norm
from tiny import tiny_llama

pytestmark = pytest.mark.skipif(torch.__version__ < "2.7", reason="torch 2.6's dynamo does not compile fake models")

WL = Workload(micro_batch=2, seq_len=32, dtype="fp32", device="cpu")
LLAMA = ModelSource.preset(tiny_llama())


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    budget = torch._functorch.config.activation_memory_budget
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = budget


def test_one_trace_under_several_budgets_is_a_trace_per_budget() -> None:
    many = trace_budgets(LLAMA, WL, "none", (1.0, 0.5, 0.1))
    for got in many[1:]:
        one = trace_compiled(LLAMA, WL, "none", budget=got.budget)
        assert (got.layers, got.other, got.flops, got.recomputed_bytes) == (
            one.layers,
            one.other,
            one.flops,
            one.recomputed_bytes,
        )
    assert many[0].saved > many[1].saved > many[2].saved
    assert many[0].flops < many[1].flops < many[2].flops


def test_graph_flops_are_the_real_eager_steps_where_nothing_is_recomputed() -> None:
    """The compiled step under PyTorch's default partition recomputes no matmul: its forward and backward graphs'
    FLOPs are those ``FlopCounterMode`` counts over a real eager step of the same model (real tensors)."""
    compiled = trace_compiled(LLAMA, WL, "none")
    built = build_source(LLAMA, attention=WL.attention, dtype=torch.float32, device="cpu")
    built.model.train()
    batch = random_batch(built.vocab, WL.micro_batch, WL.seq_len)
    with FlopCounterMode(display=False) as counter:
        built.loss_fn(built.model, *batch)[1].backward()
    assert compiled.flops == counter.get_total_flops()
    block = trace_compiled(LLAMA, WL, "block")  # the checkpointed layers' matmuls run again, less than a forward
    assert compiled.flops < block.flops < compiled.flops * 4 / 3


@pytest.mark.skipif(not traces_compiled_peaks(), reason="a compiled step's peak is traced from PyTorch 2.8")
@pytest.mark.parametrize("policy", ["none", "block"])
def test_the_eager_steps_window_is_the_eager_traces(policy: str) -> None:
    """Note: [checking a compiled peak]: the eager step's window, counted as the compiled step's peak is, equals the
    eager trace's (MemTracker's) largest forward or backward phase less what exists before the step."""
    got = trace_budgets(LLAMA, WL, policy, (1.0,), eager=True, peak=True)[0]
    t = trace(LLAMA, WL, policy)
    window = max(v for k, v in t.phases.items() if k != "optimizer step") - (t.parameters + t.optimizer + t.other)
    assert got.eager_window == window and got.peak is not None and got.peak < window


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eager_saved_bytes_are_the_trackers(precision: str) -> None:
    wl = Workload(micro_batch=2, seq_len=32, dtype="fp32" if precision == "fp32" else "bf16", device="cpu")
    got = trace_budgets(LLAMA, wl, "none", (1.0,), eager=True)[0]
    inputs = 2 * wl.micro_batch * wl.seq_len * 8  # the tracker counts the int64 token ids and targets autograd saves
    assert got.eager_saved == trace(LLAMA, wl, "none").activations - inputs


def test_cuda_layer_norm_keeps_fp32_statistics_and_computes_layer_norm() -> None:
    x = torch.randn(2, 8, 64).to(torch.bfloat16)
    w, b = torch.randn(64), torch.randn(64)
    out, mean, rstd = _cuda_layer_norm(x, [64], w, b, 1e-5)
    assert (out.dtype, mean.dtype, rstd.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert tuple(mean.shape) == (2, 8, 1)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x.float(), [64], w, b, 1e-5).to(torch.bfloat16))
    _ref_out, ref_mean, ref_rstd = torch.ops.aten.native_layer_norm(x.float(), [64], w, b, 1e-5)
    torch.testing.assert_close((mean, rstd), (ref_mean, ref_rstd))


def test_a_cuda_step_keeps_flash_attentions_outputs_in_512_byte_blocks() -> None:
    wl = Workload(micro_batch=1, seq_len=64, dtype="bf16", device="cuda")
    cuda = trace_compiled(LLAMA, wl)
    cpu = trace_compiled(LLAMA, Workload(micro_batch=1, seq_len=64, dtype="bf16", device="cpu"))
    assert cuda.device == "cuda" and cuda.saved != cpu.saved
    assert all(b % 512 == 0 for b in cuda.layers)
    assert any("FlashAttention" in n for n in cuda.notes)


def _planned(budget: float) -> tuple[object, object, Workload]:
    wl = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu")
    found = cost_tables(tiny_llama(), wl, losses=())
    return plan(found.tables, budget), found, wl


def test_the_plan_weighs_the_budget_knob_beside_its_policies() -> None:
    eager, _, wl = _planned(budget=1e12)
    none = eager.uniform["none"]
    tight = (none.peak + eager.uniform["block"].peak) / 2
    eager, _, wl = _planned(budget=tight)
    chosen, compiled = with_memory_budget(eager, tiny_llama(), wl, budgets=(1.0, 0.3), assignments=2)
    assert len(compiled.options) == 4  # recompute nothing and the eager plan, each under both budgets
    for o in compiled.options:  # the documented price (no floor given): eager saved bytes out, compiled ones in
        substituted = o.eager_peak - o.eager_saved + o.saved  # and where checked, the larger of it and the trace's
        assert o.peak == (substituted if o.checked is None else max(substituted, o.checked))
    assert compiled.chosen is not None  # Note: [checking a compiled peak], where this PyTorch traces a peak
    assert (compiled.chosen.checked is not None) == traces_compiled_peaks()
    assert any(n.startswith("compiled peaks checked by a trace of their own") for n in compiled.notes) == (
        traces_compiled_peaks()
    )
    for layers in {o.layers for o in compiled.options}:  # a smaller budget recomputes more, never less
        by_budget = sorted((o for o in compiled.options if o.layers == layers), key=lambda o: -o.budget)
        assert [o.extra_flops for o in by_budget] == sorted(o.extra_flops for o in by_budget)
        assert by_budget[0].saved >= by_budget[-1].saved
    nothing = next(o for o in compiled.options if not o.recomputes and o.budget == 1.0)
    assert (nothing.extra_flops, nothing.extra_bytes, nothing.overhead) == (0, 0, 0.0)
    fitting = [o for o in compiled.options if o.peak <= tight]
    assert compiled.chosen is not None and compiled.chosen in fitting
    assert compiled.chosen.overhead == min(o.overhead for o in fitting)
    assert chosen.peak == compiled.chosen.peak <= tight
    assert chosen.memory_budget == (compiled.chosen.budget if compiled.chosen.budget < 1.0 else None)
    assert "use " in compiled.advice
    assert ("traced (checked)" in render_compiled_plan(compiled)) == traces_compiled_peaks()


def test_no_compiled_peak_is_checked_under_fsdp() -> None:
    """Note: [checking a compiled peak]: the traced step is the unsharded model's, whose compiled backward holds
    every gradient at its end; an FSDP rank does not, so its options keep the substitution, and the plan says so."""
    wl = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu", fsdp=True, dp=2)
    eager = plan(cost_tables(tiny_llama(), wl, losses=()).tables, 1e12)
    _, compiled = with_memory_budget(eager, tiny_llama(), wl, budgets=(1.0,), assignments=1)
    assert compiled.options and all(o.checked is None for o in compiled.options)
    assert any(n.startswith("compiled peaks not checked under FSDP") for n in compiled.notes)
    assert not any("is unchecked" in n for n in compiled.notes)


def test_the_plan_weighs_the_budget_per_block_as_torchtitan_compiles() -> None:
    """Per block each option's saved bytes are the per-block trace's, its peak the documented swap, and its
    recomputed FLOPs are priced against the plan's own step (the eager head is in no block's graph)."""
    eager, _, wl = _planned(budget=1e12)
    tight = (eager.uniform["none"].peak + eager.uniform["block"].peak) / 2
    eager, _, wl = _planned(budget=tight)
    _, compiled = with_memory_budget(eager, tiny_llama(), wl, budgets=(1.0, 0.3), assignments=2, per_block=True)
    assert compiled.per_block and compiled.to_dict()["per_block"] and len(compiled.options) == 4
    chosen = compiled.chosen
    assert chosen is not None and (chosen.checked is not None) == traces_compiled_peaks()
    if chosen.checked is not None:  # Note: [checking a compiled peak]: its own per-block trace, by the formula
        pol = Policy(layers=chosen.layers) if chosen.checkpoints else "none"
        t = trace_budgets(tiny_llama(), wl, pol, (chosen.budget,), eager=True, peak=True, per_block=True)[0]
        assert t.peak is not None and t.eager_window is not None
        assert chosen.checked == chosen.eager_peak - t.eager_window + t.peak  # no tables given: no floor
        assert "traced (checked)" in render_compiled_plan(compiled)
    for o in compiled.options:
        pol = Policy(layers=o.layers) if any(x != "none" for x in o.layers) else "none"
        traced = trace_compiled(tiny_llama(), wl, pol, budget=o.budget, per_block=True)
        assert (o.saved, o.kept) == (traced.saved, traced.layers)
        substituted = o.eager_peak - o.eager_saved + o.saved
        assert o.peak == (substituted if o.checked is None else max(substituted, o.checked))
        # Note: [pricing a compiled option]: the eager plan's price of the assignment, and what the budget
        # recomputes beyond it under budget 1.0 (per FLOP of the plan's own step, the bytes at the bandwidth)
        own = next(x for x in compiled.options if x.layers == o.layers and x.loss == o.loss and x.budget == 1.0)
        point = next(p for p in (*eager.frontier, *eager.uniform.values()) if (p.layers, p.loss) == (o.layers, o.loss))
        flops, written = o.extra_flops - own.extra_flops, o.extra_bytes - own.extra_bytes
        if eager.timed:
            rate, bandwidth = eager.model_cost / eager.model_flops, _bandwidth(eager)
            assert own.seconds == point.cost
            assert o.seconds == pytest.approx(point.cost + flops * rate + (written / bandwidth if bandwidth else 0))
        else:
            assert o.overhead == pytest.approx(point.overhead + flops / eager.model_flops)
    nothing = next(o for o in compiled.options if not o.recomputes and o.budget == 1.0)
    assert (nothing.extra_flops, nothing.overhead) == (0, 0.0)
    assert any(o.extra_flops > 0 for o in compiled.options if o.budget < 1.0)


def test_per_block_weighs_the_chunked_loss_beside_the_compiled_blocks() -> None:
    """Per block the loss is eager, so the chunked loss runs beside the compiled blocks: its options come from the
    chunked loss's own table (its eager peak, floor and step time), their saved bytes from the per-block trace of
    the chunked step; the whole model's compile weighs the full loss alone."""
    wl = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu")
    found = cost_tables(tiny_llama(), wl, device=choose_device(gpu="h100-80gb", compiled=True), losses=("chunked",))
    full, chunked = found.tables
    assert (full.workload["loss"], chunked.workload["loss"]) == ("full", "chunked")
    eager = plan(found.tables, 1e12)
    assert eager.timed
    _, compiled = with_memory_budget(
        eager, tiny_llama(), wl, tables=found.tables, budgets=(1.0, 0.3), assignments=2, per_block=True
    )
    losses = {o.loss for o in compiled.options}
    assert losses == {"full", "chunked"}
    step = dataclasses.replace(wl, loss="chunked", loss_chunk=chunked.workload["loss_chunk"])
    for o in (o for o in compiled.options if o.loss == "chunked"):
        pol = Policy(layers=o.layers) if any(x != "none" for x in o.layers) else "none"
        traced = trace_budgets(tiny_llama(), step, pol, (o.budget,), eager=True, per_block=True)[0]
        assert (o.saved, o.eager_saved, o.kept) == (traced.saved, traced.eager_saved, traced.layers)
        assert o.eager_peak == chunked.compose(o.layers).peak  # the chunked step's own eager peak
        floor = max(chunked.fixed.values(), default=0.0)
        assert o.peak == max(floor, o.eager_peak - o.eager_saved + o.saved)
        assert o.recomputes and "chunked loss" in o.label()
    # Note: [pricing a compiled option], in time: the eager plan's price of the layers in their loss mode (the
    # chunked loss's own step time included), and what the budget recomputes beyond them at the step's FLOP rate
    rate, bandwidth = eager.model_cost / eager.model_flops, _bandwidth(eager)
    for o in compiled.options:
        point = uniform_point(found.tables, "none", o.loss) if not o.checkpoints else None
        point = point or next(p for p in loss_frontier(found.tables, o.loss) if p.layers == o.layers)
        own = next(x for x in compiled.options if (x.layers, x.loss, x.budget) == (o.layers, o.loss, 1.0))
        flops, written = o.extra_flops - own.extra_flops, o.extra_bytes - own.extra_bytes
        assert o.seconds == pytest.approx(point.cost + flops * rate + (written / bandwidth if bandwidth else 0))
        assert o.budget < 1.0 or o.seconds == point.cost
    nothing = {o.loss: o for o in compiled.options if not any(x != "none" for x in o.layers) and o.budget == 1.0}
    assert nothing["chunked"].peak < nothing["full"].peak  # the eager head no longer keeps the logits
    assert nothing["chunked"].kept == nothing["full"].kept  # the blocks save what they save either way
    _, whole = with_memory_budget(eager, tiny_llama(), wl, tables=found.tables, budgets=(1.0,), assignments=2)
    assert {o.loss for o in whole.options} == {"full"}


def test_per_block_needs_a_memory_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt2", "--budget", "70GiB", "--per-block"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "add --memory-budget" in err


def test_the_plan_file_carries_the_budget_and_apply_sets_it(tmp_path: Path) -> None:
    policy = Policy("none", layers=("none", "none"), memory_budget=0.4)
    assert Policy.from_dict(policy.to_dict()) == policy
    path = tmp_path / "policy.json"
    policy.save(path)
    model = build_source(LLAMA, attention="flash", dtype=torch.float32, device="cpu").model
    apply(model, str(path))
    assert torch._functorch.config.activation_memory_budget == 0.4


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_a_policys_memory_budget_is_a_fraction(bad: object) -> None:
    with pytest.raises(ConfigError, match="a fraction in"):
        Policy("none", memory_budget=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["abc", "0", "0.5,2", ""])
def test_plan_refuses_a_bad_memory_budget_in_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt2", "--budget", "70GiB", "--memory-budget", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--memory-budget takes auto or fractions" in err


def test_plan_memory_budget_at_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(smoke.LLAMA))
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(config), "--seq-len", "64", "--device", "cpu", "--budget", "1TiB"]
    assert main([*argv, "--memory-budget", "1.0,0.5", "-o", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["compiled"]["options"] and got["compiled"]["chosen"]["budget"] == 1.0  # everything fits: no knob
    assert json.loads(out.read_text())["compiled"] == got["compiled"]
    assert {o["loss"] for o in got["compiled"]["options"]} == {"full"}  # the whole model takes the full loss only
    assert main([*argv, "--memory-budget", "1.0,0.5", "--per-block", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["compiled"]
    assert got["per_block"] and {o["loss"] for o in got["options"]} == {"full", "chunked"}


def test_torchtitan_exports_the_memory_budget_mode() -> None:
    wl = Workload(micro_batch=1, seq_len=1024)
    found = cost_tables("gpt2", wl, losses=())
    eager = plan(found.tables, 1e12)
    none = dataclasses.replace(eager, memory_budget=0.5)  # the plan recomputes nothing: the knob alone
    out = export(none, found.tables, "torchtitan")
    assert out.exact and 'mode = "memory_budget"\nmemory_budget = 0.5\n' in out.text and "enable = true" in out.text
    assert any("plan with --memory-budget ... --per-block" in n for n in out.notes)  # priced on the whole model
    per_block = dataclasses.replace(none, compiled={"per_block": True})
    assert not any("--per-block" in n for n in export(per_block, found.tables, "torchtitan").notes)
    block = ("block",) * 12
    mixed = dataclasses.replace(none, layers=block, chosen=dataclasses.replace(none.chosen, layers=block))
    out = export(mixed, found.tables, "torchtitan")
    assert not out.exact and any("modes exclude each other" in w for w in out.why)
    out = export(none, found.tables, "megatron")
    assert not out.exact and any("activation_memory_budget 0.5" in w for w in out.why)
    chunked = dataclasses.replace(none, chosen=dataclasses.replace(none.chosen, loss="chunked"))  # the budget's mix
    out = export(chunked, found.tables, "torchtitan")  # no full-loss option weighed: nothing to price the mode by
    assert not out.exact and any("no full-loss option under memory_budget 0.5" in w for w in out.why)
    full = {"loss": "full", "budget": 0.5, "layers": list(none.layers), "peak": 3e9, "seconds": None, "overhead": 0.1}
    chunked = dataclasses.replace(chunked, compiled={"per_block": True, "options": [full]})
    out = export(chunked, found.tables, "torchtitan")  # the budget said; the chunked loss is why it is not exact
    assert not out.exact and out.why and all("chunked loss" in w for w in out.why)
    assert 'mode = "memory_budget"\nmemory_budget = 0.5\n' in out.text
    assert (out.priced.loss, out.priced.peak, out.priced.overhead) == ("full", 3e9, 0.1)  # the full loss's option
    assert 'recompute.apply(model, "plan.json", loss="chunked"), then torch.compile' in out.text


@pytest.mark.parametrize("bad", [[2], "0.5", [], [True]])
def test_the_api_refuses_a_bad_memory_budget(bad: object) -> None:
    import recompute

    with pytest.raises(ConfigError, match="memory_budget is 'auto' or fractions"):
        recompute.plan("gpt2", "70GiB", memory_budget=bad)  # type: ignore[arg-type]
