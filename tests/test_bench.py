"""``recompute bench``: real CPU steps per policy; memory as the trace predicts, times split and compared."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from recompute import ModelSpec, Workload
from recompute.bench import BenchResult, bench, bench_spec, render_bench
from recompute.cli import main
from recompute.core.analytic import estimate
from recompute.core.errors import ConfigError
from recompute.trace import trace

SPEC = ModelSpec(hidden=64, n_layers=3, n_heads=4, vocab=256, max_positions=64, name="tiny-gpt")
WL = Workload(attention="eager", micro_batch=2, seq_len=64, dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def result() -> BenchResult:
    calls: list[tuple[str, int, int]] = []
    r = bench(SPEC, WL, ["none", "block"], steps=2, warmup=1, progress=lambda *c: calls.append(c))
    assert calls[0] == ("none: warm-up 1/1", 0, 8) and calls[-2:] == [("block: step 2/2", 7, 8), ("done", 8, 8)]
    return r


def test_memory_is_what_the_fake_trace_predicts(result: BenchResult) -> None:
    """The CPU peak comes from MemTracker on the real step, and equals the fake trace's byte for byte."""
    for row, policy in zip(result.rows, ("none", "block")):
        fake = trace(SPEC, WL, policy)
        assert row.peak == row.traced_peak == fake.peak
        assert row.activations == fake.activations


def test_block_recompute_trades_memory_for_time(result: BenchResult) -> None:
    none, block = result.rows
    assert block.activations < none.activations and result.peak_drop(block) > 0
    assert result.overhead(none) == 0 and result.peak_drop(none) == 0
    assert block.predicted_overhead == pytest.approx(estimate(SPEC, WL, "block").overhead)
    for row in result.rows:
        assert row.step_s == pytest.approx(row.forward_s + row.backward_s + row.optimizer_s, rel=0.5)
        assert row.tokens_per_s == pytest.approx(WL.tokens / row.step_s)
        assert len(row.step_times) == result.steps and row.step_s == statistics.median(row.step_times)


def test_render_shows_the_headline_pair(result: BenchResult) -> None:
    text = render_bench(result)
    drop, slower = 100 * result.peak_drop(result.rows[1]), 100 * result.overhead(result.rows[1])
    assert f"block vs none: peak memory {drop:.1f}% lower, step time {slower:.1f}% higher" in text
    assert result.to_dict()["rows"][1]["peak_drop"] == result.peak_drop(result.rows[1])


def test_default_model_is_a_cpu_sized_gpt2() -> None:
    spec, hf = bench_spec(None)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.vocab, spec.dropout) == (6, 384, 6, 50257, 0.1)
    assert not hf
    assert bench_spec(None, n_layers=2)[0].n_layers == 2


def test_cli_json_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64"]
    argv += ["--seq-len", "16", "--micro-batch", "1", "--steps", "1", "--warmup", "0", "--device", "cpu", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert [r["policy"] for r in data["rows"]] == ["none", "block"] and data["steps"] == 1
    assert err.strip().splitlines()[-1] == "bench: 4/4 done"  # plain progress lines: stderr is no terminal


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "2048"], "exceeds gpt2's 1024 positions"),
        (["--policies", "none,everything"], "is not a policy"),
        (["--model", "llama3.1-8b"], "too many to run real steps of here; shrink it"),
        (["--tp", "2"], "--tp 2 needs torchrun: torchrun --nproc-per-node 2 -m recompute bench --device cpu --tp 2"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("recompute bench: error:") and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="device cuda needs a CUDA build of PyTorch"):
        bench(SPEC, Workload(attention="eager", micro_batch=2, seq_len=64, dtype="fp32", device="cuda"))


def test_bench_takes_a_plan_file_and_keeps_gradients_on_request(tmp_path, capsys) -> None:
    from recompute.cli import main

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": ["block", "none"]}))
    workload = "--layers 2 --hidden 32 --heads 2 --vocab 64 --seq-len 64 --micro-batch 4 --device cpu"
    argv = [
        "bench",
        *workload.split(),
        "--steps",
        "1",
        "--warmup",
        "0",
        "--policies",
        "none",
        "--plan",
        str(plan),
        "--json",
    ]
    peaks = []
    for extra in ([], ["--keep-grads"]):
        assert main(argv + extra) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert [r["policy"] for r in rows] == ["none", "per-layer none x1, block x1"]
        peaks.append(rows[1]["peak"])
    assert peaks[1] > peaks[0]  # gradients kept allocated between steps add to the peak


def test_loss_modes_side_by_side_with_offload() -> None:
    """``--loss-modes full,chunked``: every policy under both losses, the chunked rows measured as the trace of
    the chunked step predicts; the planner's measured costs read the workload's loss mode only."""
    wl = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu")
    spec = ModelSpec(hidden=64, n_layers=2, n_heads=4, vocab=4096, max_positions=64, name="wide-vocab")
    r = bench(spec, wl, ["none", "block", "offload"], steps=1, warmup=1, losses=["full", "chunked"])
    assert [(row.policy, row.loss) for row in r.rows] == [
        (p, loss) for loss in ("full", "chunked") for p in ("none", "block", "offload")
    ]
    chunked = Workload(micro_batch=2, seq_len=64, dtype="fp32", device="cpu", loss="chunked")
    for row in r.rows:
        at = chunked if row.loss == "chunked" else wl
        assert row.peak == trace(spec, at, row.policy).peak  # the real step, byte for byte
    full_none, chunked_none = r.rows[0], r.rows[3]
    assert chunked_none.peak < full_none.peak and chunked_none.activations < full_none.activations
    assert r.rows[5].peak < min(r.rows[2].peak, r.rows[3].peak)  # offload and the chunked loss add up
    assert list(r.step_times()) == ["none", "block", "offload"]  # the workload's loss (full) only
    text = render_bench(r)
    assert "offload, chunked loss" in text and "none, chunked loss vs none" in text


def test_bad_loss_modes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq-len", "16"]
    assert main([*argv, "--no-time", "--loss-modes", "full,sometimes"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "loss" in err
