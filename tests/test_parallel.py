"""Tensor and sequence parallelism (``recompute.parallel``): same numbers as one process, per-rank bytes as
the analytic model says, FSDP2 composition, and the errors.

The multi-rank checks run in one torchrun per suite (``tests/dist/tp_worker.py``, gloo on the CPU), each
doing many checks and writing their outcomes as JSON; the fake-process-group checks run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from recompute import ConfigError, Workload
from recompute.checkpointing import apply
from recompute.core.analytic import layer_activations
from recompute.parallel import check_parallel, init_from_env, parallelize, under_torchrun
from recompute.trace import saved_bytes_per_layer
from tiny import tiny_gpt, tiny_llama

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = Path(__file__).parent / "dist" / "tp_worker.py"


def run_worker(suite: str, nproc: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{suite}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(WORKER), "--suite", suite, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tp_suite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_worker("tp", 2, tmp_path_factory.mktemp("tp"))


def failures(result: dict[str, Any], prefix: str) -> list[str]:
    rows = [c for c in result["checks"] if c["name"].startswith(prefix)]
    assert rows, f"no checks named {prefix!r}"
    return [f"{c['name']}: {c['detail']}" for c in rows if not c["ok"]]


@pytest.mark.parametrize("mode", ["TP ", "TP+SP "])
def test_tp_matches_one_process_under_every_policy(tp_suite: dict[str, Any], mode: str) -> None:
    """GPT and Llama, policies none / core_attn / attn+mlp / block applied after parallelize, t=2."""
    assert not failures(tp_suite, mode)


def test_per_rank_saved_bytes_are_the_analytic_models(tp_suite: dict[str, Any]) -> None:
    """Within 5 % as asked; in fact equal to the byte, component group by component group."""
    assert not failures(tp_suite, "memory ")
    for row in tp_suite["memory"]:
        assert row["measured"] == [row["analytic"]] * len(row["measured"]), row


def test_sequence_parallel_divides_what_tp_alone_keeps_whole(tp_suite: dict[str, Any]) -> None:
    """The paper's 10sbh of norms and dropout masks and the Q/K/V and fc inputs: /t with SP (here t=2)."""
    rows = {(r["model"], r["mode"], r["policy"]): r["measured"][0] for r in tp_suite["memory"]}
    for model in ("gpt p=0", "gpt p=0.1", "llama"):
        assert rows[model, "TP+SP", "block"] * 2 == rows[model, "TP", "block"]
        assert rows[model, "TP+SP", "attn+mlp"] * 2 == rows[model, "TP", "attn+mlp"]


def test_fsdp2_dp2_matches_one_process(tp_suite: dict[str, Any]) -> None:
    assert not failures(tp_suite, "FSDP2 dp=2 tp=1")
    assert not failures(tp_suite, "memory FSDP2")


def test_fsdp2_dp2_with_tp2_and_sp_matches_one_process(tmp_path: Path) -> None:
    assert not failures(run_worker("fsdp-tp", 4, tmp_path), "FSDP2 dp=2 tp=2")


# --- one rank of a larger group, on fake tensors (what the trace does) ------------------------------------


