"""Offload in a profile (a transformers config, not a preset): what an offloaded layer holds on the device, adds to
the backward of the layer above (its copies, back one layer ahead) and keeps in host memory, measured on fake
tensors. Held to whole traces of the same model under per-layer mixes, to the host copies of a real CPU step, to
brute force over the priced table; planned and applied as a preset's offload is.

The workload makes a hidden state 256 KiB, above what offload leaves on the device (``MIN_BYTES``, 64 KiB): at the
zoo's own (16 KiB) offload moves nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from recompute.checkpointing import apply, find_layers
from recompute.cli import main
from recompute.core import store
from recompute.core.hardware import datasheet_device
from recompute.core.plan import plan
from recompute.core.policy import Policy
from recompute.core.pricing import profile_offload_seconds
from recompute.core.profile import Profile
from recompute.core.search import search
from recompute.core.timing import Device
from recompute.core.workload import Workload
from recompute.models.source import build_source, resolve_source
from recompute.offload import MIN_BYTES, Offloader
from recompute.planning import cost_tables
from recompute.trace import profile, trace

sys.path.insert(0, str(Path(__file__).parent))
from test_profile import config
from test_zoo import WL

pytest.importorskip("transformers")

WL_OFF = dataclasses.replace(WL, seq_len=256, micro_batch=4)
H100 = datasheet_device("h100-80gb")
EVERY = dict.fromkeys(range(8), 0.0)
"""Offload in a table at no cost (memory is what these tests compare)."""

MIXES = [
    ("offload",) * 4,
    ("offload", "offload", "none", "none"),
    ("none", "none", "offload", "offload"),
    ("offload", "none", "offload", "none"),
    ("mlp", "offload", "offload", "mlp"),
    ("none", "offload", "none", "mlp"),
    ("none", "mlp", "none", "offload"),
]
"""Offload next to itself, below and above other layers, first and last; with ``none`` and ``mlp``, whose mixes
the profile composes byte for byte (other policies' mixes are within a few hidden states: tests/test_profile.py)."""


@functools.cache
def measured(kind: str, wl: Workload = WL_OFF) -> tuple[Path, Profile]:
    """A 4-layer config of ``kind`` long enough for ``wl`` and its profile, measured once per session."""
    positions = {"n_positions" if kind == "gpt2" else "max_position_embeddings": wl.seq_len}
    path = config(kind, Path(tempfile.mkdtemp(prefix=f"offload-{kind}-")), **positions)
    return path, profile(resolve_source(str(path)), wl)


def _real_copies(path: Path, layers: tuple[str, ...]) -> tuple[int, int]:
    """Bytes a real CPU step of the model copies to host memory in the forward and back in the backward."""
    out, back = [], []
    copy_out, copy_in = Offloader._copy_out, Offloader._copy_in

    def spy_out(self: Offloader, t: torch.Tensor) -> object:
        stash = copy_out(self, t)
        out.append(stash.host.nbytes)
        return stash

    def spy_in(self: Offloader, stash: object) -> None:
        fresh = stash.fetched is None  # type: ignore[attr-defined]
        copy_in(self, stash)  # type: ignore[arg-type]
        if fresh:
            back.append(stash.fetched.nbytes)  # type: ignore[attr-defined]

    torch.manual_seed(0)
    built = build_source(resolve_source(str(path)))
    model = built.model.train()
    apply(model, Policy(layers=layers))
    idx, targets = torch.randint(128, (2, WL_OFF.micro_batch, WL_OFF.seq_len))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Offloader, "_copy_out", spy_out)
        m.setattr(Offloader, "_copy_in", spy_in)
        _, loss = built.loss_fn(model, idx, targets)
        loss.backward()
    return sum(out), sum(back)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_host_bytes_equal_a_real_steps_copies(kind: str) -> None:
    """Each kind's host bytes (and, on the CPU, its copies back: ``below``) are what a real CPU step of the same
    class copies out and back with one layer of it offloaded; what it keeps on the device is the rest of what it
    saves under ``none``."""
    path, prof = measured(kind)
    for k in prof.kinds:
        layer = k.layers[-1]
        layers = tuple("offload" if i == layer else "none" for i in range(prof.n_layers))
        assert _real_copies(path, layers) == (k.host["offload"], k.below["offload"]), k.name
        assert k.host["offload"] > 10 * MIN_BYTES
        assert k.kept["offload"] + k.host["offload"] == k.kept["none"]
        assert all(k.host[p] == k.below[p] == 0 for p in k.policies if p != "offload")


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_composed_offload_mixes_equal_whole_traces(kind: str) -> None:
    """The table's composed peak, its phase and its host bytes against a whole trace of the model under each mix:
    byte for byte (the held bytes under offload, the layer below's copies in each backward, the host copies)."""
    path, prof = measured(kind)
    source = resolve_source(str(path))
    table = prof.cost_table(offload=EVERY)
    assert prof.offload_shared == 0  # the rotary tables (16 KiB) stay on the device
    for layers in MIXES:
        composed, traced = table.compose(layers), trace(source, WL_OFF, Policy(layers=layers))
        assert (composed.peak, composed.peak_phase) == (traced.peak, traced.peak_phase), layers
        offloaded = sum(prof.kind_of(i).host["offload"] for i, name in enumerate(layers) if name == "offload")
        assert composed.host == traced.host == offloaded, layers


