"""Profiles of transformers' own classes: per-kind bytes against a real CPU step, FLOPs invariants, the composed
peak against whole traces, layer kinds told apart, the cache, and plan/estimate from a profile."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from recompute.checkpointing import apply, find_layers
from recompute.cli import main
from recompute.core import store
from recompute.core.plan import plan
from recompute.core.policy import Policy
from recompute.core.profile import Profile
from recompute.core.search import search, smallest_peak
from recompute.core.workload import Workload
from recompute.models.identity import config_identity, model_identity
from recompute.models.source import build_source, resolve_source
from recompute.planning import profiles_of
from recompute.trace import cached_profile, cached_profiles, profile, profiles, trace, with_loss
from recompute.trace._build import fake_kernels
from recompute.trace._chain import leads
from recompute.trace._kinds import short_model
from recompute.trace._profile import _Shape, _whole_of, _whole_step
from recompute.trace._run import step_built
from recompute.trace._tracker import Phase

sys.path.insert(0, str(Path(__file__).parent))
from test_zoo import WL, ZOO, real_saved_per_layer

pytest.importorskip("transformers")

KINDS = {
    "llama": {},
    "gemma2": {},  # sliding and global attention alternate
    "qwen3_moe": {"mlp_only_layers": [0]},  # a dense first layer, then MoE
    "gpt2": {},
}
FOUR_LAYERS = {"num_hidden_layers": 4, "n_layer": 4}


def config(kind: str, folder: Path, **extra: object) -> Path:
    body = {"model_type": kind, **ZOO[kind], **KINDS[kind], **extra}
    for key, value in FOUR_LAYERS.items():
        if key in body:
            body[key] = value
    path = folder / f"{kind}.json"
    path.write_text(json.dumps(body))
    return path


@functools.cache
def measured(kind: str) -> tuple[str, Path, Profile]:
    """Each kind's config and profile, measured once per session (tests of any order share them)."""
    path = config(kind, Path(tempfile.mkdtemp(prefix=f"profile-{kind}-")))
    return kind, path, profile(resolve_source(str(path)), WL)


@pytest.fixture(params=list(KINDS))
def profiled(request: pytest.FixtureRequest) -> tuple[str, Path, Profile]:
    return measured(request.param)


def test_layer_kinds_are_told_apart(profiled: tuple[str, Path, Profile]) -> None:
    kind, _, prof = profiled
    expected = {
        "llama": [[0, 1, 2, 3]],
        "gpt2": [[0, 1, 2, 3]],
        "gemma2": [[0, 2], [1, 3]],
        "qwen3_moe": [[0], [1, 2, 3]],
    }
    assert [list(k.layers) for k in prof.kinds] == expected[kind]
    assert f"profiled transformers.{prof.class_name.split('.')[-1]}" in prof.notes[0]


def test_kept_bytes_equal_a_real_step_under_every_policy(profiled: tuple[str, Path, Profile]) -> None:
    """Each kind's bytes under each policy equal an independent count of a real CPU step of the same class."""
    _, path, prof = profiled
    source = resolve_source(str(path))
    idx, targets = torch.randint(128, (2, 2, 32))
    for name in prof.applicable():
        torch.manual_seed(0)
        model = build_source(source).model.train()
        apply(model, name)
        real = real_saved_per_layer(model, idx, targets)
        if name == "none":
            assert list(prof.base_kept) == real  # the whole model, layer by layer
        for k in prof.kinds:
            if k.layers != (0,):  # layer 0 also keeps what the layers share
                assert k.kept[name] == real[k.layers[-1]], (name, k.name)


