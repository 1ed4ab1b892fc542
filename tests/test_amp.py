"""``--precision amp``: autocast over fp32 weights, traced as itself and held to real autocast steps.

The fake trace of an amp step must equal a real CPU autocast step (real tensors, ``torch.autocast("cpu")``)
byte for byte: presets and transformers classes, every policy, both attentions, both losses. The CUDA step is
traced on CPU tensors under CUDA's autocast policy (``recompute.trace._autocast``): that table is held to the
header the running torch ships, and the emulation itself to the real CPU autocast (run under the CPU's own
table, it must change nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from recompute import ModelSpec, Workload, estimate
from recompute.checkpointing import apply
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.models import build_model
from recompute.models.source import ModelSource, build_source, resolve_source
from recompute.trace import TraceResult, trace, trace_module
from recompute.trace._autocast import CPU, CUDA, AutocastTable, emulated_autocast
from tiny import tiny_gpt, tiny_llama

B, S = 2, 32
FIGURES = ("parameters", "gradients", "optimizer", "layers", "embedding", "head", "peak", "peak_phase", "phases")


def amp(**changes: Any) -> Workload:
    return Workload(**{"micro_batch": B, "seq_len": S, "dtype": "bf16", "precision": "amp", "device": "cpu", **changes})


def real_amp_step(source: ModelSource, wl: Workload, policy: str, table: AutocastTable | None = None) -> TraceResult:
    """A real CPU step of ``source`` (fp32 weights, forward and loss under bf16 autocast), tracked as the trace
    tracks a fake one; under ``table``'s emulated policy when given."""
    torch.manual_seed(0)
    built = build_source(source, attention=wl.attention)
    model = built.model.train()
    apply(model, policy, loss=wl.loss)
    batch = (torch.randint(built.vocab, (B, S)), torch.randint(built.vocab, (B, S)))
    with emulated_autocast(table) if table is not None else contextlib.nullcontext():
        return trace_module(model, batch, loss_fn=built.loss_fn, autocast=torch.bfloat16)  # type: ignore[arg-type]


def assert_same(fake: TraceResult, real: TraceResult) -> None:
    for figure in FIGURES:
        assert getattr(fake, figure) == getattr(real, figure), figure


@pytest.mark.parametrize(
    ("name", "policy", "attention", "loss"),
    [
        ("gpt", "none", "eager", "full"),
        ("gpt", "core_attn", "flash", "full"),
        ("gpt", "block", "eager", "chunked"),
        ("llama", "none", "flash", "full"),
        ("llama", "attn+mlp", "eager", "full"),
        ("llama", "mlp", "flash", "chunked"),
        ("llama", "block", "flash", "full"),
    ],
)
def test_amp_trace_equals_a_real_autocast_step(name: str, policy: str, attention: str, loss: str) -> None:
    spec = (tiny_gpt if name == "gpt" else tiny_llama)(n_layers=3)
    wl = amp(attention=attention, loss=loss)
    fake = trace(spec, wl, policy)
    assert_same(fake, real_amp_step(ModelSource.preset(spec), wl, policy))
    assert fake.parameters == 4 * fake.parameter_count  # fp32 weights; autocast's casts are activations
    assert any("bf16 autocast" in n for n in fake.notes)