def test_composed_offload_mixes_under_cudas_rules() -> None:
    """The same on fake CPU tensors under CUDA's rules (512-byte blocks: the copies back and the gradients the
    chained step takes off are counted in them), the step ``plan --gpu`` prices."""
    wl = dataclasses.replace(WL_OFF, device="cuda")
    path, prof = measured("llama", wl)
    table = prof.cost_table(offload=EVERY)
    for layers in MIXES:
        composed, traced = table.compose(layers), trace(resolve_source(str(path)), wl, Policy(layers=layers))
        assert (composed.peak, composed.host) == (traced.peak, traced.host), layers


def test_other_policies_mixed_with_offload_stay_within_the_profiles_bound() -> None:
    """Random mixes of every policy with offload: as close as the profile composes any mix (tests/test_profile.py:
    four hidden states), host bytes exact."""
    path, prof = measured("llama")
    source = resolve_source(str(path))
    table = prof.cost_table(offload=EVERY)
    bound = 4 * WL_OFF.micro_batch * WL_OFF.seq_len * 64 * 4
    rng = random.Random(0)
    names = table.options()
    for _ in range(4):
        layers = tuple(rng.choice(names) for _ in range(3))
        layers = (*layers, "offload") if rng.random() < 0.5 else ("offload", *layers)
        composed, traced = table.compose(layers), trace(source, WL_OFF, Policy(layers=layers))
        assert abs(composed.peak - traced.peak) <= bound and composed.host == traced.host, layers


def test_a_shared_table_is_offloaded_once_and_said() -> None:
    """At s = 1024 the rotary tables (1 x s x 16 fp32: 64 KiB each) are offloaded too, once for every offloaded
    layer: the profile measures them, the table says so, and the composed peak and host bytes of a mix are off by
    no more than them."""
    wl = dataclasses.replace(WL, seq_len=1024, micro_batch=1)
    path, prof = measured("llama", wl)
    assert prof.offload_shared == 2 * 1024 * 16 * 4  # cos and sin
    table = prof.cost_table(offload=EVERY)
    assert any("the layers share (rotary tables, masks) once" in n for n in table.notes)
    assert not any("the layers share" in n for n in prof.cost_table().notes)  # no offload, no note
    for layers in (("offload",) * 4, ("none", "offload", "none", "offload")):
        composed, traced = table.compose(layers), trace(resolve_source(str(path)), wl, Policy(layers=layers))
        assert abs(composed.peak - traced.peak) <= prof.offload_shared
        assert traced.host - composed.host == prof.offload_shared


LINK = 15e9
"""A host link (bytes/s) slow enough for a layer's copies to show past its forward (46 us of its 262 us), fast
enough for offload to make the frontier."""


def _slow_link() -> Device:
    """An H100 on ``LINK``."""
    return dataclasses.replace(H100, host_link=LINK)


def test_the_search_over_offload_equals_brute_force() -> None:
    """The one search over a profile's table priced with offload: its frontier is the Pareto set of every
    assignment's composed (peak, seconds), and each budget's cheapest plan the brute force's."""
    _, prof = measured("llama")
    device = _slow_link()
    priced = profile_offload_seconds(prof, device, WL_OFF)
    assert priced is not None and priced[0] > 0
    table = prof.cost_table(device, offload=priced)
    every = [table.compose(layers) for layers in itertools.product(*(table.kind_of(i).options for i in range(4)))]
    pareto: list[float] = []
    for c in sorted(every, key=lambda c: (c.peak, table.cost(c))):
        if not pareto or table.cost(c) < pareto[-1] - 1e-15:
            pareto += [c.peak, table.cost(c)]
    got = [x for c in search(table).frontier for x in (c.peak, table.cost(c))]
    assert got == pytest.approx(pareto, rel=1e-9, abs=1e-15)
    assert any("offload" in c.layers for c in search(table).frontier)
    for budget in pareto[::2]:
        best = min(table.cost(c) for c in every if c.peak <= budget)
        assert plan(table, budget).cost == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_offload_is_priced_by_its_copies() -> None:
    """Seconds per offloaded layer: ``offload_seconds`` of its host bytes against its own forward and backward
    under ``none`` on the host link, and nothing on a device whose compute hides them."""
    _, prof = measured("llama")
    device = _slow_link()
    k = prof.kinds[0]
    forward, backward = k.phase_seconds("none", device)
    copy = k.host["offload"] / LINK
    assert profile_offload_seconds(prof, device, WL_OFF) == {0: max(0, copy - forward) + max(0, copy - backward)}
    assert forward + backward == pytest.approx(k.seconds("none", device))
    fast = dataclasses.replace(H100, host_link=1e13)
    assert profile_offload_seconds(prof, fast, WL_OFF) == {0: 0.0}
    assert profile_offload_seconds(prof, dataclasses.replace(H100, host_link=None), WL_OFF) is None
    assert profile_offload_seconds(prof, dataclasses.replace(H100, kind="cpu"), WL_OFF) is None


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Profile]:
    """The llama profile in a fresh store, where ``plan`` finds it."""
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    path, prof = measured("llama")
    store.save("profiles", prof.key, prof.to_dict())
    return path, prof