def test_flops_follow_the_policies(profiled: tuple[str, Path, Profile]) -> None:
    _, _, prof = profiled
    for k in prof.kinds:
        assert k.recompute_flops("none") == 0
        # Replaying the layer is its forward again, short of what no backward needs: the non-reentrant
        # checkpoint stops once the last saved tensor is recomputed (Llama's final projection is not
        # replayed; Gemma's post-norm needs it).
        assert 0.5 * k.forward_flops < k.recompute_flops("block") <= k.forward_flops
        assert 0 < k.recompute_flops("core_attn") < k.recompute_flops("attn") < k.forward_flops
        assert k.recompute_flops("attn+mlp") <= k.recompute_flops("block")
    total = sum(k.forward_flops * len(k.layers) for k in prof.kinds)
    assert prof.step_flops > 2 * total  # forward and backward, with the head


def test_composed_peak_is_held_to_whole_traces(profiled: tuple[str, Path, Profile]) -> None:
    """``none`` everywhere composes to the trace exactly; any mix to within four hidden states (a layer's
    backward also depends on how its neighbour hands it the gradient, which the short model fixes)."""
    _, path, prof = profiled
    source = resolve_source(str(path))
    hidden = ZOO[path.stem].get("hidden_size", ZOO[path.stem].get("n_embd"))
    bound = 4 * WL.micro_batch * WL.seq_len * int(hidden) * 4  # fp32
    table = prof.cost_table(offload=dict.fromkeys(range(len(prof.kinds)), 0.0))  # offload too: every policy
    assert table.compose(["none"] * prof.n_layers).peak == trace(source, WL, "none").peak
    rng = random.Random(0)
    names = prof.applicable()
    for layers in [[n] * prof.n_layers for n in names] + [[rng.choice(names) for _ in range(4)] for _ in range(3)]:
        composed, traced = table.compose(layers), trace(source, WL, Policy(layers=tuple(layers)))
        assert abs(composed.peak - traced.peak) <= bound, layers


def test_the_chain_equals_short_models_of_single_transitions(profiled: tuple[str, Path, Profile]) -> None:
    """Links from the chained step against a short model per transition (the first layer of each kind under
    the policy, the measured layer, the next one, a copy of the last layer), byte for byte, for a sample of
    transitions between each pair of kinds."""
    kind, path, prof = profiled
    source = resolve_source(str(path))
    with fake_kernels():
        shape = _Shape.of(source, WL)
    rng = random.Random(kind)
    for a, b in shape.pairs:
        first, then = shape.ok[a], shape.ok[b]
        sample = {("none", "none")} | {(rng.choice(first), rng.choice(then)) for _ in range(2)}
        short = {pq: _short_step(shape, a, b, *pq) for pq in sorted(sample)}
        ref = short["none", "none"]
        for (p, q), (held, fwd, bwd) in short.items():
            expected = (held - ref[0], bwd - ref[2], fwd - ref[1])
            assert prof.links[f"{a}>{b}"][p][q] == expected, (a, b, p, q)


