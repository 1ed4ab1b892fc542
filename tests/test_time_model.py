"""The time model: kernels filed from the fake-tensor trace, priced by a roofline on a device; device profiles,
the datasheet table, calibration, and the commands that show predicted time. Whether the predictions hold is
measured by benchmarks/time_model.py (real steps, paired ratios), not here."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from recompute import ModelSpec, Workload
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.core.hardware import BANDWIDTH_SHARE, GPUS, MATMUL_SHARE, datasheet_device
from recompute.core.plan import plan
from recompute.core.policy import POLICIES
from recompute.core.profile import Profile
from recompute.core.timing import Curve, Device, HostCost, StepWork, merge, mixed_timing, op_class, timing
from recompute.trace import profile, step_work, step_works

SPEC = ModelSpec.from_name("gpt2", hidden=64, n_layers=4, n_heads=4, vocab=512, max_positions=128)
LLAMA = ModelSpec.from_name("llama3.1-8b", hidden=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab=512)
WL = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu", precision="fp32")


def flat_device(kind: str = "cpu", overhead: float = 1e-6) -> Device:
    """A device with round rates: 1 TFLOP/s for every product, 100 GB/s for everything else."""
    return Device(
        name="test",
        kind=kind,
        label="test device",
        compute={"matmul.float32": Curve.flat(1e12)},
        bandwidth={"memory": Curve.flat(1e11)},
        overhead=overhead,
    )


# --- the roofline ---------------------------------------------------------------------------------------------


def test_curve_interpolates_log_log_and_is_flat_beyond_its_ends() -> None:
    c = Curve(((1e6, 1e9), (1e8, 1e11)))
    assert c(1e3) == 1e9 and c(1e12) == 1e11
    assert math.isclose(c(1e7), 1e10)  # halfway in log size is halfway in log rate
    with pytest.raises(ConfigError, match="positive"):
        Curve(((0.0, 1.0),))
    with pytest.raises(ConfigError, match="at least one"):
        Curve(())


@pytest.mark.parametrize(
    ("name", "flops", "cls"),
    [
        ("mm", 10, "matmul"),
        ("bmm", 10, "matmul"),
        ("_scaled_dot_product_flash_attention_for_cpu", 10, "attention"),
        ("_scaled_dot_product_cudnn_attention_backward", 10, "attention"),
        ("gelu", 0, "math"),
        ("gelu_backward[tanh]", 0, "math"),
        ("native_layer_norm_backward", 0, "math"),
        ("_softmax", 0, "math"),
        ("add", 0, "memory"),
        ("copy_", 0, "memory"),
        ("bernoulli_", 0, "memory"),
    ],
)
def test_op_class(name: str, flops: int, cls: str) -> None:
    assert op_class(name, flops) == cls


def test_roofline_pinned() -> None:
    cpu, gpu = flat_device("cpu"), flat_device("cuda")
    compute_bound = ("mm", "float32", 2_000_000_000, 1_000_000, 3)  # 2 ms of FLOPs, 10 us of bytes
    memory_bound = ("mm", "float32", 1_000_000, 100_000_000, 1)  # 1 us of FLOPs, 1 ms of bytes
    tiny = ("add", "float32", 0, 100, 5)  # 1 ns of bytes
    assert math.isclose(cpu.seconds(compute_bound), 3 * (2e-3 + 1e-6))  # the CPU adds the host's overhead
    assert math.isclose(gpu.seconds(compute_bound), 3 * 2e-3)  # a GPU hides it behind the kernel
    assert math.isclose(cpu.seconds(memory_bound), 1e-3 + 1e-6)
    assert math.isclose(gpu.seconds(tiny), 5 * 1e-6)  # launch-bound: the host's issue time
    named = dataclasses.replace(cpu, ops={"add": Curve.flat(1e9)})  # a calibrated op's own rate comes first
    assert math.isclose(named.seconds(("add", "float32", 0, 1_000_000, 1)), 1e-3 + 1e-6)


def test_datasheet_devices_are_the_table_times_stated_shares() -> None:
    for name, gpu in GPUS.items():
        assert gpu.bandwidth > 0 and gpu.peak_tf32 > 0 and gpu.peak_fp32 > 0 and gpu.host_link > 0, name
        d = datasheet_device(name)
        assert d.rate("matmul", "bfloat16", 1e12) == MATMUL_SHARE * gpu.peak_bf16
        assert d.rate("memory", "bfloat16", 1e9) == BANDWIDTH_SHARE * gpu.bandwidth
        assert d.kind == gpu.kind and d.memory == gpu.memory
    assert {"h100-pcie-80gb", "b200-180gb", "mi300x-192gb"} <= set(GPUS)


# --- device profiles ------------------------------------------------------------------------------------------


def test_device_profile_round_trips(tmp_path: Path) -> None:
    d = dataclasses.replace(datasheet_device("a100-80gb"), ops={"gelu": Curve(((1e3, 1e9), (1e6, 2e9)))})
    d.save(tmp_path / "d.json")
    assert Device.load(tmp_path / "d.json") == d


def _device_json(**changes: object) -> str:
    """A good device profile's JSON with ``changes`` (NaN and Infinity written as Python's json writes them)."""
    return json.dumps({**datasheet_device("h100-80gb").to_dict(), **changes})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist; make one with `recompute calibrate -o"),
        ("{not json", "is not valid JSON \\(Expecting property name"),
        ('{"format": "recompute.profile/2"}', "not a recompute.device/1 file"),
        ('{"format": "recompute.device/1", "kind": "tpu"}', "unknown device kind 'tpu'"),
        (_device_json(compute={}), "'compute' must map rate names to curves, at least one"),
        (_device_json(overhead=-1), "'overhead' must be a finite number >= 0, got -1"),
        (_device_json(overhead=float("nan")), "NaN is not a number JSON allows"),
        (_device_json(host_link=float("inf")), "Infinity is not a number JSON allows"),
        (_device_json(overhead="1e-6"), "'overhead' must be a finite number >= 0, got '1e-6'"),
        (_device_json(compute={"matmul.bfloat16": []}), "the curve 'compute.matmul.bfloat16' must be a non-empty"),
        (_device_json(bandwidth={"memory": [[1, 0]]}), "a point of bandwidth.memory' must be a finite number > 0"),
        (_device_json(bandwidth={"math": [[1, 1e9]]}), "needs a 'memory' bandwidth curve"),
        (_device_json(rates={}), "unknown key 'rates'"),
        (_device_json(memory=1.5), "'memory' must be a positive integer or null, got 1.5"),
        ('{"format": "recompute.device/1", "overhead": 1e999}', "the number 1e999 is out of range"),
        (_device_json(network="x"), "'network' must be an object, got 'x'"),
        (_device_json(network={"links": {}}), "unknown key 'network.links'"),
        (_device_json(network={"collectives": [1]}), "'network.collectives' must map collectives to curves"),
        (_device_json(network={"collectives": {"bcast": [[1, 1e9]]}, "ranks": 2}), "unknown collective"),
        (_device_json(network={"collectives": {"all_reduce": [[1, -1e9]]}, "ranks": 2}), "must be a finite number > 0"),
        (_device_json(network={"collectives": {"all_reduce": "fast"}, "ranks": 2}), "must be a non-empty list"),
        (_device_json(network={"collectives": {"all_reduce": [[1, 1e9]]}, "ranks": "two"}), "non-negative integer"),
        (_device_json(network={"collectives": {"all_reduce": [[1, 1e9]]}}), "measured on \\(at least 2\\), got 0"),
        (_device_json(network={"notes": 5}), "'network.notes' must be a list of strings"),
        (_device_json(network={"gpus_per_node": "8"}), "'network.gpus_per_node' must be a positive integer, got '8'"),
        (_device_json(network={"intra": {"name": "x", "bandwidth": -1.0, "latency": 0}}), "intra.bandwidth' must"),
        (_device_json(network={"inter": {"name": "x", "bandwidth": 1e9, "latency": "1"}}), "inter.latency' must"),
        (_device_json(network={"intra": [1]}), "'network.intra' must be a link object, got \\[1\\]"),
    ],
    ids=[
        "missing", "not json", "another format", "unknown kind", "no compute", "negative overhead", "NaN",
        "Infinity", "string", "empty curve", "zero rate", "no memory curve", "unknown key", "fractional memory",
        "overflow", "network not an object", "network unknown key", "collectives a list", "unknown collective",
        "negative bus bandwidth", "collective curve a string", "ranks a string", "collectives without ranks",
        "notes not a list", "gpus per node a string", "negative link bandwidth", "link latency a string",
        "link a list",
    ],
)  # fmt: skip
def test_bad_device_profiles_are_one_line_errors(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "device.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        Device.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_profile_of_another_device_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"profile is of a cuda device .* but this step runs on cpu"):
        datasheet_device("h100-80gb").check_runs_on("cpu")
    calibrated = dataclasses.replace(flat_device("cuda"), source="calibrated by recompute calibrate on NVIDIA A100")
    with pytest.raises(ConfigError, match="calibrated on test device, this step runs on NVIDIA H100"):
        calibrated.check_runs_on("cuda", "NVIDIA H100")
    threads = dataclasses.replace(flat_device("cpu"), threads=1)
    with pytest.raises(ConfigError, match=r"calibrated with 1 CPU thread.*runs with 2.*--threads 2"):
        threads.check_runs_on("cpu", threads=2)
    threads.check_runs_on("cpu", threads=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--model", "gpt2", "--device-profile", "{missing}"],
        ["estimate", "--model", "gpt2", "--device-profile", "{corrupt}"],
        ["plan", "--model", "gpt2", "--budget", "80GiB", "--device-profile", "{missing}"],
        ["plan", "--model", "gpt2", "--budget", "80GiB", "--cost", "flops", "--device-profile", "{corrupt}"],
        ["bench", "--device-profile", "{gpu}", "--steps", "1"],
        ["calibrate", "--device", "cpu", "--threads", "0", "-o", "{out}"],
        ["calibrate", "--device", "cuda", "-o", "{out}"],
    ],
)
def test_cli_refuses_bad_device_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "corrupt.json").write_text("{")
    datasheet_device("h100-80gb").save(tmp_path / "gpu.json")
    paths = {k: str(tmp_path / f"{k}.json") for k in ("missing", "corrupt", "gpu", "out")}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert f"recompute {argv[0]}: error: " in err and "\n" not in err and "Traceback" not in err


# --- the step's kernels ---------------------------------------------------------------------------------------


def test_step_work_files_kernels_not_views() -> None:
    work = step_work(SPEC, WL, "none")
    names = {op[0] for ops in work.phases.values() for op in ops}
    assert {"mm", "addmm", "native_layer_norm", "gelu[tanh]", "gelu_backward[tanh]"} <= names
    assert not names & {"view", "t", "transpose", "expand", "_unsafe_view", "detach", "empty", "alias"}
    assert not any(n.startswith("prim.") for n in names)
    assert work.tokens == 2 * 64
    phases = list(work.phases)
    assert phases[0] == "forward (embedding)" and phases[-1] == "optimizer step"


def test_step_work_flops_are_the_trace_flops() -> None:
    """Two counts of one step: the work signatures' FLOPs add up to the per-op FLOPs PhaseFlops files."""
    from recompute.core.policy import Policy
    from recompute.runtime import TORCH_DTYPES
    from recompute.trace._build import build_meta, fake_kernels
    from recompute.trace._run import _source_of, step_built

    with fake_kernels():
        built = build_meta(_source_of(SPEC, False), attention="eager", dtype=TORCH_DTYPES["fp32"], n_layers=4)
        record, _, _ = step_built(built, WL, Policy("block"), device="cpu", flops=True)
    by_op = sum(sum(ops.values()) for ops in record.flops.values())
    assert by_op == step_work(SPEC, WL, "block").flops() > 0