@pytest.mark.parametrize(("kind", "policy"), [("llama", "none"), ("qwen2", "block"), ("gpt2", "attn"), ("phi3", "mlp")])
def test_transformers_classes_under_amp_equal_their_real_step(kind: str, policy: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_zoo import config_json

    source = resolve_source(str(config_json(kind, tmp_path)))
    wl = amp(attention="flash")
    assert_same(trace(source, wl, policy), real_amp_step(source, wl, policy))


def test_the_emulated_cpu_policy_is_the_real_one() -> None:
    """The emulation's machinery (casts, the weight cache, the checkpoint's replay under autocast) run with the
    CPU's own table changes nothing of a real CPU autocast step; CUDA's table changes what eager attention keeps
    (its softmax in fp32)."""
    source = ModelSource.preset(tiny_llama(n_layers=3))
    wl = amp(attention="eager")
    for policy in ("none", "block"):
        real = real_amp_step(source, wl, policy)
        assert_same(real_amp_step(source, wl, policy, CPU), real)
    assert real_amp_step(source, wl, "none", CUDA).activations > real_amp_step(source, wl, "none").activations


def _header_lists() -> dict[str, set[str]]:
    """The policy lists of aten/src/ATen/autocast_mode.h as the running torch ships it."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.is_file():
        pytest.skip("this torch ships no ATen headers")
    text = header.read_text()
    out = {}
    for macro in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "PROMOTE"):
        body = re.search(rf"#define AT_FORALL_{macro}\(_\)((?:.*\\\n)*.*)", text)
        assert body is not None, macro
        ops = re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1))
        out[macro] = {f"{op}.{overload}" if overload else op for op, overload in ops}
    return out


def test_cuda_table_is_the_header_of_this_torch() -> None:
    found = _header_lists()
    named = {n for n in set().union(*found.values()) if "Dimname" in n or "dimname" in n}  # named tensors: unused
    assert set(CUDA.lower) == found["LOWER_PRECISION_FP"]
    assert set(CUDA.fp32) == found["FP32"]
    assert set(CUDA.fp32_dtype) == found["FP32_SET_OPT_DTYPE"] - named
    assert set(CUDA.promote) == found["PROMOTE"]


def test_cpu_table_is_what_this_torch_registers() -> None:
    """The ops the CPU's autocast casts, read from the dispatcher: the table, less overloads this torch lacks."""
    names = getattr(torch._C, "_dispatch_get_all_op_names", None)
    has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    if names is None or has is None:
        pytest.skip("this torch cannot list which ops have an AutocastCPU kernel")
    aten = {n.removeprefix("aten::") for n in names() if n.startswith("aten::") and "imname" not in n}
    registered = {op for op in aten if has(f"aten::{op}", "AutocastCPU")}
    assert registered == CPU.ops() & aten  # named-tensor overloads (Dimname) left out: what differs by release


def test_cuda_step_under_amp_keeps_eager_attention_fp32() -> None:
    """On CUDA, autocast runs softmax in fp32: eager attention keeps (b, a, s, s) fp32 probabilities where the
    plain bf16 step keeps them in bf16; flash attention keeps no s^2 term either way."""
    spec = tiny_llama(n_layers=2)
    wl = amp(attention="eager", device="cuda")
    plain = dataclasses.replace(wl, precision="bf16")
    scores = B * spec.n_heads * S * S
    layer = trace(spec, wl, "none").layers[1].total - trace(spec, plain, "none").layers[1].total
    assert layer >= 2 * scores  # fp32 probabilities where bf16 ones were kept
    assert any("CUDA's autocast policy" in n for n in trace(spec, wl, "none").notes)


def test_amp_needs_a_16_bit_dtype_and_the_trace() -> None:
    with pytest.raises(ConfigError) as refused:
        Workload(dtype="fp32", precision="amp")
    assert "\n" not in str(refused.value) and "bf16" in str(refused.value)
    with pytest.raises(ConfigError) as analytic:
        estimate(ModelSpec.from_name("gpt2"), Workload(seq_len=512, precision="amp"))
    assert "autocast" in str(analytic.value)


def test_an_amp_trace_is_never_restated_as_one_dtype() -> None:
    from recompute.core.states import Restate

    assert Restate.of(4e6, "bf16", "amp", traced="amp").identity
    with pytest.raises(ConfigError, match="autocast changes the activations"):
        Restate.of(4e6, "bf16", "mixed", traced="amp")
    with pytest.raises(ConfigError, match="autocast changes the activations"):
        Restate.of(2e6, "bf16", "amp")


def test_cli_estimate_of_a_preset_under_amp_profiles_it(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "gpt2", "--seq-len", "32", "--device", "cpu", "--no-time"]
    assert main([*args, "--precision", "amp"]) == 0
    out = capsys.readouterr().out
    assert "bf16 autocast (fp32 weights)" in out and "profile" in out
    assert main([*args, "--precision", "amp", "--analytic"]) == 2
    assert "autocast" in capsys.readouterr().err


def test_build_model_takes_fp32_weights_under_amp() -> None:
    model = build_model(tiny_llama(n_layers=1))
    assert all(p.dtype == torch.float32 for p in model.parameters())