def _short_step(shape: _Shape, a: int, b: int, p: str, q: str) -> tuple[int, int, int]:
    """What the layer (of kind a, under p) holds, and its forward's and backward's peaks above its start, in a
    short model of it followed by one of kind b under q."""
    n, x = len(shape.layers), len(shape.reps)
    picks = [*shape.reps, shape.reps[a], shape.reps[b], n - 1]
    with fake_kernels():
        built = short_model(shape.whole, shape.layers, picks)
        policy = Policy(layers=(*leads(p, shape.ok), p, q, "none"))
        rec = step_built(built, WL, policy, device="cpu", step=False)[0]
    start = rec.layer_starts[x]
    peak = {stage: rec.phase_peaks[Phase(stage, "layer", x)][0] - start for stage in ("forward", "backward")}
    return rec.layer_starts[x + 1] - start, peak["forward"], peak["backward"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gpt2"])
def test_one_pass_profiles_every_loss_mode(kind: str) -> None:
    """``profiles`` measures the links once, under its first loss mode: the full loss's profile from a pass
    led by the chunked one is the one ``profile`` measures alone (the chunked one's is, by the same steps)."""
    _, path, prof = measured(kind)
    both = profiles(resolve_source(str(path)), WL, ("chunked", "full"))
    assert list(both) == ["chunked", "full"] and both["full"] == prof
    assert both["chunked"].workload["loss"] == "chunked" and both["chunked"].links == prof.links
    assert both["chunked"].head_backward != prof.head_backward  # the full loss keeps the logits


@pytest.mark.parametrize("kind", list(KINDS))
def test_steps_in_worker_processes_measure_what_one_process_does(kind: str) -> None:
    """Note: [steps in workers]: the profile measured with its steps spread over forked workers, its chain cut
    in parts (Note: [the chain in parts]), is the one measured with every step here in one chain, byte for byte
    less its ``seconds`` (the fixture's takes the default)."""
    _, path, prof = measured(kind)
    source = resolve_source(str(path))
    for workers in (0, 3):
        found = profiles(source, WL, (WL.loss,), workers=workers)[WL.loss]
        assert _figures(found) == _figures(prof), workers


@pytest.mark.parametrize(
    ("kind", "wl"),
    [
        ("llama", WL),
        ("llama", dataclasses.replace(WL, device="cuda", dtype="bf16", precision="amp")),  # foreach AdamW, autocast
        ("gpt2", dataclasses.replace(WL, device="cuda")),  # tied embedding, dropout
        ("qwen3_moe", WL),  # every layer a mixture of experts
    ],
    ids=["llama-cpu", "llama-cuda-amp", "gpt2-cuda", "qwen3_moe-cpu"],
)
def test_the_whole_step_scaled_from_three_and_four_layers_is_the_whole_step(kind: str, wl: Workload, tmp_path) -> None:
    """Note: [every layer's phase]: a profile's whole step of nine alike layers, from steps of three and four
    (``_Shape.whole_models``), equals the nine-layer step in every figure a profile reads of it."""
    body = {"model_type": kind, **ZOO[kind]}
    body.update({key: 9 for key in FOUR_LAYERS if key in body})
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(body))
    source = resolve_source(str(path))
    with fake_kernels():
        shape = _Shape.of(source, wl, wl.dtype if wl.mixed_policy else None)
        cut = shape.whole_models(fsdp=False)
        assert [len(find_layers(m.model)) for m in cut] == [3, 4]
        scaled, scaled_params = _whole_of([_whole_step(source, m, wl, "cpu") for m in cut], 9)
        whole = short_model(shape.whole, shape.layers, range(9))
        full, full_params = _whole_step(source, whole, wl, "cpu")
    assert scaled_params == full_params
    for field in ("phase_peaks", "states", "flops", "work", "layer_deltas", "n_layers"):
        assert getattr(scaled, field) == getattr(full, field), field
    by_layer = functools.partial(sorted, key=lambda r: (r.layer, r.nbytes, r.component, r.op))
    assert by_layer(scaled.saved) == by_layer(full.saved)  # the profile sums them by layer
    assert list(scaled.phase_peaks) == list(full.phase_peaks)  # in the step's order: the profile's JSON is too


def test_the_whole_step_runs_whole_where_it_does_not_scale(tmp_path: Path) -> None:
    """Scaling the whole step takes alike layers (Gemma 2's alternate sliding and global attention) and one
    device's step (an FSDP2 rank's first and last layers differ)."""
    counts = {}
    for kind in ("gemma2", "llama"):
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"model_type": kind, **ZOO[kind], "num_hidden_layers": 9}))
        with fake_kernels():
            shape = _Shape.of(resolve_source(str(path)), WL)
            for fsdp in (False, True):
                counts[kind, fsdp] = [len(find_layers(m.model)) for m in shape.whole_models(fsdp)]
    assert counts == {("gemma2", False): [9], ("gemma2", True): [9], ("llama", False): [3, 4], ("llama", True): [9]}


AMP = dataclasses.replace(WL, dtype="bf16", precision="amp", micro_batch=32, seq_len=64)
"""Autocast over fp32 weights, at a micro-batch where the layers' phases are the step's highest."""


