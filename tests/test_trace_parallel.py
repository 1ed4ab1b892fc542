"""``recompute trace --tp T [--sp]``: one tensor-parallel rank traced on fake tensors and a fake process group."""

from __future__ import annotations

import pytest

from kernels import fp32_rms_norm
from recompute import ModelSpec, Workload, estimate
from recompute.cli import main
from recompute.core.analytic import layer_activations
from recompute.trace import trace, trace_layer
from tiny import tiny_gpt, tiny_llama

MODELS = {"gpt": tiny_gpt(4), "gpt-no-dropout": tiny_gpt(4, dropout=0.0), "llama": tiny_llama(4)}


@pytest.mark.parametrize("policy", ["none", "core_attn", "attn+mlp", "block"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_rank_saves_the_analytic_bytes(name: str, sp: bool, policy: str) -> None:
    spec = MODELS[name]
    wl = Workload(attention="eager", seq_len=32, micro_batch=2, tp=2, sp=sp, dtype="fp32", device="cpu")
    assert trace_layer(spec, wl, policy).total == layer_activations(spec, wl).stored(policy)


def test_sequence_parallelism_is_the_papers_five_x_at_22b() -> None:
    """Selective recompute with SP keeps 34sbh/t (fp16, 1-byte masks): against sbh(10 + 24/t + 5as/ht) at t=8."""
    spec = ModelSpec.from_name("22b")
    cpu = {"seq_len": 2048, "micro_batch": 1, "tp": 8, "dtype": "bf16", "device": "cpu"}
    baseline = trace_layer(spec, Workload(**cpu), "none").total
    both = trace_layer(spec, Workload(**cpu, sp=True), "core_attn").total
    s, b, h = 2048, 1, spec.hidden
    # On the CPU dropout masks are 2 bytes: 34sbh/t becomes (34 + 2)sbh/t, and the LayerNorm statistics add 4 x 2sb/t.
    assert both == (36 * s * b * h + 4 * 2 * s * b) / 8
    assert baseline / both > 5


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("name", ["gpt", pytest.param("llama", marks=fp32_rms_norm)])
def test_one_rank_step_peak_is_close_to_the_estimate(name: str, sp: bool) -> None:
    spec = ModelSpec.from_name({"gpt": "gpt2", "llama": "llama3.1-8b"}[name])
    wl = Workload(
        attention="eager",
        seq_len=2048 if name == "llama" else 1024,
        tp=8 if name == "llama" else 2,
        sp=sp,
        precision="bf16",
    )
    wl = Workload(**{**wl.to_dict(), "dtype": "bf16", "device": "cpu"})
    traced = trace(spec, wl, "core_attn", layers=2)
    assert traced.peak == pytest.approx(estimate(spec, wl, "core_attn").peak, rel=0.005)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt2", "--tp", "5"], "--tp 5 must divide the 12 query heads of gpt2"),
        (["--model", "llama3.1-8b", "--tp", "16"], "--tp 16 must divide the 8 key/value heads"),
        (["--model", "gpt2", "--tp", "2", "--sp", "--seq-len", "63"], "must be divisible by --tp (2)"),
        (["--model", "hf:gpt2", "--tp", "2"], "--tp 2 traces recompute's reference GPT/Llama"),
        (["--model", "gpt2", "--pp", "2"], "drop --pp (recompute estimate models pipeline parallelism)"),
    ],
)
def test_bad_parallel_traces_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        code = main(["trace", "--seq-len", "64", *argv])
    except SystemExit as e:  # argparse's own errors exit; ours return 2
        code = int(e.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
