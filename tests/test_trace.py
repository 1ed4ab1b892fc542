"""``recompute trace``: the fake step equals the real one byte for byte, figures are exact, bad input is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from kernels import cpu_flash_gqa, fp32_rms_norm
from recompute import ModelSpec, Policy, Workload, estimate
from recompute.checkpointing import apply
from recompute.cli import main
from recompute.core.analytic import layer_activations, n_params
from recompute.core.errors import ConfigError
from recompute.models import build_model
from recompute.models.loss import lm_loss
from recompute.trace import TraceResult, trace, trace_layer, trace_module
from recompute.trace._step import prime_optimizer
from tiny import tiny_gpt, tiny_llama

GPT = tiny_gpt(n_layers=3)
LLAMA = tiny_llama(n_layers=3)
B, S = 2, 32


def workload(attention: str = "eager") -> Workload:
    return Workload(micro_batch=B, seq_len=S, dtype="fp32", device="cpu", attention=attention)


def real_trace(spec: ModelSpec, policy: str, attention: str) -> TraceResult:
    torch.manual_seed(0)
    model = build_model(spec, attention=attention).train()
    apply(model, policy)
    batch = (torch.randint(spec.vocab, (B, S)), torch.randint(spec.vocab, (B, S)))
    return trace_module(model, batch)


FIGURES = ("parameters", "gradients", "optimizer", "other", "layers", "embedding", "head", "peak", "peak_phase")
FIGURES += ("peak_breakdown", "phases", "per_layer", "n_layers")


@pytest.mark.parametrize(
    ("name", "policy", "attention"),
    [
        ("gpt", "none", "eager"),
        ("gpt", "core_attn", "flash"),
        ("gpt", "attn+mlp", "eager"),
        ("llama", "none", "flash"),
        ("llama", "mlp", "eager"),
        ("llama", "block", "flash"),
    ],
)
def test_fake_trace_equals_the_real_step_byte_for_byte(name: str, policy: str, attention: str) -> None:
    spec = GPT if name == "gpt" else LLAMA
    fake = trace(spec, workload(attention), policy)
    real = real_trace(spec, policy, attention)
    for figure in FIGURES:
        assert getattr(fake, figure) == getattr(real, figure), figure


def test_trace_peak_equals_plain_memtracker_on_real_tensors() -> None:
    """StepTracker keeps MemTracker's accounting: torch's own MemTracker sees the same peak and states."""
    torch.manual_seed(0)
    model = build_model(GPT, attention="eager").train()
    optimizer = torch.optim.AdamW(model.parameters())
    prime_optimizer(model, optimizer)
    batch = (torch.randint(GPT.vocab, (B, S)), torch.randint(GPT.vocab, (B, S)))
    mt = MemTracker()
    mt.track_external(model, optimizer, *batch)
    with mt:
        kept, loss = lm_loss(model, *batch)
        loss.backward()
        del kept, loss
        optimizer.step()
    plain_peak = sum(snap["Total"] for snap in mt.get_tracker_snapshot("peak").values())
    optimizer.zero_grad(set_to_none=True)
    ours = trace_module(model, batch, optimizer=optimizer)
    assert ours.peak == plain_peak
    assert fake_peak_of(GPT) == plain_peak


def fake_peak_of(spec: ModelSpec) -> int:
    return trace(spec, workload(), "none").peak


def test_states_and_saved_bytes_are_exact_for_gpt2() -> None:
    """bf16 parameters and gradients; AdamW's two moments and a 4-byte step counter per parameter tensor (the
    bf16 precision mode: what the traced step runs)."""
    spec = ModelSpec.from_name("gpt2")
    s, h, v = 1024, 768, 50257
    r = trace(spec, Workload(attention="eager", seq_len=s, device="cpu", precision="bf16"), "block", layers=1)
    tensors = 2 + 12 * 12 + 2  # token and position embeddings (the head is tied), 12 per layer, final norm
    assert r.parameters == r.gradients == 2 * n_params(spec)
    assert r.optimizer == 2 * r.parameters + 4 * tensors
    assert r.layers[0].components == r.layers[11].components == {"checkpoint": 2 * s * h}  # the bf16 input
    assert r.layers[5].ops == {"checkpoint": 2 * s * h}
    # final LayerNorm: input and bf16 mean/rstd; output layer: its input; loss: fp32 log-probs, targets, weight
    assert r.head.total == 2 * s * h + 2 * 2 * s + 2 * s * h + 4 * s * v + 8 * s + 4
    assert r.embedding.total == 8 * s + 8 * s + 2 * s * h  # token ids, position ids, bf16 dropout mask


@pytest.mark.parametrize(
    "attention",
    [pytest.param("eager", marks=fp32_rms_norm), pytest.param("flash", marks=[fp32_rms_norm, cpu_flash_gqa])],
)
def test_layer_components_match_the_analytic_model_exactly_for_llama_8b(attention: str) -> None:
    from recompute.check_formulas import analytic_components
    from recompute.core.analytic import layer_activations

    spec = ModelSpec.from_name("llama3.1-8b")
    wl = Workload(seq_len=8192, device="cpu", attention=attention)
    for policy in ("none", "attn", "block"):
        traced = trace_layer(spec, wl, policy).components
        analytic = analytic_components(layer_activations(spec, wl), policy)
        assert {k: v for k, v in analytic.items() if v} == traced, policy


def test_forward_only_layer_equals_the_full_trace() -> None:
    wl = workload()
    for policy in ("none", "attn"):
        full = trace(dataclasses.replace(GPT, n_layers=2), wl, policy)
        assert trace_layer(GPT, wl, policy).components == full.layers[1].components


def test_saved_tensors_are_read_back_by_the_backward_nodes_that_saved_them() -> None:
    r = trace(GPT, workload(), "none")
    ops = r.layers[1].ops
    assert {"SoftmaxBackward0", "BmmBackward0", "AddmmBackward0", "GeluBackward0", "MulBackward0"} <= set(ops)
    assert "?" not in ops
    assert r.head.ops["LogSoftmaxBackward0"] == 4 * B * S * GPT.vocab  # fp32 log-probabilities
    assert r.embedding.ops["EmbeddingBackward0"] == 8 * B * S + 8 * S  # int64 token and position ids


def test_peak_phase_is_named() -> None:
    """GPT-2's 50257-word logits and their gradient peak at the start of the backward; recomputing every layer
    of a small model moves the peak to the last layer's backward, when all gradients exist."""
    gpt2 = trace(ModelSpec.from_name("gpt2"), Workload(attention="eager", seq_len=1024, device="cpu"), "none", layers=1)
    assert gpt2.peak_phase == "backward (head and loss)"
    assert trace(GPT, workload(), "none").peak_phase == "backward of layer 2"
    assert trace(LLAMA, workload(), "block").peak_phase == "backward of layer 0"


