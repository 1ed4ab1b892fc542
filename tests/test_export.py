"""``plan --export``: each stack's settings are what that stack runs (held to mirrors of its own code, and to the
real transformers and torch), a plan it can say comes out exact, and one it cannot comes out as its closest
setting with the peak and cost the plan's cost table gives that setting; the policy aliases round-trip.

The mirrors are written from the stacks' sources, cited where they stand:
- torchtitan v0.2.2 (commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce): torchtitan/config/job_config.py
  (``ActivationCheckpoint``), torchtitan/config/manager.py (``_dict_to_dataclass``),
  torchtitan/distributed/activation_checkpoint.py (``apply_ac``, ``_apply_layer_sac``),
  torchtitan/models/llama3/infra/parallelize.py (``apply_ac`` only when mode != "none").
- Megatron-LM core_v0.19.0 (commit 5be9626709af2722333bf54797c954c09edeada3):
  megatron/core/transformer/transformer_config.py (the four recompute fields and ``__post_init__``'s checks),
  megatron/training/argument_utils.py (``ArgumentGroupFactory._extract_type``: how a field becomes a flag),
  megatron/training/arguments.py (``--recompute-activations``; selective refuses a method),
  megatron/core/recompute.py (uniform and block), megatron/core/transformer/transformer_layer.py (mlp on dense
  layers only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

import pytest

from recompute import ModelSpec, Policy, Workload
from recompute.cli import main
from recompute.core.analytic.table import analytic_table, analytic_tables, with_loss
from recompute.core.costs import CostTable
from recompute.core.errors import ConfigError
from recompute.core.export import STACKS, Export, export
from recompute.core.plan import plan
from recompute.core.plan_file import Plan, PlanPoint
from recompute.core.policy import ALIASES, POLICIES
from recompute.core.stacks import Setting
from recompute.core.table import gib
from recompute.planning import cost_tables

sys.path.insert(0, str(Path(__file__).parent))
from test_zoo import WL as ZOO_WL
from test_zoo import ZOO

SPEC = ModelSpec.from_name("llama3.1-8b")
WL = Workload(seq_len=16384, micro_batch=1, precision="distributed", dp=8)
N = SPEC.n_layers
TABLES = analytic_tables(SPEC, WL, losses=("chunked",))


def timed_tables() -> tuple[CostTable, ...]:
    """The same model priced in seconds: each policy's replay a made-up share of the step, the chunked loss's
    step a little dearer (the export counts a setting's cost against the workload's own step, as the plan)."""
    seconds = {p: 1e-3 * i for i, p in enumerate(POLICIES)}
    return tuple(
        analytic_table(SPEC, with_loss(WL, loss), seconds=seconds, model_seconds=step, cost_kind="predicted seconds")
        for loss, step in (("full", 2.0), ("chunked", 2.02))
    )


def planned(tables: tuple[CostTable, ...], layers: tuple[str, ...], loss: str = "full", budget: float = 0) -> Plan:
    """A Plan of the given assignment (as the planner would return it, were it the cheapest), its budget its own
    peak unless given."""
    base = plan(tables, 1e15)
    table = next(t for t in tables if t.workload["loss"] == loss)
    c = table.compose(layers)
    extra = table.model_cost - tables[0].model_cost if table.timed else 0.0
    cost = table.cost(c) + extra
    step = table.model_seconds + table.cost(c) if table.model_seconds is not None else None
    point = PlanPoint(c.peak, cost, cost / tables[0].model_cost, layers, loss, c.flops, step, c.host)
    return dataclasses.replace(
        base, layers=layers, chosen=point, budget=budget or c.peak, peak_phase=c.peak_phase, workload=table.workload
    )


EVERY_4 = Policy("block", every=4).per_layer(N)  # layers 0, 4, 8, ...: recompute's and HF's every-k
TITAN_4 = tuple("block" if (i + 1) % 4 == 0 else "none" for i in range(N))  # layers 3, 7, ...: torchtitan's
FIRST_20 = Policy("block", first=20).per_layer(N)  # Megatron's block method
MIXED = ("mlp",) * 28 + ("none",) * 4  # the README's plan at 64 GiB

EXACT = {
    "none": ((("none",) * N), {"torchtitan", "megatron", "hf", "lightning"}),
    "block": ((("block",) * N), {"torchtitan", "megatron", "hf", "lightning"}),
    "block:every=4": (EVERY_4, {"hf"}),
    "torchtitan's every 4th": (TITAN_4, {"torchtitan"}),
    "block:first=20": (FIRST_20, {"megatron"}),
    "core_attn": ((("core_attn",) * N), {"megatron"}),
    "mlp": ((("mlp",) * N), {"megatron", "lightning"}),
    "attn+mlp": ((("attn+mlp",) * N), {"lightning"}),
    "mlp x28, none x4": (MIXED, set()),
}


def _priced_settings(out: Export, tables: tuple[CostTable, ...]) -> list[tuple[Setting, float, float]]:
    """Every setting of the stack with its peak and cost by the full-loss table, counted as the plan counts."""
    table = next(t for t in tables if t.workload["loss"] == "full")
    rows = []
    for s in STACKS[out.stack].settings(table):
        c = table.compose(s.layers)
        extra = table.model_cost - tables[0].model_cost if table.timed else 0.0
        rows.append((s, c.peak, table.cost(c) + extra))
    return rows


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("name", list(EXACT))
def test_exact_where_the_stack_says_the_plan(stack: str, name: str) -> None:
    layers, exact_in = EXACT[name]
    out = export(planned(TABLES, layers), TABLES, stack)
    assert out.exact == (stack in exact_in), out.text
    if out.exact:
        assert out.priced.layers == layers and out.priced.peak == out.plan.peak and out.priced.cost == out.plan.cost
        assert "exact, the plan as it is" in out.text and out.why == ()
    else:
        assert out.why and "cannot express the plan" in out.text


@pytest.mark.parametrize("timed", [False, True], ids=["flops", "seconds"])
@pytest.mark.parametrize(
    ("stack", "name"),
    [(stack, name) for name, (_, exact_in) in EXACT.items() for stack in STACKS if stack not in exact_in],
)
def test_the_closest_setting_is_priced_by_the_cost_table(stack: str, name: str, timed: bool) -> None:
    """Where the stack cannot say the plan: the cheapest of its settings whose peak fits the budget, its peak
    and cost what the table composes for it, the fit stated in the file."""
    tables = timed_tables() if timed else TABLES
    layers, _ = EXACT[name]
    out = export(planned(tables, layers), tables, stack)
    rows = _priced_settings(out, tables)
    fits = [r for r in rows if r[1] <= out.budget]
    best = min(fits, key=lambda r: (r[2], r[1])) if fits else min(rows, key=lambda r: (r[1], r[2]))
    assert (out.setting, out.priced.peak, out.priced.cost) == best
    assert out.priced.layers == best[0].layers and out.weighed == len(rows)
    assert out.fits == bool(fits)
    if out.fits:
        assert f"(fits, {gib(out.budget - out.priced.peak)} to spare)" in out.text
    else:
        assert f"{gib(out.priced.peak - out.budget)} OVER the {gib(out.budget)} budget" in out.text
    if timed:
        assert out.priced.step_seconds == pytest.approx(tables[0].model_cost + out.priced.cost, rel=1e-12)


def test_the_mixed_plan_at_64_gib_in_each_stack() -> None:
    """mlp on 28 layers and none on 4 (the README's plan): no stack says it; each one's closest setting fits
    64 GiB at its own cost, and the file says by how much it is dearer than the plan."""
    tables = timed_tables()
    mixed = planned(tables, MIXED, loss="chunked", budget=64 * 2**30)
    for stack in STACKS:
        out = export(mixed, tables, stack)
        assert not out.exact and out.fits and out.priced.cost > out.plan.cost
        assert f"+{out.priced.overhead:.1%} time" in out.text and f"+{out.plan.overhead:.1%} time" in out.text


def test_a_chunked_plan_is_priced_with_the_full_loss_and_may_not_fit() -> None:
    """No stack has recompute's chunked loss: its settings run the full loss; at the chunked plan's own peak
    (every layer block) none fits, and the smallest is given with how far over it is."""
    out = export(planned(TABLES, ("block",) * N, loss="chunked"), TABLES, "megatron")
    full = next(t for t in TABLES if t.workload["loss"] == "full")
    assert not out.exact and not out.fits and out.priced.loss == "full"
    assert out.priced.peak == full.compose(("block",) * N).peak > out.budget
    assert "it has no chunked loss" in out.text and "none fits the budget, this is the smallest" in out.text
    assert 'recompute.apply(model, "plan.json", loss="chunked")' in out.text
    with pytest.raises(ConfigError, match="no cost table"):
        export(planned(TABLES[1:], ("block",) * N, loss="chunked"), TABLES[1:], "hf")


TITAN_MODES = Literal["selective", "full", "memory_budget", "none"]


# torchtitan v0.2.2: torchtitan/config/job_config.py, class ActivationCheckpoint (line 651)
@dataclass
class TitanActivationCheckpoint:
    mode: TITAN_MODES = "selective"
    selective_ac_option: str = "2"
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    early_stop: bool = False
    memory_budget: float = 0.5
    visualize_memory_budget_pareto: bool = False
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


def titan_layers(text: str, n: int, loads: Callable[[str], dict]) -> tuple[str, ...]:
    """What torchtitan v0.2.2 does with the file: ``ConfigManager._dict_to_dataclass`` (unknown keys refused,
    values as they are), ``parallelize_llama`` (``apply_ac`` unless mode is none), ``_apply_ac_to_transformer_block``
    and ``_apply_layer_sac`` (a module-level counter from 1)."""
    section = loads(text)["activation_checkpoint"]
    assert set(section) <= {f.name for f in fields(TitanActivationCheckpoint)}
    ac = TitanActivationCheckpoint(**section)
    assert ac.mode in get_args(TITAN_MODES)
    if ac.mode == "none":
        return ("none",) * n
    if ac.mode == "full":
        return ("block",) * n
    assert ac.mode == "selective" and isinstance(ac.selective_ac_option, str) and ac.selective_ac_option.isdigit()
    freq = int(ac.selective_ac_option)
    return tuple("block" if not freq or count % freq == 0 else "none" for count in range(1, n + 1))


def test_torchtitan_runs_each_setting_as_exported() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    table = TABLES[0]
    settings = STACKS["torchtitan"].settings(table)
    assert len(settings) == N + 1
    for s in settings:
        out = export(planned(TABLES, s.layers), TABLES, "torchtitan")
        assert out.exact and out.setting == s
        assert titan_layers(out.text, N, tomllib.loads) == s.layers, out.text


def megatron_parser() -> argparse.ArgumentParser:
    """The recompute flags of Megatron-LM core_v0.19.0: ``ArgumentGroupFactory(TransformerConfig)`` makes each
    field a flag (``_extract_type``: Optional[Literal[...]] -> type str with choices, Optional[int] -> int,
    Optional[List[str]] -> str with nargs '+'; default None); ``--recompute-activations`` is arguments.py's."""
    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--recompute-granularity", type=str, choices=("full", "selective"), default=None)
    p.add_argument("--recompute-method", type=str, choices=("uniform", "block"), default=None)
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--recompute-modules", type=str, nargs="+", default=None)
    p.add_argument("--recompute-activations", action="store_true")
    return p


MEGATRON_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out"}


def megatron_layers(text: str, n: int, moe: list[bool]) -> tuple[str, ...]:
    """What Megatron does with the flags: arguments.py and ``TransformerConfig.__post_init__``'s checks, then
    recompute.py's uniform/block loop (one stage of n layers) and the selective modules per layer."""
    argv = shlex.split(" ".join(line for line in text.splitlines() if not line.startswith("#")))
    a = megatron_parser().parse_args(argv)
    if a.recompute_activations:
        a.recompute_granularity = "selective"
    if a.recompute_granularity is None:
        return ("none",) * n
    if a.recompute_granularity == "selective":
        assert a.recompute_method is None and a.recompute_num_layers is None
        modules = a.recompute_modules if a.recompute_modules is not None else ["core_attn"]
        assert set(modules) <= MEGATRON_MODULES
        out = []
        for is_moe in moe:
            does = {"core_attn"} & set(modules)
            does |= {"mlp"} if ("mlp" in modules and not is_moe) or ("moe" in modules and is_moe) else set()
            out.append(does.pop() if len(does) == 1 else "none" if not does else "+".join(sorted(does)))
        return tuple(out)
    assert a.recompute_method is not None and a.recompute_num_layers is not None
    if a.recompute_method == "uniform":
        chunks = [range(i, min(i + a.recompute_num_layers, n)) for i in range(0, n, a.recompute_num_layers)]
        return tuple("block" if len(c) == 1 else f"chunk of {len(c)}" for c in chunks for _ in c)
    return tuple("block" if i < a.recompute_num_layers else "none" for i in range(n))


def test_megatron_accepts_and_runs_each_setting_as_exported() -> None:
    table = TABLES[0]
    settings = STACKS["megatron"].settings(table)
    assert len(settings) == N + 3  # none, uniform 1, block 1..N-1, core_attn, mlp
    for s in settings:
        out = export(planned(TABLES, s.layers), TABLES, "megatron")
        assert out.exact
        assert megatron_layers(out.text, N, [False] * N) == s.layers, out.text


def test_megatron_moe_layers_take_the_moe_module(tmp_path: Path) -> None:
    """A dense first layer, then MoE layers (an analytic table of a Qwen3-MoE-shaped config): ``mlp`` leaves
    the MoE layers alone, ``moe`` recomputes them, ``mlp moe`` both (as recompute's mlp on every layer)."""
    config = tmp_path / "moe.json"
    config.write_text(
        json.dumps({"model_type": "qwen3_moe", **ZOO["qwen3_moe"], "num_hidden_layers": 4, "mlp_only_layers": [0]})
    )
    tables = cost_tables(str(config), ZOO_WL, analytic=True).tables
    moe = [tables[0].kind_of(i).name == "MoE layer" for i in range(4)]
    assert moe == [False, True, True, True]
    settings = STACKS["megatron"].settings(tables[0])
    modules = {tuple(s.values["recompute_modules"]): s.layers for s in settings if "recompute_modules" in s.values}
    assert modules[("mlp",)] == ("mlp", "none", "none", "none")
    assert modules[("moe",)] == ("none", "mlp", "mlp", "mlp")
    assert modules[("mlp", "moe")] == ("mlp",) * 4
    for s in settings:
        out = export(planned(tables, s.layers), tables, "megatron")
        assert out.exact and megatron_layers(out.text, 4, moe) == s.layers


def _tiny_hf_llama(n: int):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=n,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config)