def test_a_tight_budget_offloads_where_it_is_cheaper(cached: tuple[Path, Profile]) -> None:
    """On an H100 (its PCIe link; a tiny layer's compute hides its copies) a budget only offloading or replaying
    meets: the plan offloads, at no more cost than the cheapest plan that only replays (this tiny step is
    host-bound on the datasheet's launch cost, so its replays are priced at about nothing: 0, never below)."""
    path, prof = cached
    budget = prof.cost_table(offload=EVERY).compose(("offload",) * 4).peak
    found = cost_tables(str(path), WL_OFF, device=H100, offload=True)
    assert not any("offload not considered" in n for n in found.notes)
    chosen = plan(found.tables, budget)
    replaying = plan(cost_tables(str(path), WL_OFF, device=H100).tables, budget)
    assert "offload" in chosen.layers and "offload" not in replaying.layers
    assert chosen.peak <= budget and 0 <= chosen.cost <= replaying.cost


@pytest.mark.parametrize(
    ("device", "note"),
    [
        (dataclasses.replace(H100, host_link=None), "has no host link bandwidth"),
        (dataclasses.replace(H100, kind="cpu"), "the device is a CPU"),
        (None, "its price is copy time, and costs are flops"),
    ],
    ids=["no-host-link", "cpu", "flops"],
)
def test_offload_not_priced_is_not_considered(cached: tuple[Path, Profile], device: object, note: str) -> None:
    path, _ = cached
    found = cost_tables(str(path), WL_OFF, device=device, offload=True)  # type: ignore[arg-type]
    assert any(n.startswith("offload not considered: ") and note in n for n in found.notes)
    assert not any("offload" in k.options for t in found.tables for k in t.kinds)


def test_a_profile_from_before_offload_says_so(tmp_path: Path) -> None:
    """A profile file stored before offload was measured (no host figures) still reads; its plan leaves offload
    out and says why."""
    _, prof = measured("llama")
    data = prof.to_dict()
    for k in data["kinds"]:
        for key in ("host", "below"):
            del k[key]
        for key in ("kept", "held", "forward_delta", "backward_delta", "backward_flops", "components", "ops"):
            k[key].pop("offload")
        for key in ("backward_ops", "forward_work", "backward_work"):
            k[key].pop("offload")
    for table in data["links"]["0>0"].values():
        table.pop("offload")
    data["links"]["0>0"].pop("offload")
    data["last"].pop("offload")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    found = cost_tables("", WL_OFF, device=H100, offload=True, profile=path)
    assert "offload not considered: the profile predates offload's measurement" in "\n".join(found.notes)


def test_the_plan_file_offloads_and_apply_takes_it(
    cached: tuple[Path, Profile], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``recompute plan`` of the config with offload chosen: the file applies to the model (its offloaded layers
    run through the offloader), and the trace of that policy peaks where the plan says (exactly where it only
    offloads, within the profile's four hidden states where it also replays), with the host bytes it says;
    ``--host-budget`` holds fewer layers' copies."""
    path, prof = cached
    budget = prof.cost_table(offload=EVERY).compose(("offload",) * 4).peak
    args = ["plan", "--model", str(path), "--seq-len", "256", "--micro-batch", "4", "--dtype", "fp32"]
    args += ["--device", "cpu", "--gpu", "h100-80gb", "--budget", str(budget), "--consider", "offload"]
    out = tmp_path / "plan.json"
    assert main([*args, "-o", str(out), "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    layers = tuple(made["policy"]["layers"])
    assert "offload" in layers and made["predicted"]["host"] > 0
    model = build_source(resolve_source(str(path))).model
    apply(model, str(out))
    assert _offloader(model).layers == tuple(i for i, name in enumerate(layers) if name == "offload")
    traced = trace(resolve_source(str(path)), WL_OFF, str(out))
    exact = all(name in ("none", "offload") for name in layers)  # a mix with replays: the profile's bound
    bound = 0 if exact else 4 * WL_OFF.micro_batch * WL_OFF.seq_len * 64 * 4
    assert abs(traced.peak - made["predicted"]["peak"]) <= bound and traced.host == made["predicted"]["host"]
    half = made["predicted"]["host"] / 2
    assert main([*args, "--host-budget", str(half), "--json"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["predicted"]["host"] <= half
    assert capped["policy"]["layers"].count("offload") < layers.count("offload")


def _offloader(model: torch.nn.Module) -> Offloader:
    """The offloader ``apply`` gave the model (every wrapped layer's options hold it)."""
    found = {getattr(layer.__dict__.get("_recompute_options"), "offloader", None) for layer in find_layers(model)}
    (offloader,) = found - {None}
    assert isinstance(offloader, Offloader)
    return offloader
