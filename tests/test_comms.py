"""Communication priced (issue 25): the collectives a rank's traced step runs, the link model, the layout of
groups on nodes, the step laid out on a job (pipeline, data parallelism, overlap), and the CLI around them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recompute import ConfigError, ModelSpec, Workload
from recompute.core.comms import BASE_LATENCY, TREE_SHARE, Layout, Link, Network, bus_factor, comms_of, summarize
from recompute.core.hardware import GPUS, IB_HDR, NVLINK3, datasheet_network
from recompute.core.pricing import (
    Job,
    choose_device,
    host_link,
    layer_costs,
    network_notes,
    offload_layer_seconds,
    step_time,
    timings,
)
from recompute.core.timing import Curve, Device, Op, StepWork
from tiny import tiny_gpt, tiny_llama

# --- the link model ------------------------------------------------------------------------------------------


def test_bus_factors_are_nccl_tests() -> None:
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == bus_factor("all_to_all", 8) == 7 / 8
    assert bus_factor("send_recv", 2) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ConfigError, match="unknown collective 'broadcast'"):
        bus_factor("broadcast", 2)


def test_ring_and_tree_follow_nccls_model() -> None:
    """100 MB all-reduced over 8 A100s on NVLink: the ring (8.4 + 14 x 3.4 us, then 1.75 S / 240 GB/s) beats the
    tree (8.4 + 2 x 7 x 3.4 us, then S / (0.46 x 240 GB/s)); across 2 nodes the adapters of a node side by side."""
    net = datasheet_network("a100-80gb")
    s = 100e6
    ring = BASE_LATENCY + 14 * 3.4e-6 + s * 1.75 / 240e9
    assert net.seconds("all_reduce", s, 8) == pytest.approx(ring, rel=1e-12)
    assert net._tree("all_reduce", s, 8, 1) == pytest.approx(BASE_LATENCY + 14 * 3.4e-6 + s / (TREE_SHARE * 240e9))
    assert net.seconds("all_gather", s, 8) == pytest.approx(BASE_LATENCY + 7 * 3.4e-6 + s * 7 / 8 / 240e9)
    assert net.busbw(16, 2) == min(240e9, 8 * 0.8 * 25e9)  # 8 HDR adapters of 25 GB/s, at 80 %
    assert net.busbw(4, 4) == 0.8 * 25e9  # one rank per node: its own adapter
    assert net.seconds("all_reduce", s, 1) == 0.0


def test_small_messages_over_many_nodes_take_the_tree() -> None:
    net = Network(NVLINK3, IB_HDR)
    ring, tree = net._ring("all_reduce", 1e3, 256, 256), net._tree("all_reduce", 1e3, 256, 256)
    assert tree < ring and net.seconds("all_reduce", 1e3, 256, 256) == tree


def test_measured_collectives_replace_the_model_within_a_node() -> None:
    curve = Curve(((1e3, 1e8), (1e7, 1e9)))
    net = Network(NVLINK3, IB_HDR, measured={"all_reduce": curve}, ranks=2, backend="gloo")
    assert net.seconds("all_reduce", 1e7, 4) == pytest.approx(1e7 * 1.5 / 1e9)
    model = Network(NVLINK3, IB_HDR)
    assert net.seconds("all_gather", 1e7, 4) == model.seconds("all_gather", 1e7, 4)  # not measured: the model
    assert net.seconds("all_reduce", 1e7, 16, 2) == model.seconds("all_reduce", 1e7, 16, 2)  # across nodes too
    assert Network.from_dict(net.to_dict()) == net


def test_every_gpu_row_names_its_links() -> None:
    for gpu in GPUS.values():
        for link in (gpu.intra, gpu.inter):
            assert isinstance(link, Link) and link.bandwidth > 0 and link.latency > 0 and link.source, gpu.name


# --- where groups sit ----------------------------------------------------------------------------------------


def test_layout_puts_tensor_parallelism_innermost() -> None:
    lay = Layout(tp=8, dp=4, pp=2, gpus_per_node=8)
    assert lay.group("tp") == (8, 1) and lay.group("dp") == (4, 4) and lay.group("pp") == (2, 2)
    small = Layout(tp=2, dp=2, pp=2, gpus_per_node=8)
    assert small.group("dp") == (2, 1) and small.group("pp") == (2, 1)
    assert Layout(tp=2, dp=8, gpus_per_node=8).group("dp") == (8, 2)


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (Layout(tp=3, gpus_per_node=8), "a tp group of 3 ranks does not divide into nodes of gpus_per_node 8"),
        (Layout(tp=2, dp=3, gpus_per_node=4), "a tp\\*dp group of 6 ranks"),
        (Layout(tp=4, pp=3, gpus_per_node=8), "t\\*d\\*p = 12 GPUs do not fill whole nodes of gpus_per_node 8"),
    ],
    ids=["tp", "tp*dp", "world"],
)
def test_layouts_that_do_not_tile_nodes_are_refused(layout: Layout, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        layout.check()


# --- the step laid out on a job ------------------------------------------------------------------------------


def _flat_device() -> Device:
    """1 TFLOP/s matmuls, 1 TB/s memory, no overhead; an NVLink of 100 GB/s bus bandwidth, no latency."""
    flat = Curve.flat
    link = Link("test link", 125e9, 0.0, "test", busbw=100e9)
    net = Network(link, link).to_dict() | {"gpus_per_host_link": 2}
    return Device(
        "test",
        "cuda",
        "test GPU",
        compute={"matmul.bfloat16": flat(1e12)},
        bandwidth={"memory": flat(1e12)},
        overhead=0.0,
        host_link=10e9,
        network=net,
    )


AR = BASE_LATENCY + 1e6 / 100e9
"""One 1 MB all-reduce over 2 ranks on the test link: NCCL's base latency and 10 us at 100 GB/s."""


