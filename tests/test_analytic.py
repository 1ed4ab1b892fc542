"""The analytic model against the paper's and the workshop's closed forms, pinned exactly."""

from __future__ import annotations

import math

import pytest

from recompute import ModelSpec, Workload, estimate, estimate_policies
from recompute.core.analytic import (
    hardware_flops,
    in_flight,
    layer_activations,
    layer_flops,
    layer_overheads,
    logits_flops,
    mfu,
    model_flops,
    overhead_from_flops,
    paper_hardware_flops_full,
    paper_hardware_flops_selective,
    paper_model_flops,
)
from recompute.core.policy import POLICIES

EXACT = dict(rel=1e-12)
# Korthikanti's setting: GPT layer, d_ff = 4h, MHA, dropout, 16-bit activations, 1-byte masks (CUDA), eager.
PAPER_CONFIGS = {
    "22b b4 t8": ("22b", 4, 2048, 8),
    "175b b1 t8": ("175b", 1, 2048, 8),
    "530b b1 t8": ("530b", 1, 2048, 8),
    "1t b1 t8": ("1t", 1, 2048, 8),
    "gpt2 b8 t4": ("gpt2", 8, 1024, 4),
    "gpt2-xl b2 t5": ("gpt2-xl", 2, 500, 5),
    "22b b1 t1": ("22b", 1, 1024, 1),
}


def _paper(case: str, **extra: object) -> tuple[ModelSpec, Workload, float, float, float, int]:
    name, b, s, t = PAPER_CONFIGS[case]
    spec = ModelSpec.from_name(name)
    wl = Workload(**{"micro_batch": b, "seq_len": s, "tp": t, "attention": "eager", **extra})  # type: ignore[arg-type]
    return spec, wl, s * b * spec.hidden, spec.n_heads * s / spec.hidden, spec.n_heads, wl.tp


def _without_stats(spec: ModelSpec, wl: Workload, policy: str) -> float:
    """Stored bytes less the LayerNorm mean/rstd, which the paper leaves out (pinned separately)."""
    la = layer_activations(spec, wl)
    return la.stored(policy) - (la.norm_stats if policy != "block" else 0.0)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_tensor_parallel_baseline_eq2(case: str) -> None:
    spec, wl, sbh, as_h, _, t = _paper(case)
    assert _without_stats(spec, wl, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * as_h / t), **EXACT)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_tensor_and_sequence_parallel_eq4(case: str) -> None:
    spec, wl, sbh, as_h, _, t = _paper(case, sp=True)
    assert _without_stats(spec, wl, "none") == pytest.approx(sbh * (34 / t + 5 * as_h / t), **EXACT)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_selective_with_tensor_parallel(case: str) -> None:
    spec, wl, sbh, _, _, t = _paper(case)
    assert _without_stats(spec, wl, "core_attn") == pytest.approx(sbh * (10 + 24 / t), **EXACT)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_selective_with_tensor_and_sequence_parallel(case: str) -> None:
    spec, wl, sbh, _, _, t = _paper(case, sp=True)
    assert _without_stats(spec, wl, "core_attn") == pytest.approx(34 * sbh / t, **EXACT)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_full_recompute_keeps_2sbh(case: str) -> None:
    spec, wl, sbh, _, _, t = _paper(case)
    assert _without_stats(spec, wl, "block") == pytest.approx(2 * sbh, **EXACT)
    spec, wl, sbh, _, _, t = _paper(case, sp=True)
    assert _without_stats(spec, wl, "block") == pytest.approx(2 * sbh / t, **EXACT)


@pytest.mark.parametrize("case", ["22b b1 t1", "gpt2 b8 t4"])
def test_no_parallelism_eq1_and_components(case: str) -> None:
    spec, wl, sbh, as_h, a, _ = _paper(case, tp=1)
    s, b = wl.seq_len, wl.micro_batch
    la = layer_activations(spec, wl)
    assert la.total - la.norm_stats == pytest.approx(sbh * (34 + 5 * as_h), **EXACT)
    assert la.group("attention") == pytest.approx(11 * sbh + 5 * a * s * s * b, **EXACT)
    assert la.group("mlp") == pytest.approx(19 * sbh, **EXACT)
    assert la.norms == pytest.approx(4 * sbh, **EXACT)
    assert la.norm_stats == 2 * 2 * 4 * s * b  # two LayerNorms, fp32 mean and rstd per token


def test_sub_block_policies_store_what_the_workshop_says() -> None:
    spec, wl, sbh, *_ = _paper("22b b1 t1", tp=1)
    la = layer_activations(spec, wl)
    norms = 4 * sbh + la.norm_stats
    assert la.stored("attn") == pytest.approx(19 * sbh + norms + 2 * sbh, **EXACT)  # MLP + norms + checkpoint
    assert la.stored("mlp") == pytest.approx(la.group("attention") + norms + 2 * sbh, **EXACT)
    assert la.stored("attn+mlp") == pytest.approx(norms + 4 * sbh, **EXACT)  # norms + two checkpoints


