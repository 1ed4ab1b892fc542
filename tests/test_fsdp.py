"""``--fsdp --dp d``: one rank of FSDP2 full shard, traced on fake tensors and held to real gloo ranks.

The fake trace's model states must be FSDP2's rule to the byte (a parameter's dim 0 padded to d * ceil(rows / d)
on every rank; AdamW's moments of the unpadded local rows), its scaled traces equal to whole ones, its refusals
one line; and each rank of a real FSDP2 step on CPU ranks over gloo (``recompute.bench._fsdp``) must equal the
fake trace of that rank, every phase's peak and every state. benchmarks/fsdp_truth.py runs the wider matrix.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from recompute import ConfigError, Workload
from recompute._compat import require_fsdp
from recompute.bench import bench_spec
from recompute.bench._fsdp import Case, figures, real_figures
from recompute.cli import main
from recompute.core.policy import Policy
from recompute.core.spec import ModelSpec
from recompute.models.source import ModelSource, build_source
from recompute.parallel import mixed_dtype
from recompute.trace import profile, step_record, trace
from tiny import tiny_gpt, tiny_llama

VOCAB = 131
"""Rows that 2, 3 and 4 do not divide: FSDP2's padding shows (and the last ranks hold less Adam state)."""


def fsdp(d: int, precision: str = "fp32", **changes: Any) -> Workload:
    dtype = "fp32" if precision == "fp32" else "bf16"
    wl = {"seq_len": 32, "micro_batch": 2, "dtype": dtype, "precision": precision, "device": "cpu", **changes}
    return Workload(**wl, fsdp=True, dp=d)


def rule(spec: ModelSpec, d: int, rank: int, param_bytes: int, moment_bytes: int) -> dict[str, int]:
    """FSDP2's states on ``rank`` of ``d``, from the parameters' shapes alone: each parameter's shard of
    ceil(rows / d) rows (padded on every rank), its gradient the same, AdamW's two moments of this rank's
    unpadded rows and a 4-byte fp32 step."""
    model = build_source(ModelSource.preset(spec), device="meta").model
    params = moments = 0
    for p in model.parameters():  # a tied parameter once
        rows, per_row = p.shape[0], p.numel() // p.shape[0]
        shard = math.ceil(rows / d)
        mine = min(max(rows - rank * shard, 0), shard)
        params += shard * per_row * param_bytes
        moments += 2 * mine * per_row * moment_bytes + 4
    return {"Parameter": params, "Gradient": params, "Optstate": moments}


BYTES = {"fp32": (4, 4), "mixed": (4, 4), "bf16": (2, 2)}
"""Bytes of a weight and of an AdamW moment on the rank: fp32 shards under FSDP's MixedPrecisionPolicy too."""


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize(
    ("name", "precision"), [("gpt", "fp32"), ("gpt", "bf16"), ("llama", "mixed"), ("llama", "bf16")]
)
def test_each_rank_keeps_fsdp2s_padded_shards(name: str, precision: str, d: int) -> None:
    param_bytes, moment_bytes = BYTES[precision]
    spec = (tiny_gpt if name == "gpt" else tiny_llama)(3, vocab=VOCAB)
    for rank in (0, d - 1):
        got = step_record(spec, fsdp(d, precision), "block", rank=rank).states
        assert {k: got[k] for k in ("Parameter", "Gradient", "Optstate")} == rule(
            spec, d, rank, param_bytes, moment_bytes
        )
    last, first = (rule(spec, d, r, param_bytes, moment_bytes)["Optstate"] for r in (d - 1, 0))
    assert last < first  # rank 0 is the most loaded: the trace reports it


def test_trace_reports_rank_0_as_traced_and_says_so() -> None:
    spec = tiny_llama(3, vocab=VOCAB)
    wl = fsdp(4, "mixed")
    r = trace(spec, wl, "block")
    states = rule(spec, 4, 0, 4, 4)
    assert (r.parameters, r.gradients, r.optimizer) == (states["Parameter"], states["Gradient"], states["Optstate"])
    assert r.peak == step_record(spec, wl, "block").peak[0]
    note = next(n for n in r.notes if "FSDP2" in n)
    assert "one rank of 4-way FSDP2 full shard" in note and "MixedPrecisionPolicy(param_dtype=bf16" in note
    assert "rank 0, the most loaded" in note
    assert not any("priced for" in n for n in r.notes)  # the states are traced, not restated