def _work(replay: int = 0) -> StepWork:
    """Two layers: a 1 ms forward matmul with one 1 MB all-reduce over 2 ranks (``AR``), a 2 ms
    backward with one (hidden behind its weight matmuls) and ``replay`` replayed ones (inline)."""
    ar = ("comm.all_reduce.tp.2", "bfloat16", 0, 1_000_000, 1)
    replayed = ("comm.all_reduce.tp.2.replay", "bfloat16", 0, 1_000_000, replay)
    phases: dict[str, tuple[Op, ...]] = {"forward (embedding)": (("mm", "bfloat16", 10**9, 0, 1),)}
    for i in range(2):
        phases[f"forward of layer {i}"] = (("mm", "bfloat16", 10**9, 0, 1), ar)
    for i in (1, 0):
        phases[f"backward of layer {i}"] = (("mm", "bfloat16", 2 * 10**9, 0, 1), ar, *([replayed] if replay else []))
    phases["optimizer step"] = (("add", "float32", 0, 10**9, 1),)
    return StepWork(phases, tokens=1024)


def test_forward_and_replayed_collectives_are_inline_backward_ones_hidden() -> None:
    device, job = _flat_device(), Job(Workload(tp=2), n_layers=2)
    st = step_time(_work(), device, job)
    assert st.compute == pytest.approx(1e-3 + 2 * 3e-3)
    assert st.tp == pytest.approx(2 * AR)  # the forward's two; the backward's hide behind 1 ms of weight matmuls
    assert st.comm == pytest.approx(4 * AR)
    assert st.optimizer == pytest.approx(1e-3) and st.step == pytest.approx(st.compute + st.tp + st.optimizer)
    replayed = step_time(_work(replay=1), device, job, base=_work())
    assert replayed.tp == pytest.approx(4 * AR)  # and the two replays


def test_pipeline_bubble_sends_and_data_parallel_reduction() -> None:
    """p = 2 stages of one layer, v = 1, m = 4 micro-batches; d = 2 reducing 10**8 fp32 gradients (mixed)."""
    device = _flat_device()
    wl = Workload(tp=2, pp=2, n_microbatches=4, dp=2)
    job = Job(wl, n_layers=2, params=10**8, boundary=2e6)
    st = step_time(_work(), device, job)
    layer = 3e-3 + AR  # one layer's kernels and its forward all-reduce
    assert st.compute + st.tp == pytest.approx(layer + 1e-3)  # the stage's layer and the embedding
    gather = BASE_LATENCY + 4e6 / 2 / 100e9  # the scatter/gather optimisation: b s h / t sent, all-gathered
    assert st.p2p == pytest.approx(2 * (BASE_LATENCY + 2e6 / 100e9 + gather))  # forward and backward, one boundary
    assert st.bubble == 1 and st.microbatches == 4 and st.tokens == 4 * 1024 * 2
    reduce = BASE_LATENCY + 10**8 * 4 * 1.0 / 100e9  # all-reduce of 400 MB over 2 ranks: factor 1
    assert st.dp == pytest.approx(max(reduce / 1, reduce - (1e-3 + 1e-3 + 2e-3)))
    assert st.step == pytest.approx(st.microbatch * 5 + st.optimizer + st.dp)
    assert st.optimizer == pytest.approx(0.5e-3)  # the stage's share