def test_policies_are_ordered_by_memory() -> None:
    la = layer_activations(ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=1024))
    stored = {p: la.stored(p) for p in POLICIES}
    assert stored["none"] > stored["mlp"] > stored["core_attn"] > stored["attn"] > stored["attn+mlp"]
    assert stored["attn+mlp"] > stored["block"]
    assert all(la.transient(p) == pytest.approx(la.total - stored[p]) for p in POLICIES)


def test_llama_gqa_swiglu_rmsnorm_no_dropout() -> None:
    spec = ModelSpec.from_name("llama3.1-8b")
    s, b, a = 4096, 1, 32
    sbh, sb = s * b * spec.hidden, s * b
    la = layer_activations(spec, Workload(attention="eager", seq_len=s))
    # 2 (norm out) + 3 (Q 2, K and V 0.5 each at 8/32 heads) + 2 (out-proj input) + 2 (MLP in)
    # + 4 tensors * 2 bytes * 3.5 (d_ff/h) + 4 (two fused RMSNorm inputs), no masks.
    assert la.total - la.norm_stats - la.scores == pytest.approx(41 * sbh, **EXACT)
    assert la.scores == 2 * a * s * s * b  # bf16 softmax, no dropout
    assert la.norm_stats == 2 * 4 * sb
    assert la.attn_drop == la.mlp_drop == 0
    flash = layer_activations(spec, Workload(seq_len=s, attention="flash"))
    assert flash.scores == 4 * a * s * b  # fp32 log-sum-exp per row instead of the s^2 softmax
    cpu = layer_activations(spec, Workload(attention="eager", seq_len=s, device="cpu"))
    assert cpu.norms == 2 * 2 * 4 * sbh  # the CPU composite keeps fp32 copies of the input and normalised output


def test_cpu_dropout_masks_take_the_activation_dtype() -> None:
    spec = ModelSpec.from_name("gpt2")
    cuda = layer_activations(spec, Workload(attention="eager", seq_len=1024, dtype="fp32"))
    cpu = layer_activations(spec, Workload(attention="eager", seq_len=1024, dtype="fp32", device="cpu"))
    assert cpu.attn_drop == 4 * cuda.attn_drop
    assert cpu.scores == pytest.approx(3 * 4 * 12 * 1024 * 1024, **EXACT)  # softmax, mask, dropout output


@pytest.mark.parametrize(("p", "m", "factor"), [(4, 1, 4), (8, 3, 8 * (1 + 7 / 24))], ids=["1f1b", "interleaved"])
def test_pipeline_first_stage_holds_L_layers_worth(p: int, m: int, factor: float) -> None:
    spec = ModelSpec.from_name("175b")
    wl = Workload(attention="eager", seq_len=2048, tp=8, sp=True, pp=p, interleave=m)
    assert in_flight(wl) == pytest.approx(factor)
    est = estimate(spec, wl, "core_attn")
    per_layer = layer_activations(spec, wl).stored("core_attn")
    layers = sum(v for k, v in est.activations.items() if k not in ("embedding", "head", "logits"))
    assert layers == pytest.approx(factor * spec.n_layers / p * per_layer, **EXACT)
    if m == 1:  # Eq. 6: 34 sbhL / t (+ stats) whatever p is
        assert layers == pytest.approx(spec.n_layers * (34 * 2048 * 12288 / 8 + 16 * 2048 / 8), **EXACT)


def test_fewer_microbatches_than_stages_holds_fewer() -> None:
    wl = Workload(attention="eager", seq_len=2048, tp=8, pp=8, n_microbatches=2)
    assert in_flight(wl) == 2


def test_per_layer_mix_sums_its_layers() -> None:
    spec = ModelSpec.from_name("gpt2")
    wl = Workload(attention="eager", seq_len=1024)
    la = layer_activations(spec, wl)
    mix = ("block",) * 6 + ("none",) * 6
    est = estimate(spec, wl, __import__("recompute").Policy(layers=mix))
    layers = sum(v for k, v in est.activations.items() if k not in ("embedding", "head", "logits"))
    assert layers == pytest.approx(6 * la.stored("block") + 6 * la.stored("none"), **EXACT)


def test_peak_includes_the_recompute_transient() -> None:
    spec = ModelSpec.from_name("gpt2")
    wl = Workload(attention="eager", seq_len=1024, micro_batch=4)
    la = layer_activations(spec, wl)
    est = estimate(spec, wl, "block")
    assert est.peak >= est.states.total + spec.n_layers * la.stored("block") + la.transient("block")
    assert est.peak > est.total


# --- FLOPs -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_model_flops_equal_eq7(case: str) -> None:
    spec, wl, *_ = _paper(case, tp=1)
    b, s, L, h, V = wl.micro_batch, wl.seq_len, spec.n_layers, spec.hidden, spec.vocab
    assert model_flops(spec, wl) == pytest.approx(paper_model_flops(b, s, L, h, V), **EXACT)