@pytest.mark.parametrize("spec", [SPEC, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("policy", ["none", "attn", "block"])
def test_scaled_step_work_equals_the_whole_trace(spec: ModelSpec, policy: str) -> None:
    assert step_work(spec, WL, policy, layers=1) == step_work(spec, WL, policy)


@pytest.mark.parametrize("spec", [SPEC, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("wl", [WL, dataclasses.replace(WL, device="cuda", dtype="bf16", attention="flash")])
def test_step_works_in_fewer_traces_equal_the_whole_traces(spec: ModelSpec, wl: Workload) -> None:
    # every policy traced at one layer, the rest of its step from none's: the same kernels as each whole step
    assert step_works(spec, wl, list(POLICIES)) == {p: step_work(spec, wl, p) for p in POLICIES}


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_a_replay_runs_the_layer_forward_again(policy: str) -> None:
    """What a policy adds to a layer's backward is kernels of its forward: the replay, nothing else."""
    none, pol = step_work(SPEC, WL, "none"), step_work(SPEC, WL, policy)
    forward = dict(((o[0], o[1], o[2], o[3]), o[4]) for o in none.phases["forward of layer 1"])
    plain = dict(((o[0], o[1], o[2], o[3]), o[4]) for o in none.phases["backward of layer 1"])
    added = {k: v - plain.get(k, 0) for k, v in ((o[:4], o[4]) for o in pol.phases["backward of layer 1"])}
    replayed = {k: v for k, v in added.items() if v > 0 and k[2] > 0}  # the products it runs again
    assert replayed and all(k in forward and v <= forward[k] for k, v in replayed.items())
    assert pol.flops() > none.flops()


def test_timing_and_mixed_timing() -> None:
    dev = flat_device()
    works = {p: step_work(SPEC, WL, p) for p in ("none", "block")}
    t = timing(works["block"], works["none"], dev)
    assert t.step > works["none"].seconds(dev) and 0 < t.overhead < 1
    assert math.isclose(t.tokens_per_second * t.step, 2 * 64)
    all_block = mixed_timing(works, ["block"] * 4, dev)
    assert math.isclose(all_block.step, t.step) and math.isclose(all_block.overhead, t.overhead)
    half = mixed_timing(works, ["block", "none", "block", "none"], dev)
    assert math.isclose(half.overhead, t.overhead / 2)
    assert StepWork.from_dict(json.loads(json.dumps(works["none"].to_dict()))) == works["none"]


def test_merge_adds_counts() -> None:
    a = (("mm", "float32", 10, 20, 1), ("add", "float32", 0, 8, 2))
    assert merge(a, a[:1]) == (("add", "float32", 0, 8, 2), ("mm", "float32", 10, 20, 2))


# --- profiles and plans on time -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    return profile(SPEC, WL)


def test_profile_times_compose_to_the_whole_step(tiny_profile: Profile) -> None:
    """A uniform assignment's time from the profile's per-kind kernels equals the whole traced step's."""
    dev = flat_device()
    for p in ("none", "attn", "block"):
        whole = step_work(SPEC, WL, p)
        composed = tiny_profile.step_work([p] * SPEC.n_layers)
        assert composed.flops() == whole.flops()
        assert math.isclose(composed.seconds(dev), whole.seconds(dev), rel_tol=1e-3)


def test_profile_prices_replayed_kernels_at_the_host_s_replay_cost(tiny_profile: Profile) -> None:
    """With host costs, a layer's replay is priced from its kernels beyond ``none``'s (``LayerKind.seconds``), as
    the whole step priced against its step under ``none``: the profile's replay times equal the whole traces'."""
    dev = dataclasses.replace(flat_device("cuda"), host=HostCost(10e-6, 100e-6, 2e-6))
    n = SPEC.n_layers
    table = tiny_profile.cost_table(dev)
    none = step_work(SPEC, WL, "none")
    for p in ("attn", "block"):
        whole = step_work(SPEC, WL, p)
        assert math.isclose(table.compose([p] * n).seconds, whole.seconds(dev, none) - none.seconds(dev), rel_tol=1e-3)
        kind = tiny_profile.kind_of(0)
        again = sum(whole.replayed(none).values()) // n
        plain = dataclasses.replace(dev, host=HostCost(10e-6, 10e-6, 2e-6))  # a replayed kernel at the plain cost
        assert math.isclose(kind.recompute_seconds(p, dev) - kind.recompute_seconds(p, plain), again * 90e-6)


def test_plans_on_time_pick_the_least_predicted_time(tiny_profile: Profile) -> None:
    dev = flat_device()
    table = tiny_profile.cost_table(dev)
    budget = table.compose(["block"] * 2 + ["none"] * 2).peak
    by_time = plan(table, budget)
    assert by_time.device == dev.to_dict() and by_time.peak <= budget
    chosen = by_time.chosen.step_seconds
    assert chosen is not None
    for point in by_time.frontier:  # nothing that fits is faster
        if point.peak <= budget:
            assert point.step_seconds is not None and point.step_seconds >= chosen - 1e-12
    data = by_time.to_dict()
    assert data["cost_kind"] == "predicted seconds on test device" and data["predicted"]["step_seconds"] > 0
    assert Profile.from_dict(json.loads(json.dumps(tiny_profile.to_dict()))) == tiny_profile


# --- the commands ---------------------------------------------------------------------------------------------

SMALL = ["--model", "gpt2", "--seq-len", "256", "--micro-batch", "2"]


def test_estimate_shows_predicted_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *SMALL, "--gpu", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "time overhead" in out and "predicted on NVIDIA A100 SXM4 80GB" in out
    assert main(["estimate", *SMALL, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    times = {row["policy"]: row["time"] for row in data["policies"]}
    assert times["none"]["time_overhead"] == 0 and times["block"]["time_overhead"] > times["core_attn"]["time_overhead"]
    assert main(["estimate", *SMALL, "--no-time", "--json"]) == 0
    assert "time" not in json.loads(capsys.readouterr().out)["policies"][0]


def test_plan_costs_time_by_default(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    budget = ["--budget", "3GiB"]
    assert main(["plan", *SMALL, *budget, "--json"]) == 0
    timed = json.loads(capsys.readouterr().out)
    assert timed["cost_kind"] == "predicted seconds on NVIDIA H100 SXM5 80GB"
    assert timed["frontier"][0]["step_seconds"] > 0
    assert main(["plan", *SMALL, *budget, "--cost", "flops", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_kind"] == "FLOPs"
    flat_device("cuda").save(tmp_path / "d.json")
    assert main(["plan", *SMALL, *budget, "--device-profile", str(tmp_path / "d.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_kind"] == "predicted seconds on test device"


def test_calibrate_and_bench_predict_this_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--threads", "1", "--quick", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "overhead per kernel" in printed and "us per replayed kernel" in printed
    assert "operands: cold, each op rotated through" in printed  # Note: [cold operands]
    d = Device.load(out)
    assert d.measured["operand_pool_bytes"] >= 64 << 20
    assert d.kind == "cpu" and d.threads == 1 and d.overhead > 0 and "gelu_backward" in d.ops
    assert d.host is not None and min(d.host.kernel, d.host.replay, d.host.optimizer) >= d.overhead
    assert "gpt: forward and backward" in d.host.source  # --quick times the host on one model
    # a measured rate is finite and positive; how high is a timing a loaded machine moves (issue 38: no unit test
    # asserts a figure load can break; benchmarks/time_model.py measures the predictions)
    assert 0 < d.rate("matmul", "float32", 1e9) < float("inf")
    argv = ["bench", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "32", "--micro-batch", "2"]
    assert main([*argv, "--steps", "1", "--policies", "none,block", "--device-profile", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["predicted_time_overhead"] == 0 and rows[1]["predicted_time_overhead"] > 0
    assert all(r["predicted_step_s"] > 0 for r in rows)


def test_calibration_rotates_copies_of_its_operands() -> None:
    """Note: [cold operands]: each call of a calibrated op takes the next copy of its operands (strides, offset,
    values and requires_grad kept, nested ones too; views of one storage copied together) and its results are kept
    as long; with no pool (a GPU, --operands warm) the operands themselves."""
    import torch

    from recompute.bench._cold import copied, rotation

    base, odd = torch.randn(8, 6), torch.arange(10, dtype=torch.uint8)
    args = (base.t(), base[:, 2:4], 3, torch.ones(5, requires_grad=True), [odd[:8].view(torch.float32)])
    copies = copied(args)
    pairs = [*zip(args[:4], copies[:4]), (args[4][0], copies[4][0])]
    for a, c in pairs:
        if isinstance(a, torch.Tensor):
            assert (c.shape, c.stride(), c.storage_offset()) == (a.shape, a.stride(), a.storage_offset())
            assert torch.equal(c.detach().contiguous().view(torch.uint8), a.detach().contiguous().view(torch.uint8))
            assert c.requires_grad == a.requires_grad
            assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert copies[2] == 3 and copies[0].untyped_storage().data_ptr() == copies[1].untyped_storage().data_ptr()

    seen: list[int] = []

    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(x.data_ptr())
        return x + y

    x, y = torch.ones(256), torch.ones(256)  # 1 KiB each, 1 KiB out: a 12 KiB pool is 4 copies
    call = rotation(add, (x, y), pool=12 * 1024)
    seen.clear()
    for _ in range(8):
        call()
    assert len(set(seen)) == 4 and seen[:4] == seen[4:] and x.data_ptr() not in seen
    call = rotation(add, (x, y), pool=0)
    seen.clear()
    call()
    call()
    assert seen == [x.data_ptr()] * 2


@pytest.mark.parametrize(
    ("sizes", "pool"),
    [(["48K", "2048K", "40M"], 80 << 20), (["32K", "16M"], 64 << 20), (["491520K"], 512 << 20), ([], 256 << 20)],
)
def test_the_operand_pool_is_twice_the_largest_cache_within_bounds(tmp_path: Path, sizes: list[str], pool: int) -> None:
    from recompute.bench._cold import pool_bytes

    for i, size in enumerate(sizes):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert pool_bytes(tmp_path) == pool


def test_the_offloaders_copies_are_not_kernels(tiny_profile: Profile) -> None:
    """The profile's chain runs offloaded layers beside the counted ones: their copies out and back are priced
    over the host link, so no kind's kernels under any policy carry a copy the whole traced step does not."""
    for p in ("none", "mlp"):
        whole, composed = step_work(SPEC, WL, p), tiny_profile.step_work([p] * SPEC.n_layers)
        assert composed.kernels() == whole.kernels()
        for phase, ops in composed.phases.items():
            assert sorted(ops) == sorted(whole.phases[phase]), phase


def test_an_ops_leaves_are_pytrees_in_its_order() -> None:
    """The FLOP counter walks an op's arguments and outputs itself (``_flops._leaves``): the same leaves, in the
    same order, as ``tree_leaves`` on every op of a transformer layer's forward and backward (its tensors' order
    picks an op's dtype)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from recompute.trace._flops import _leaves

    seen: list[object] = []

    class Both(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            seen.extend([(args, kwargs or {}), out])
            return out

    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    x = torch.randn(2, 8, 32, requires_grad=True)
    with Both():
        y = layer(x)
        torch.cat([y, y], dim=1).max(dim=-1).values.sum().backward()
        torch.split(y.detach(), [3, 5], dim=1)
    assert len(seen) > 100
    for tree in seen:
        assert [id(t) for t in _leaves(tree, []) if isinstance(t, torch.Tensor)] == [
            id(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
        ]