def test_layer_costs_add_up_to_the_uniform_steps() -> None:
    """A uniform policy's layer costs, over the stage's layers and the p stages, are its step minus none's."""
    device = _flat_device()
    works = dict.fromkeys(("none", "core_attn", "attn", "mlp", "attn+mlp"), _work())
    works["block"] = _work(replay=1)
    job = Job(Workload(tp=2, pp=2, n_microbatches=4, interleave=1), n_layers=2)
    seconds, step = layer_costs(works, device, job)
    block = step_time(works["block"], device, job, base=works["none"]).step
    assert 2 * seconds["block"] * 1 == pytest.approx(block - step)  # p x (stage layers = 1) x per layer
    assert seconds["none"] == 0.0
    (t,) = timings(works, [["block", "block"]], device, job)
    assert t.step == pytest.approx(block)


def test_offload_shares_the_host_link_of_a_pcie_switch() -> None:
    device = _flat_device()
    assert host_link(device, Job(Workload())) == 10e9  # one GPU: the link to itself
    assert host_link(device, Job(Workload(tp=2))) == 5e9  # two GPUs behind one switch copy at once
    one = offload_layer_seconds(_work(), 1e8, device, Job(Workload(), n_layers=2))
    two = offload_layer_seconds(_work(), 1e8, device, Job(Workload(tp=2), n_layers=2))
    assert one == pytest.approx(2 * (1e8 / 10e9) - 1e-3 - 2e-3) and two == pytest.approx(2 * (1e8 / 5e9) - 3e-3)


# --- devices and notes ----------------------------------------------------------------------------------------


def test_a_profile_without_collectives_falls_back_to_the_datasheet_and_says_so(tmp_path: Path) -> None:
    profile = tmp_path / "device.json"
    calibrated = {**choose_device(gpu="a100-80gb").to_dict(), "source": "calibrated by hand", "network": {}}
    profile.write_text(json.dumps(calibrated))
    device = choose_device(device_profile=profile, gpu="a100-80gb")
    notes = network_notes(device, Workload(tp=2))
    assert any("has no collectives measured" in n and "NVLink 3" in n for n in notes)
    assert network_notes(device, Workload()) == []  # one GPU: nothing to say
    with pytest.raises(ConfigError, match="gpus_per_node must be a positive integer"):
        choose_device(gpus_per_node=0)


# --- the trace -----------------------------------------------------------------------------------------------