def test_transformers_runs_each_setting_as_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported file run as it is (TrainingArguments of the installed transformers), then what Trainer does
    with those arguments (transformers/trainer.py: ``every_n_layers`` and ``offload`` popped, the rest to
    ``activation_checkpointing_enable``): the decoder layers it checkpoints are the setting's block layers."""
    model = _tiny_hf_llama(N)
    monkeypatch.chdir(tmp_path)
    settings = STACKS["hf"].settings(TABLES[0])
    assert len(settings) == N + 1
    for s in settings:
        out = export(planned(TABLES, s.layers), TABLES, "hf")
        assert out.exact
        scope: dict[str, object] = {}
        exec(compile(out.text, "plan.hf.py", "exec"), scope)
        args = scope["args"]
        if args.activation_checkpointing:  # type: ignore[attr-defined]
            kwargs = dict(args.activation_checkpointing_kwargs or {})  # type: ignore[attr-defined]
            every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=offload
            )
        checkpointed = tuple("block" if layer.gradient_checkpointing else "none" for layer in model.model.layers)
        assert checkpointed == s.layers, s.label
        model.activation_checkpointing_disable()


def test_lightning_class_sets_wrap_what_recompute_wraps() -> None:
    """Lightning 2.6.5's FSDPStrategy hands a set of classes to torch's ``apply_activation_checkpointing`` as a
    ``ModuleWrapPolicy`` (src/lightning/fabric/strategies/fsdp.py); with the class names the export writes for a
    transformers model (a profile's kind name), it wraps exactly the modules recompute's ``apply`` does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from recompute.checkpointing import _sub_block
    from recompute.trace._kinds import _label

    n = 4
    model = _tiny_hf_llama(n)
    name = _label(model.model.layers[0], None)
    table = analytic_tables(dataclasses.replace(SPEC, n_layers=n), WL)[0]
    table = dataclasses.replace(table, kinds=tuple(dataclasses.replace(k, name=name) for k in table.kinds))
    classes = {type(m).__name__: type(m) for m in model.modules()}
    layer = model.model.layers[0]
    regions = {
        "block": [layer],
        "attn": [_sub_block(layer, "attn", None, None)],
        "mlp": [_sub_block(layer, "mlp", None, None)],
    }
    regions["attn+mlp"] = regions["attn"] + regions["mlp"]
    for s in STACKS["lightning"].settings(table):
        names = s.values.get("activation_checkpointing_policy", [])
        option = s.layers[0]
        assert set(s.layers) == {option}
        if not names:
            assert option == "none"
            continue
        fresh = _tiny_hf_llama(n)
        apply_activation_checkpointing(
            fresh,
            checkpoint_wrapper_fn=checkpoint_wrapper,
            auto_wrap_policy=ModuleWrapPolicy({classes[c] for c in names}),
        )
        wrapped = [
            type(m._checkpoint_wrapped_module).__name__ for m in fresh.modules() if isinstance(m, CheckpointWrapper)
        ]
        want = [type(m).__name__ for m in regions[option]]
        assert sorted(wrapped) == sorted(want * n), (option, names)


def test_cli_prints_and_writes_the_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "llama3.1-8b", "--seq-len", "16384", "--precision", "distributed", "--dp", "8"]
    args += ["--cost", "flops", "--budget", "64GiB", "-o", str(tmp_path / "plan.json")]
    for stack, suffix in (("torchtitan", "toml"), ("megatron", "args"), ("hf", "py"), ("lightning", "py")):
        assert main([*args, "--export", stack]) == 0
        printed = capsys.readouterr().out
        written = (tmp_path / f"plan.{stack}.{suffix}").read_text()
        exact = "RecomputeCallback(" if stack == "hf" else "recompute.apply(model, "
        assert printed.endswith(written) and f"{exact}{json.dumps(str(tmp_path / 'plan.json'))}" in written
        assert main([*args, "--export", stack, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["export"]["text"] == written and data["export"]["stack"] == stack
        assert data["export"]["plan"]["layers"] == data["predicted"]["layers"]


@pytest.mark.parametrize(
    ("extra", "says"),
    [(["--export", "deepspeed"], "invalid choice"), (["--loss", "chunked", "--export", "hf"], "full loss")],
)
def test_cli_export_refusals(extra: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["plan", "--model", "llama3.1-8b", "--budget", "80GiB", "--cost", "flops", *extra])
    except SystemExit as e:  # argparse's own refusals
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err


ALIAS_SPELLINGS = {
    "full": Policy("block"),
    "selective": Policy("core_attn"),
    "full:every=2": Policy("block", every=2),
    "block:every=3": Policy("block", every=3),
    "full:first=20": Policy("block", first=20),
    "selective:first=4": Policy("core_attn", first=4),
    "mlp:every=2": Policy("mlp", every=2),
}


@pytest.mark.parametrize("spelling", list(ALIAS_SPELLINGS))
def test_aliases_round_trip_through_parse(spelling: str) -> None:
    pol = Policy.parse(spelling)
    assert pol == ALIAS_SPELLINGS[spelling] and pol.name in POLICIES
    assert pol.spec is not None and Policy.parse(pol.spec) == pol and Policy.from_dict(pol.to_dict()) == pol
    assert Policy(layers=tuple(ALIASES)).layers == tuple(ALIASES.values())


@pytest.mark.parametrize("bad", ["ful", "full:every=0", "full:every=x", "block:step=2", "full:"])
def test_bad_spellings_say_what_is_taken(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"NAME:every=K|positive integer"):
        Policy.parse(bad)


def test_cli_every_still_works_and_the_spellings_agree(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", "llama3.1-8b", "--seq-len", "4096", "--no-time", "--json"]
    answers = []
    for spelling in (
        ["--policy", "full:every=2"],
        ["--policy", "full", "--every", "2"],
        ["--policy", "block", "--every", "2"],
    ):
        assert main([*base, *spelling]) == 0
        answers.append(json.loads(capsys.readouterr().out)["chosen"])
    assert answers[0] == answers[1] == answers[2]
    assert main([*base, "--policy", "full:every=2", "--every", "3"]) == 2
    assert "NAME:every=K" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spelling", "name"), [("full", "block"), ("selective", "core_attn"), ("full:every=2", "block")]
)
def test_apply_takes_the_aliases(spelling: str, name: str) -> None:
    """``apply`` with a stack's word puts the policy it stands for on the model, layer for layer."""
    torch = pytest.importorskip("torch")
    from recompute.checkpointing import applied_policy, apply

    model = _tiny_hf_llama(4)
    apply(model, spelling)
    pol = applied_policy(model)
    assert pol == Policy.parse(spelling) and pol is not None and pol.name == name
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    apply(model, "none")
    assert applied_policy(model) == Policy("none")