def test_under_amp_the_chain_in_parts_measures_what_one_chain_does() -> None:
    """Note: [dropped as the forward ends]: a checkpointed layer's cast weights are freed as the forward ends,
    so without the correction a layer's backward figures would depend on how many checkpointed layers stand
    below it in the chain, and cutting the chain would change them."""
    _, path, _ = measured("llama")
    source = resolve_source(str(path))
    one, parts = (profiles(source, AMP, ("full",), workers=w)["full"] for w in (0, 3))
    assert _figures(one) == _figures(parts)


def test_under_amp_the_composed_peak_is_never_below_the_trace() -> None:
    """Under amp what a layer holds is its forward's growth, cast weights included, though a checkpointed layer
    drops them before the backward: the composed peak is never low, and high by no more than every layer's
    weights in bf16 beside the four hidden states of ``test_composed_peak_is_held_to_whole_traces``."""
    _, path, _ = measured("llama")
    source = resolve_source(str(path))
    amp = profile(source, AMP)
    table = amp.cost_table()
    hidden = int(ZOO["llama"]["hidden_size"])
    bound = 2 * amp.parameter_count + 4 * AMP.micro_batch * AMP.seq_len * hidden * 2
    rng = random.Random(1)
    names = [n for n in amp.applicable() if n != "offload"]
    assert table.compose(["none"] * amp.n_layers).peak == trace(source, AMP, "none").peak
    for layers in [[n] * amp.n_layers for n in names] + [[rng.choice(names) for _ in range(4)] for _ in range(3)]:
        composed, traced = table.compose(layers).peak, trace(source, AMP, Policy(layers=tuple(layers))).peak
        assert traced <= composed <= traced + bound, layers


def _figures(prof: Profile) -> str:
    return json.dumps({k: v for k, v in prof.to_dict().items() if k != "seconds"}, sort_keys=True)


def test_the_plan_fits_its_budget_by_the_trace(profiled: tuple[str, Path, Profile]) -> None:
    _, path, prof = profiled
    table = prof.cost_table()
    none, smallest = table.compose(["none"] * prof.n_layers).peak, table.compose(["block"] * prof.n_layers).peak
    budget = (none + smallest) / 2
    chosen = plan(table, budget).chosen
    assert chosen.peak <= budget
    assert chosen.flops <= table.compose(["block"] * prof.n_layers).flops
    hidden = ZOO[path.stem].get("hidden_size", ZOO[path.stem].get("n_embd"))
    traced = trace(resolve_source(str(path)), WL, Policy(layers=chosen.layers)).peak
    assert traced <= budget + 4 * WL.micro_batch * WL.seq_len * int(hidden) * 4


def test_the_search_over_a_profile_equals_brute_force(profiled: tuple[str, Path, Profile]) -> None:
    """The one search, over a measured profile's table: its frontier is the Pareto set of every assignment's
    composed (peak, recomputed FLOPs), and each budget's cheapest plan is the brute force's."""
    _, _, prof = profiled
    table = prof.cost_table()
    options = [table.kind_of(i).options for i in range(table.n)]  # an MoE layer's include experts
    every = [table.compose(layers) for layers in itertools.product(*options)]
    pareto: list[float] = []
    for c in sorted(every, key=lambda c: (c.peak, c.flops)):
        if not pareto or c.flops < pareto[-1] - 0.5:
            pareto += [c.peak, c.flops]
    got = [x for c in search(table).frontier for x in (c.peak, c.flops)]
    assert got == pytest.approx(pareto, rel=1e-12)
    low, high = pareto[0], pareto[-2]
    for budget in (low, (low + high) / 2, high):
        best = min(c.flops for c in every if c.peak <= budget)
        assert plan(table, budget).recompute_flops == pytest.approx(best, rel=1e-12)