def _layer_comms(spec: ModelSpec, policy: str, sp: bool) -> dict[tuple[str, str], int]:
    from recompute.trace import step_work

    wl = Workload(attention="eager", micro_batch=2, seq_len=32, dtype="fp32", device="cpu", tp=2, sp=sp)
    work = step_work(spec, wl, policy)
    rows = comms_of({k: v for k, v in work.phases.items() if k.endswith("of layer 1")})
    out: dict[tuple[str, str], int] = {}
    for c in rows:
        assert c.group == "tp" and c.ranks == 2 and c.nbytes == 2 * 32 * 64 * 4  # b s h fp32, whole
        out[c.phase, c.kind] = out.get((c.phase, c.kind), 0) + c.count
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("policy", ["none", "core_attn", "block"])
def test_a_rank_files_its_collectives_and_a_replay_runs_them_again(policy: str, sp: bool) -> None:
    """GPT, t = 2, one layer: Megatron's two all-reduces per pass (with SP: an all-gather before each
    column-parallel linear, a reduce-scatter after each row-parallel one, the shard gathered again for the weight
    gradients); ``block`` replays the forward's, ``core_attn`` none."""
    found = _layer_comms(tiny_gpt(), policy, sp)
    if sp:
        expected = {("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 2}
        expected |= {("backward", "all_gather"): 4, ("backward", "reduce_scatter"): 2}
        replay = {("replay", "all_gather"): 2, ("replay", "reduce_scatter"): 2}
    else:
        expected = {("forward", "all_reduce"): 2, ("backward", "all_reduce"): 2}
        replay = {("replay", "all_reduce"): 2}
    assert found == (expected | replay if policy == "block" else expected)


def test_a_tensor_parallel_rank_counts_its_local_flops() -> None:
    """DTensor ops reach the trace with global shapes; a rank runs the local kernel: t = 2 halves a layer's FLOPs."""
    from recompute.trace import step_work

    spec = tiny_llama()
    wl = Workload(attention="eager", micro_batch=2, seq_len=32, dtype="fp32", device="cpu")

    def layer_flops(w: Workload) -> int:
        work = step_work(spec, w, "none")
        return sum(op[2] * op[4] for k, ops in work.phases.items() if "of layer" in k for op in ops)

    assert layer_flops(Workload(**{**wl.to_dict(), "tp": 2})) * 2 == layer_flops(wl)


def test_summarize_adds_up_by_phase_and_kind() -> None:
    rows = summarize(comms_of(_work(replay=1).phases))
    assert [(r["phase"], r["kind"], r["count"], r["bytes"]) for r in rows] == [
        ("forward", "all_reduce", 2, 2_000_000),
        ("backward", "all_reduce", 2, 2_000_000),
        ("replay", "all_reduce", 2, 2_000_000),
    ]


# --- the command line ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "2", "--gpus-per-node", "3"], "--gpus-per-node 3 GPUs (nor do they divide into it)"),
        (["--tp", "4", "--pp", "3", "--gpus-per-node", "8"], "t*d*p = 12 GPUs do not fill whole nodes"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive integer, got 0"),
    ],
    ids=["group", "nodes", "zero"],
)
def test_bad_gpus_per_node_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from recompute.cli import main

    assert main(["estimate", "--model", "gpt2", "--seq-len", "256", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_estimate_prices_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.cli import main

    argv = ["estimate", "--model", "gpt2", "--seq-len", "256", "--tp", "2", "--sp", "--policy", "block", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {p["policy"]: p for p in data["policies"]}
    block, none = rows["block"]["time"], rows["none"]["time"]
    assert block["time_overhead"] > 0 and none["step"]["comm_seconds"] > 0
    replayed = {(c["phase"], c["kind"]): c["count"] for c in block["collectives"]}
    assert replayed["replay", "all_gather"] == replayed["replay", "reduce_scatter"] == 2 * 12  # 2 per layer
    assert ("replay", "all_gather") not in {(c["phase"], c["kind"]) for c in none["collectives"]}
    assert math.isclose(block["step_seconds"], block["step"]["step_seconds"])


def test_calibrate_collectives_and_bench_predict_under_torchrun(tmp_path: Path) -> None:
    """``calibrate --collectives`` on 2 gloo ranks, then ``bench --tp 2 --sp`` predicts each row with them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "recompute"]
    profile = tmp_path / "device.json"
    done = subprocess.run(
        [*run, "calibrate", "--collectives", "--quick", "-o", str(profile), "--json"],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    network = json.loads(profile.read_text())["network"]
    assert set(network["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert network["ranks"] == 2 and network["backend"] == "gloo"
    assert all(busbw > 0 for pts in network["collectives"].values() for _, busbw in pts)
    host = json.loads(profile.read_text())["host"]  # fitted on real TP and TP+SP steps of the two host models
    assert host["parallel"] >= 0 and host["collective"] > 0  # a gloo collective in a step waits beyond its curve
    assert all(f"{m} {mode}: " in host["source"] for m in ("gpt", "llama") for mode in ("TP", "TP+SP"))
    cmd = ["bench", "--tp", "2", "--sp", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128"]
    cmd += ["--seq-len", "32", "--micro-batch", "2", "--policies", "none,block", "--steps", "1", "--json"]
    done = subprocess.run(
        [*run, *cmd, "--device-profile", str(profile)], env=env, capture_output=True, text=True, timeout=900,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert all(row["predicted_s"] > 0 for row in result["rows"])
    assert any("collectives measured on 2 ranks (gloo)" in n for n in result["notes"])


MOE_CONFIG = Path(__file__).parent.parent / "benchmarks" / "results" / "planner" / "qwen3moe.json"
"""A Qwen3-MoE shape: 6 layers (layer 0 dense), 8 experts, top-2, hidden 128."""


def test_expert_parallelism_adds_each_moe_layers_all_to_alls(capsys: pytest.CaptureFixture[str]) -> None:
    """--analytic --ep 2 on a transformers MoE config: its class traced on one device, two all-to-alls (dispatch,
    combine) per MoE layer in the forward, the backward, and the replay of a policy that recomputes the experts."""
    from recompute.cli import main

    argv = ["estimate", "--model", str(MOE_CONFIG), "--analytic", "--ep", "2", "--seq-len", "64"]
    argv += ["--micro-batch", "2", "--dtype", "fp32", "--device", "cpu", "--json"]
    assert main(argv) == 0
    rows = {p["policy"]: p["time"] for p in json.loads(capsys.readouterr().out)["policies"]}
    size = 2 * 64 * 2 * 128 * 4  # b s k copies routed to the rank (expected load), h fp32 each
    for policy, time_ in rows.items():
        found = {(c["phase"], c["kind"], c["group"]): (c["count"], c["bytes"]) for c in time_["collectives"]}
        expected = {("forward", "all_to_all", "ep"): (10, 10 * size), ("backward", "all_to_all", "ep"): (10, 10 * size)}
        if policy in ("mlp", "attn+mlp", "block"):
            expected[("replay", "all_to_all", "ep")] = (10, 10 * size)
        assert found == expected, policy
    assert rows["mlp"]["time_overhead"] > 0 and rows["none"]["step"]["tokens"] == 2 * 64 * 2  # two ranks' batches


def test_tensor_parallel_transformers_class_is_not_timed_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.cli import main

    argv = ["estimate", "--model", str(MOE_CONFIG), "--analytic", "--tp", "2", "--seq-len", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "times: not predicted (tensor parallelism of transformers' class" in out