@pytest.mark.parametrize("case", list(PAPER_CONFIGS))
def test_full_recompute_flops_equal_narayanan(case: str) -> None:
    spec, wl, *_ = _paper(case, tp=1)
    b, s, L, h, V = wl.micro_batch, wl.seq_len, spec.n_layers, spec.hidden, spec.vocab
    full = hardware_flops(spec, wl, ("block",) * L)
    assert full == pytest.approx(paper_hardware_flops_full(b, s, L, h, V), **EXACT)
    # Eager core_attn replays QK^T only (non-reentrant checkpoint stops early): 2bs^2h per layer.
    selective = hardware_flops(spec, wl, ("core_attn",) * L)
    assert selective == pytest.approx(model_flops(spec, wl) + 2 * b * s * s * h * L, **EXACT)


def test_paper_hfu_over_mfu_for_gpt3_is_1_027() -> None:
    ratio = paper_hardware_flops_selective(1, 2048, 96, 12288, 51200) / paper_model_flops(1, 2048, 96, 12288, 51200)
    assert ratio == pytest.approx(1.027, abs=5e-4)


def test_early_stop_skips_the_last_matmul_of_a_region_without_dropout() -> None:
    spec, wl = ModelSpec.from_name("llama3.1-8b"), Workload(attention="eager", seq_len=4096)
    lf = layer_flops(spec, wl)
    assert lf.recomputed("mlp") == lf.mlp - 2 * 4096 * 4096 * 14336  # down projection skipped
    assert lf.recomputed("attn") == lf.attn_proj + lf.attn_core - 2 * 4096 * 4096 * 4096  # output projection
    assert lf.recomputed("block") == lf.forward - 2 * 4096 * 4096 * 14336
    flash = layer_flops(spec, Workload(seq_len=4096, attention="flash"))
    assert flash.recomputed("core_attn") == flash.attn_core  # one fused op replays whole
    gpt = layer_flops(ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=1024))
    assert gpt.recomputed("block") == gpt.forward and gpt.recomputed("core_attn") == gpt.attn_core / 2


def test_gqa_and_swiglu_flops() -> None:
    spec = ModelSpec.from_name("llama3.1-8b")
    wl = Workload(attention="eager", seq_len=4096)
    lf = layer_flops(spec, wl)
    bs, h = 4096, 4096
    assert lf.attn_proj == 2 * bs * h * (2 * h + 2 * 1024)  # Q and O full, K and V at 8 of 32 heads
    assert lf.mlp == 6 * bs * h * 14336
    assert lf.attn_core == 4 * bs * 4096 * h


def _gpt_layer(h: int, s: int) -> tuple[ModelSpec, Workload]:
    return ModelSpec(hidden=h, n_heads=32, max_positions=max(s, 1)), Workload(attention="eager", seq_len=s)


def test_workshop_overheads_short_sequences() -> None:
    over = layer_overheads(*_gpt_layer(h=12288, s=1))
    assert [round(100 * over[p], 1) for p in ("attn", "mlp", "attn+mlp")] == [11.1, 22.2, 33.3]


def test_workshop_overheads_when_s_equals_h() -> None:
    over = layer_overheads(*_gpt_layer(h=4096, s=4096))
    assert [round(100 * over[p], 1) for p in ("attn", "mlp", "attn+mlp")] == [14.3, 19.0, 33.3]
    assert over["attn"] == pytest.approx(12 / 84, **EXACT) and over["mlp"] == pytest.approx(16 / 84, **EXACT)


def test_workshop_worked_example() -> None:
    got = [round(100 * overhead_from_flops(100, 300, p), 1) for p in ("attn", "mlp", "attn+mlp")]
    assert got == [8.3, 25.0, 33.3]


def test_step_overhead_of_block_is_below_a_third_because_logits_are_not_recomputed() -> None:
    spec, wl = ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=1024)
    est = estimate(spec, wl, "block")
    layers = spec.n_layers * layer_flops(spec, wl).forward
    assert est.overhead == pytest.approx(layers / (3 * (layers + logits_flops(spec, wl))), **EXACT)
    assert est.overhead < 1 / 3


def test_mfu() -> None:
    assert mfu(1e15, 2.0, 1e15) == 0.5
    flops = model_flops(*_gpt_layer(1024, 1024))
    assert math.isclose(mfu(flops, 0.5, 1e12), 2 * flops / 1e12)


@pytest.mark.parametrize("name", ["gpt2", "llama3.1-8b", "175b"])
def test_estimate_rows_cover_every_policy(name: str) -> None:
    rows = estimate_policies(ModelSpec.from_name(name), Workload(attention="eager", seq_len=1024))
    assert [r.policy for r in rows] == list(POLICIES)
    assert rows[0].overhead == 0 and rows[-1].activation_bytes < rows[0].activation_bytes