@pytest.fixture
def fake_group() -> Iterator[int]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield 4
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fake_rank_saves_what_the_analytic_model_says(fake_group: int, name: str, sp: bool) -> None:
    """Rank 0 of t=4 (Llama: t=2, its KV heads), parameters fake: nothing allocated, every byte as analytic."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from recompute.models.source import ModelSource
    from recompute.trace._build import build_meta, fakeify

    spec = tiny_gpt(dropout=0.1) if name == "gpt" else tiny_llama()
    t = min(fake_group, spec.n_kv_heads)
    mesh = init_device_mesh("cpu", (fake_group // t, t), mesh_dim_names=("dp", "tp"))["tp"]
    mode = FakeTensorMode()
    built = build_meta(ModelSource.preset(spec), attention="eager", dtype=torch.float32)
    model = fakeify(built.model, mode).train()
    with mode:
        parallelize(model, mesh, sp=sp)
        idx = torch.zeros(2, 32, dtype=torch.long)
        wl = Workload(attention="eager", micro_batch=2, seq_len=32, dtype="fp32", device="cpu", tp=t, sp=sp)
        for policy in ("none", "core_attn", "block"):
            apply(model, policy)
            measured = [sum(m.values()) for m in saved_bytes_per_layer(model, (idx, idx))]
            assert measured == [layer_activations(spec, wl).stored(policy)] * spec.n_layers


def test_parallelize_refuses_other_models_and_meshes(fake_group: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    with pytest.raises(ConfigError, match="parallelize takes recompute's GPT or Llama, got Linear"):
        parallelize(nn.Linear(4, 4), mesh["tp"])
    from recompute.models import build_model

    with pytest.raises(ConfigError, match=r"2-D mesh with dims \('dp', 'tp'\), got 2-D dims \('pp', 'tp'\)"):
        parallelize(build_model(tiny_llama(), attention="eager"), mesh)
    with pytest.raises(ConfigError, match="tp 4 must divide the 2 key/value heads"):
        parallelize(build_model(tiny_llama(), attention="eager"), init_device_mesh("cpu", (4,)))
    model = parallelize(build_model(tiny_gpt(), attention="eager"), init_device_mesh("cpu", (4,)))
    with pytest.raises(ConfigError, match="parallel already"):
        parallelize(model, init_device_mesh("cpu", (4,)))


def test_sequence_not_divisible_by_t_is_refused_at_the_first_forward(fake_group: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from recompute.models import build_model

    model = parallelize(build_model(tiny_gpt(dropout=0.0), attention="eager"), init_device_mesh("cpu", (4,)), sp=True)
    with pytest.raises(ConfigError, match=r"with sp the sequence length \(30\) must be divisible by tp \(4\)"):
        model(torch.zeros(1, 30, dtype=torch.long))


# --- errors ------------------------------------------------------------------------------------------------


def test_check_parallel_names_the_fix() -> None:
    gpt, llama = tiny_gpt(), tiny_llama()
    check_parallel(llama, tp=2, seq_len=64, sp=True)
    check_parallel(gpt, tp=4, seq_len=30, sp=False)  # without SP the sequence is not split
    with pytest.raises(ConfigError, match="tp 3 must divide the 4 query heads of custom"):
        check_parallel(gpt, tp=3, seq_len=30, sp=False)
    with pytest.raises(ConfigError, match=r"tp 4 must divide the 2 key/value heads of custom; use tp <= 2"):
        check_parallel(llama, tp=4, seq_len=64, sp=True)
    with pytest.raises(ConfigError, match=r"with sp the sequence length \(30\) must be divisible by tp \(4\)"):
        check_parallel(gpt, tp=4, seq_len=30, sp=True)


def test_init_from_env_needs_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not under_torchrun()
    with pytest.raises(ConfigError, match=r"^--tp 2 needs torchrun: torchrun --nproc-per-node 2 -m recompute"):
        init_from_env(tp=2)
    with pytest.raises(ConfigError, match=r"^--tp 2 --dp 2 needs torchrun: torchrun --nproc-per-node 4 .* train$"):
        init_from_env(tp=2, dp=2, argv=["train"])


def test_init_from_env_checks_the_process_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert under_torchrun()
    with pytest.raises(ConfigError, match="--tp 2 needs 2 processes but torchrun started 1"):
        init_from_env(tp=2)


def test_bench_tp_under_torchrun_reports_per_rank_bytes_as_analytic(tmp_path: Path) -> None:
    """``torchrun -m recompute bench --tp 2 --sp --json``: rank 0's table, TP and TP+SP, kept bytes as analytic."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "recompute"]
    cmd += ["bench", "--tp", "2", "--sp", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128"]
    cmd += ["--seq-len", "32", "--micro-batch", "2", "--policies", "none,core_attn,block", "--steps", "1", "--json"]
    cmd += ["--no-time"]  # predicted steps: tests/test_comms.py
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # rank 0 alone prints
    rows = {(r["mode"], r["policy"]): r for r in result["rows"]}
    assert set(rows) == {(m, p) for m in ("TP", "TP+SP") for p in ("none", "core_attn", "block")}
    for row in rows.values():
        assert row["measured"] == row["analytic"]
        assert row["paper"] is not None  # GPT-2 with dropout: the paper's setting
        assert row["predicted_s"] is None
    assert rows["TP+SP", "none"]["measured"] < rows["TP", "none"]["measured"]


def test_bench_tp_without_torchrun_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.cli import main

    assert main(["bench", "--tp", "2", "--sp"]) == 2
    err = capsys.readouterr().err.strip()
    fix = "torchrun --nproc-per-node 2 -m recompute bench --tp 2 --sp"
    assert err == f"recompute bench: error: --tp 2 needs torchrun: {fix}"