def test_optimizer_priming_matches_a_real_first_step() -> None:
    model = build_model(GPT, attention="eager")
    for cls in (torch.optim.AdamW, torch.optim.Adam):
        primed = cls(model.parameters(), amsgrad=cls is torch.optim.Adam)
        prime_optimizer(model, primed)
        stepped = cls(model.parameters(), amsgrad=cls is torch.optim.Adam)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        stepped.step()
        meta = [
            {k: (v.shape, v.dtype, v.device) for k, v in o.state_dict()["state"][i].items()}
            for o in (primed, stepped)
            for i in range(len(list(model.parameters())))
        ]
        half = len(meta) // 2
        assert meta[:half] == meta[half:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt2", "--seq-len", "2048"], "exceeds gpt2's 1024 positions"),
        (["--model", "gpt2", "--policy", "everything"], "is not a policy"),
        (["--model", "gpt2", "--policy", "block", "--every", "2", "--scale-from", "2"], "trace every layer instead"),
        (["--model", "no-such-model"], "is not a known model"),
        (["--model", "gpt2", "--pp", "2"], "drop --pp"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("recompute trace: error:")


def test_a_model_that_cannot_be_built_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="uses learned positions"):
        trace(dataclasses.replace(GPT, position="rotary"), workload(), "none")

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("shape mismatch in c_attn\nmore detail")

    monkeypatch.setattr("recompute.models.source.build_model", broken)
    assert main(["trace", "--model", "gpt2", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err == "recompute trace: error: cannot build gpt2: RuntimeError: shape mismatch in c_attn\n"


def test_a_plan_for_another_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="plan was made for"):
        trace(GPT, workload(), Policy("block", model="llama3.1-70b"))


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["trace", "--model", "gpt2", "--seq-len", "128", "--policy", "mlp", "--scale-from", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scaled"] is True and data["traced"] == [1, 2] and len(data["layers"]) == 12
    assert data["peak"] >= data["parameters"] + data["optimizer"]


@pytest.mark.parametrize(("name", "policy"), [("gpt", "block"), ("llama", "core_attn")])
def test_hugging_face_models_trace_like_their_real_step(name: str, policy: str) -> None:
    pytest.importorskip("transformers")
    from recompute.models.hf import build_hf_model
    from recompute.models.loss import hf_loss

    spec = GPT if name == "gpt" else LLAMA
    fake = trace(spec, workload(), policy, hf=True)
    torch.manual_seed(0)
    model = build_hf_model(spec, attention="eager").train()
    apply(model, policy)
    real = trace_module(model, (torch.randint(spec.vocab, (B, S)), torch.randint(spec.vocab, (B, S))), loss_fn=hf_loss)
    for figure in FIGURES:
        assert getattr(fake, figure) == getattr(real, figure), figure
    if policy == "block":
        assert fake.layers[1].components == {"checkpoint": 4 * B * S * spec.hidden}


def _real_states(spec: ModelSpec, precision: str, dp: int = 1) -> float:
    """Bytes a real optimizer step holds in model states: plain AdamW in one dtype (fp32, bf16), or Megatron's
    mixed precision (bf16 weights, fp32 gradients, fp32 master weights and AdamW over them; with ``dp`` > 1 the
    master weights and AdamW's moments of this rank's 1/dp shard, as a distributed optimizer keeps)."""
    torch.manual_seed(0)
    model = build_model(spec)
    if precision in ("fp32", "bf16"):
        model = model.to(torch.float32 if precision == "fp32" else torch.bfloat16)
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(params)
        opt.step()
        held = [*params, *(p.grad for p in params), *(t for s in opt.state.values() for t in s.values() if t.dim())]
        return float(sum(t.numel() * t.element_size() for t in held))
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    grads = torch.zeros_like(flat)  # fp32 main gradients, all of them
    shard = flat[: -(-flat.numel() // dp)].clone().requires_grad_()  # this rank's master weights
    opt = torch.optim.AdamW([shard])
    shard.grad = torch.zeros_like(shard)
    opt.step()
    moments = [t for s in opt.state.values() for t in s.values() if t.dim()]
    held = [*params, grads, shard, *moments]
    return float(sum(t.numel() * t.element_size() for t in held))


@pytest.mark.parametrize(("precision", "dp"), [("fp32", 1), ("bf16", 1), ("mixed", 1), ("distributed", 4)])
def test_trace_prices_the_model_states_of_the_precision(precision: str, dp: int) -> None:
    """The step is traced in one dtype; its states are priced for the workload's precision: equal to the
    preset's formula and to a real optimizer step's bytes, and every phase moves with them (issue 24)."""
    spec = tiny_llama(n_layers=2, vocab=4096)  # a vocabulary that weighs: the optimizer step's temporaries
    wl = Workload(micro_batch=B, seq_len=S, dtype="bf16", device="cpu", precision=precision, dp=dp)
    t = trace(spec, wl, "block")
    steps = 4 * len(list(build_model(spec).parameters()))  # AdamW's fp32 step counter per parameter tensor
    states = t.parameters + t.gradients + t.optimizer - steps
    formula = estimate(spec, wl, "block").states
    assert states == pytest.approx(formula.total, abs=4)  # rounded to whole bytes
    assert states == pytest.approx(_real_states(spec, precision, dp), rel=1e-3)  # the shard rounds up
    plain = trace(spec, dataclasses.replace(wl, precision="bf16", dp=1), "block")
    moved = (t.parameters + t.optimizer) - (plain.parameters + plain.optimizer)
    assert t.phases["forward: the layers"] - plain.phases["forward: the layers"] == pytest.approx(moved, abs=4)
    assert (precision == "bf16") == (t.peak == plain.peak)
    assert (precision == "bf16") == (not any("priced for" in n for n in t.notes))


def test_a_view_of_the_fused_qkv_keeps_its_storage() -> None:
    """recompute's GPT in fp32 with dropout on the CPU: SDPA's math path at b = 1 saves v as a view of c_attn's
    output, which keeps the whole (b, s, 3h) storage alive beside its copies of q and k: 2esbh more per layer
    than at b = 2, per sequence (docs/validation.md listed it as a limit of the formula). Real step, trace and
    analytic model agree at both batch sizes."""
    spec = GPT
    assert spec.dropout > 0  # the math path: no fused CPU kernel takes dropout
    totals = []
    for batch in (1, 2):
        wl = Workload(micro_batch=batch, seq_len=S, dtype="fp32", device="cpu", attention="flash")
        torch.manual_seed(0)
        real = trace_module(
            build_model(spec, attention="flash").train(), tuple(torch.randint(spec.vocab, (2, batch, S)))
        )
        fake = trace(spec, wl, "none")
        assert [p.total for p in fake.layers] == [p.total for p in real.layers]
        assert all(p.total == layer_activations(spec, wl).stored("none") for p in fake.layers)
        totals.append(fake.layers[1].total)
    assert 2 * totals[0] - totals[1] == 2 * 4 * S * 2 * spec.hidden  # q and k's parts of the fused output, at b = 1