def test_mixed_precision_gathers_in_the_dtype() -> None:
    """The same fp32 shards; under the MixedPrecisionPolicy the gathered weights and the activations are bf16, so
    every phase of the forward holds less than plain fp32, and a layer saves what a bf16 step saves."""
    spec = tiny_llama(3, vocab=VOCAB)
    full, mixed, bf16 = (step_record(spec, fsdp(2, p), "none") for p in ("fp32", "mixed", "bf16"))
    assert mixed.states["Parameter"] == full.states["Parameter"] == 2 * bf16.states["Parameter"]
    forward = [ph for ph in full.phase_peaks if ph.stage == "forward"]
    assert all(mixed.phase_peaks[ph][0] < full.phase_peaks[ph][0] for ph in forward)
    assert figures(mixed)["saved"] == figures(bf16)["saved"]
    assert mixed_dtype(fsdp(2, "mixed")) is torch.bfloat16 and mixed_dtype(fsdp(2, "bf16")) is None


@pytest.mark.parametrize(
    ("name", "precision", "d", "policy", "peak"),
    [
        ("gpt", "mixed", 2, "none", 5),  # the next to last layer: Note: [FSDP2's last two layers]
        ("llama", "fp32", 4, "block", 1),
        ("llama", "fp32", 2, "none", 6),
    ],
)
def test_scaled_fsdp_trace_equals_the_whole_one(name: str, precision: str, d: int, policy: str, peak: int) -> None:
    spec = (tiny_gpt if name == "gpt" else tiny_llama)(7, vocab=VOCAB)
    whole, scaled = trace(spec, fsdp(d, precision), policy), trace(spec, fsdp(d, precision), policy, layers=3)
    assert whole.peak_phase == f"backward of layer {peak}"
    assert scaled.traced == (3, 4)
    for figure in ("parameters", "gradients", "optimizer", "layers", "peak", "peak_phase", "peak_breakdown", "phases"):
        assert getattr(scaled, figure) == getattr(whole, figure), figure