def test_a_cached_profile_names_the_file_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's key is the architecture's: the same config under another name and path finds the profile the
    first made, named as asked (a plan of mine.json must not say it was built from another user's file)."""
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    first = config("llama", tmp_path)
    (tmp_path / "copy").mkdir()
    again = tmp_path / "copy" / "mine.json"
    again.write_text(first.read_text())
    made, hit = cached_profile(str(first), WL)
    found, hit_again = cached_profile(str(again), WL)
    assert (hit, hit_again) == (False, True) and found.key == made.key and found.kinds == made.kinds
    assert (made.model, found.model) == ("llama", "mine") and str(again) in found.origin
    assert not any(str(first) in n for n in found.notes) and any(str(again) in n for n in found.notes)
    (stored,) = profiles_of(str(again), WL)  # the planner's own read of the store, without torch
    assert (stored.model, stored.origin, stored.notes) == (found.model, found.origin, found.notes)


def test_a_profile_is_cached_and_plans_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    path = config("llama", tmp_path)
    args = ["--model", str(path), "--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu"]
    (first, hit), (_, hit_chunked) = cached_profiles(str(path), WL).values()  # the plan weighs the chunked loss too
    assert not hit and not hit_chunked and cached_profile(str(path), WL) == (first, True)
    out = tmp_path / "plan.json"
    code = f"""
import sys
from recompute.cli import main
code = main(["plan", *{args!r}, "--budget", "{first.cost_table().compose(["block"] * 4).peak + 1}", "-o", "{out}"])
assert code == 0 and "torch" not in sys.modules, code
"""
    env = {"RECOMPUTE_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    env |= {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}  # the tree under test
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    made = json.loads(out.read_text())
    assert Policy.from_dict(made["policy"]).per_layer(4)
    # the plan names the model by the hash of its config (the profile's), as apply computes it on the model
    assert made["model"] == {"name": "llama", "hash": first.model_hash} == config_identity(path).to_dict()
    assert model_identity(build_source(resolve_source(str(path)), device="meta").model).hash == first.model_hash


def test_cli_profile_plan_and_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The CLI's profile (from the cache: the same config and workload as ``measured``'s), estimate and plan."""
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    path = config("qwen3_moe", tmp_path)
    _, _, prof = measured("qwen3_moe")
    store.save("profiles", prof.key, prof.to_dict())
    args = ["--model", str(path), "--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu"]
    assert main(["profile", *args, "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeDecoderLayer" in out and "layers 1-3" in out
    assert main(["estimate", *args, "--policy", "mlp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["layers"] == ["mlp"] * 4
    assert main(["plan", "--profile", str(tmp_path / "p.json"), "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smallest achievable peak" in err


def test_the_plan_of_a_profiled_model_chooses_the_loss_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Profiles of both loss modes: the chunked loss where only it fits; at equal cost (FLOPs) the full one."""
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    path = config("llama", tmp_path, vocab_size=4096)  # a wide vocabulary: the logits weigh
    args = ["--model", str(path), "--seq-len", "64", "--micro-batch", "4", "--dtype", "fp32", "--device", "cpu"]
    wl = dataclasses.replace(WL, seq_len=64, micro_batch=4)
    (full, _), (chunked, _) = cached_profiles(str(path), wl).values()  # one pass, both cached
    assert cached_profile(str(path), with_loss(wl, "chunked")) == (chunked, True)
    low_chunked, low_full = smallest_peak(chunked.cost_table()), smallest_peak(full.cost_table())
    assert low_chunked < low_full
    between = str((low_chunked + low_full) / 2)

    def planned(*extra: str) -> dict:
        assert main(["plan", *args, "--cost", "flops", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    tight = planned("--budget", between)
    assert tight["workload"]["loss"] == "chunked" and tight["predicted"]["peak"] <= float(between)
    loose = planned("--budget", str(2 * full.cost_table().compose(["none"] * 4).peak))
    assert loose["workload"]["loss"] == "full"  # nothing replayed either way: the tie keeps the user's loss
    assert main(["plan", *args, "--cost", "flops", "--budget", between, "--consider", "none"]) == 2
    assert "smallest achievable peak" in capsys.readouterr().err


def test_a_profile_file_is_read_back_through_its_schema(profiled: tuple[str, Path, Profile], tmp_path: Path) -> None:
    """``check_profile_dict`` refuses damaged profiles (tests/test_reliability_inputs.py); every real one passes."""
    _, _, prof = profiled
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof.to_dict()))
    assert Profile.load(path) == prof


def test_a_profile_file_is_not_contradicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--profile FILE is one model at one workload: another --model or workload option is refused, not ignored;
    the profile's own values (or none at all) pass."""
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    path = config("llama", tmp_path)
    args = ["--model", str(path), "--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--device", "cpu"]
    assert main(["profile", *args, "-o", str(tmp_path / "p.json"), "--no-time"]) == 0
    capsys.readouterr()
    given = ["--profile", str(tmp_path / "p.json"), "--no-time"]
    assert main(["estimate", *given]) == 0 and main(["estimate", *given, "--seq-len", "32"]) == 0
    name = Profile.load(tmp_path / "p.json").model  # the profile's own name, not a path: it agrees
    assert main(["estimate", *given, "--model", name]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for extra, says in ((["--model", "llama3.1-8b"], "--model llama3.1-8b contradicts --profile"),
                        (["--seq-len", "4096"], "--seq-len 4096 contradicts --profile, measured at 32"),
                        (["--tp", "2"], "--tp 2 contradicts --profile")):  # fmt: skip
        assert main(["estimate", *given, *extra]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
    plan_args = [
        "plan",
        "--profile",
        str(tmp_path / "p.json"),
        "--cost",
        "flops",
        "--budget",
        "1GiB",
        "--dtype",
        "bf16",
    ]
    assert main(plan_args) == 2 and "--dtype bf16 contradicts --profile" in capsys.readouterr().err
    # --precision and --dp are not measured but priced: taken, and the states follow them
    states = {}
    for extra in ([], ["--precision", "distributed", "--dp", "4"]):
        assert main(["estimate", *given, "--json", *extra]) == 0
        states[len(extra)] = json.loads(capsys.readouterr().out)["profile"]
    assert states[4]["optimizer"] < states[0]["optimizer"] and states[4]["parameters"] < states[0]["parameters"]
    assert states[4]["workload"]["precision"] == "distributed" and states[4]["workload"]["dp"] == 4


@pytest.mark.parametrize(("precision", "dp"), [("bf16", 1), ("mixed", 1), ("distributed", 4)])
def test_profiled_states_follow_the_precision(precision: str, dp: int, tmp_path: Path) -> None:
    """A profile is measured as plain training in its dtype; asked for another precision (a distributed optimizer
    over dp ranks), its states equal the analytic model's for the same config and a real optimizer step's bytes
    on the same parameter shapes, and every phase moves with them: the composed step under ``none`` peaks where
    the whole step traced in that precision does (issue 28, item 1)."""
    from recompute.core.analytic import estimate
    from recompute.core.spec import analytic_model
    from test_trace import _real_states

    path = config("llama", tmp_path)
    source = resolve_source(str(path))
    wl = dataclasses.replace(WL, dtype="bf16", precision=precision, dp=dp)
    plain = profile(source, dataclasses.replace(wl, precision="bf16", dp=1))
    priced = plain.restated(precision, dp)
    with fake_kernels():
        tensors = len(list(build_source(source, device="meta").model.parameters()))
    states = priced.parameters + priced.gradients + priced.optimizer - 4 * tensors  # AdamW's fp32 step counters
    spec = analytic_model(str(path))
    assert states == pytest.approx(estimate(spec, wl, "none").states.total, abs=4)  # rounded to whole bytes
    assert states == pytest.approx(_real_states(spec, precision, dp), rel=1e-3)  # the shard rounds up
    composed = priced.cost_table().compose(["none"] * priced.n_layers).peak
    assert composed == pytest.approx(trace(source, wl, "none").peak, abs=64)
    assert (precision == "bf16") == (composed == plain.cost_table().compose(["none"] * plain.n_layers).peak)
    assert priced.workload_dict()["precision"] == precision