def test_transformers_class_and_cuda_rules(tmp_path: Path) -> None:
    """A config.json's class shards the same way; under CUDA's rules every storage is a whole 512-byte block."""
    pytest.importorskip("transformers")
    from test_zoo import config_json

    path = str(config_json("qwen2", tmp_path))
    cpu = trace(path, fsdp(2, "amp"), "block")
    cuda = trace(path, fsdp(2, "amp", device="cuda"), "block")
    assert cpu.parameters > 0 and cuda.parameters > cpu.parameters and cuda.parameters % 512 == 0
    assert cuda.reserved is None  # FSDP2 allocates on streams of its own: no allocator replay
    assert any("forward under bf16 autocast" in n for n in cpu.notes)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fsdp"], "--fsdp shards over the --dp ranks; give --dp 2 or more (got 1)"),
        (["--fsdp", "--dp", "2", "--tp", "2"], "trace runs one rank of tensor parallelism or of FSDP2, not both"),
        (["--fsdp", "--dp", "2", "--precision", "distributed"], "precision distributed is ZeRO-1's sharding"),
        (["--fsdp", "--dp", "2", "--scale-from", "2"], "misses an FSDP2 rank's largest backward"),
    ],
)
def test_bad_fsdp_traces_are_one_line_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    try:
        code = main(["trace", "--model", "gpt2", "--seq-len", "64", *argv])
    except SystemExit as e:
        code = int(e.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_traces_a_preset_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["trace", "--model", "gpt2", "--seq-len", "64", "--fsdp", "--dp", "8", "--precision", "mixed"]
    assert main([*argv, "--scale-from", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["fsdp"] and data["workload"]["dp"] == 8
    assert data["parameters"] == rule(ModelSpec.from_name("gpt2"), 8, 0, 4, 4)["Parameter"]


@pytest.mark.parametrize(("name", "precision", "d"), [("llama", "fp32", 2), ("llama", "amp", 2), ("gpt", "mixed", 3)])
def test_a_rank_profile_composes_to_the_rank_trace(name: str, precision: str, d: int) -> None:
    """A profile of one FSDP rank (Note: [an FSDP rank's profile]) composes any per-layer policy to that rank's
    whole fake trace: ``none`` exactly (traced as itself), fp32 exactly, mixed and amp within 1.5 % and never
    under (the one-device chain's backward figures hold gradients FSDP reduce-scatters away)."""
    spec = tiny_gpt(4, dropout=0.0) if name == "gpt" else tiny_llama(4)
    wl = fsdp(d, precision)
    table = profile(spec, wl).cost_table(None)
    for layers in [("none",) * 4, ("block",) * 4, ("none", "block", "mlp", "none")]:
        composed, traced = table.compose(list(layers)).peak, trace(spec, wl, Policy(layers=layers)).peak
        if layers == ("none",) * 4 or precision == "fp32":
            assert composed == traced, layers
        assert traced <= composed <= traced * 1.015, layers


def test_a_rank_profile_is_of_its_own_sharding() -> None:
    found = profile(tiny_llama(2), fsdp(2))
    assert found.workload["fsdp"] and found.workload["dp"] == 2
    assert found.restated("fp32", 2, fsdp=True) is found
    with pytest.raises(ConfigError, match="profile the model again for another sharding"):
        found.restated("fp32", 4, fsdp=True)


# --- real ranks --------------------------------------------------------------------------------------------


def require_real_ranks() -> None:
    """Skip where this torch cannot run FSDP2 on CPU ranks (2.6: ``require_fsdp``) or has no gloo."""
    try:
        require_fsdp("cpu")
    except ConfigError as e:
        pytest.skip(str(e))
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")


def test_real_ranks_equal_their_fake_traces() -> None:
    """Two CPU ranks over gloo, tiny Llama (rows uneven over 2) with a per-layer plan, fp32 and FSDP's mixed
    precision: each rank's real step equals the fake trace of that rank, every phase and state. Under the
    MixedPrecisionPolicy gloo's reduce-scatter clone (Note: [gloo's reduce-scatter]) shows in the backward; with
    it taken out (``in_place``) the real step is the trace."""
    require_real_ranks()
    source = ModelSource.preset(tiny_llama(3, vocab=VOCAB))
    cases = [Case(source, fsdp(2, p), "block:first=2", in_place) for p in ("fp32", "mixed") for in_place in (0, 1)]
    real = real_figures(cases, 2, steps=3, timeout_s=300)  # the least of 3: Note: [late frees]
    for (plain, fixed), case in zip(zip(real[::2], real[1::2]), cases[::2]):
        for rank in range(2):
            fake = figures(step_record(case.source, case.wl, case.policy, rank=rank))
            assert fixed[rank] == fake, (case.wl.precision, rank)
            extra = {ph: v - fake["phases"][ph] for ph, v in plain[rank]["phases"].items() if v != fake["phases"][ph]}
            assert all(ph.startswith("backward") or ph == "optimizer step" for ph in extra), extra
            assert all(v > 0 for v in extra.values())  # gloo only ever holds more


@pytest.mark.slow
def test_bench_fsdp_sets_each_real_rank_beside_its_trace() -> None:
    """``recompute bench --fsdp --dp 2`` under torchrun (gloo): every rank's real step, and rank 0's trace of it."""
    require_real_ranks()
    argv = ["--fsdp", "--dp", "2", "--device", "cpu", "--policies", "none,block", "--layers", "3", "--hidden", "64"]
    argv += ["--heads", "4", "--vocab", str(VOCAB), "--seq-len", "32", "--micro-batch", "2", "--steps", "2", "--json"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "recompute"]
    proc = subprocess.run([*cmd, "bench", *argv], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert [(r["policy"], r["rank"]) for r in data["rows"]] == [("none", 0), ("none", 1), ("block", 0), ("block", 1)]
    spec, _ = bench_spec(None, n_layers=3, hidden=64, n_heads=4, vocab=VOCAB)  # what bench builds
    for row in data["rows"]:
        want = rule(spec, 2, row["rank"], 4, 4)
        assert {k: row["states"][k] for k in want} == want
        extra = {ph: v - row["traced_phases"][ph] for ph, v in row["phases"].items() if v != row["traced_phases"][ph]}
        assert all(v > 0 and (ph.startswith("backward") or ph == "optimizer step") for ph, v in extra.items())


@pytest.mark.parametrize(
    ("model", "mesh", "says"),
    [("gpt", None, "shard takes a DeviceMesh of the data-parallel ranks, got a NoneType"),
     ("not a model", None, "shard takes the model (a torch.nn.Module), got a str")],
)  # fmt: skip
def test_shard_refuses_what_is_not_a_model_or_a_mesh(model: Any, mesh: Any, says: str) -> None:
    from recompute.parallel import shard

    module = build_source(ModelSource.preset(tiny_gpt(2)), device="meta").model if model == "gpt" else model
    with pytest.raises(ConfigError) as refused:
        shard(module, mesh)
    assert str(refused.value).startswith(says)
