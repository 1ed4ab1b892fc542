"""The ``offload`` policy (issue 15, item 2): a layer keeps what it saves, in host memory.

On the CPU the offloader runs its synchronous path (copies out in the forward, back one layer ahead in the
backward, the same bookkeeping as on CUDA), so the gradients must stay bit-equal, the backward must read the
copies, and a trace must count the copies as host memory. The CUDA path (streams, events, pinned memory) runs
only in the GPU test at the end, skipped without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor, nn

from grads import Grads, assert_same, grads_of
from kernels import cpu_flash_gqa
from recompute import ConfigError, ModelSpec, Policy, Workload, estimate
from recompute import offload as offload_module
from recompute.check_gradients import loss_of
from recompute.checkpointing import _iter_wrapped, applied_policy, apply, find_layers
from recompute.cli import main
from recompute.core.analytic.memory import layer_activations
from recompute.core.analytic.table import analytic_table
from recompute.core.plan import best_uniform, frontier
from recompute.core.policy import ALL_POLICIES, OFFLOAD_POLICIES, POLICIES
from recompute.models import build_model
from recompute.offload import Offloader, _Handle
from recompute.trace import trace, trace_module
from tiny import tiny_gpt, tiny_llama

B, S = 2, 32


@pytest.fixture
def offload_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload every saved activation, however small: the tiny models' tensors are all under ``MIN_BYTES``."""
    monkeypatch.setattr(offload_module, "MIN_BYTES", 0)


def batch(vocab: int = 128) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(vocab, (B, S), generator=g), torch.randint(vocab, (B, S), generator=g)


def hf_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
    return model(input_ids=idx, labels=targets, use_cache=False).loss


def step(model: nn.Module, loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = loss_of) -> Grads:
    """One forward/backward of the test batch with the dropout RNG seeded; the loss and every gradient."""
    return grads_of(model, loss_fn, batch())


def offloader_of(model: nn.Module) -> Offloader:
    offloader = find_layers(model)[0].__dict__["_recompute_options"].offloader
    assert isinstance(offloader, Offloader)
    return offloader


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Every tensor whose storage was copied to host memory."""
    made: list[Tensor] = []
    copy_out = Offloader._copy_out

    def spy(self: Offloader, t: Tensor) -> offload_module._Stash:
        made.append(t)
        return copy_out(self, t)

    monkeypatch.setattr(Offloader, "_copy_out", spy)
    return made


# --- gradients ----------------------------------------------------------------------------------------------

LLAMA_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, Tensor, Tensor], Tensor]]] = {
    "gpt": (lambda: build_model(tiny_gpt(n_layers=3), attention="eager"), loss_of),
    "gpt-float64": (lambda: build_model(tiny_gpt(n_layers=3), attention="flash").double(), loss_of),
    "llama": (lambda: build_model(tiny_llama(n_layers=3), attention="flash"), loss_of),
    "hf-llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_CONFIG)), hf_loss),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_the_plain_model(name: str, offload_everything: None, copies: list[Tensor]) -> None:
    build, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    ref = step(model, loss_fn)
    apply(model, "offload")
    assert_same(step(model, loss_fn), ref)
    assert len(copies) >= 3 * 4  # every layer copied its activations out
    assert offloader_of(model).host_bytes() == 0  # and the backward let go of all of them


def test_a_mix_of_per_layer_policies(offload_everything: None) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_llama(n_layers=4), attention="eager").train()
    ref = step(model)
    policy = Policy(layers=("block", "offload", "none", "offload"))
    apply(model, policy)
    assert applied_policy(model) == policy
    assert offloader_of(model).layers == (1, 3)
    assert_same(step(model), ref)
    assert_same(step(model), ref)  # and again: a second forward starts afresh


def test_two_forwards_then_one_backward(offload_everything: None) -> None:
    """Gradient accumulation: each forward's hooks prefetch that forward's own copies."""
    torch.manual_seed(0)
    model = build_model(tiny_llama(n_layers=3), attention="eager").train()

    def two(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
        return loss_of(model, idx, targets) + loss_of(model, idx.flip(0), targets)

    ref = step(model, two)
    apply(model, "offload")
    assert_same(step(model, two), ref)


def test_restoring_with_none(offload_everything: None) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_gpt(n_layers=3), attention="eager").train()
    plain = {n: m.forward for n, m in model.named_modules()}
    ref = step(model)
    apply(model, "offload")
    assert [m for m, _ in _iter_wrapped(model)] == list(find_layers(model))
    assert all(layer._forward_hooks for layer in find_layers(model))
    apply(model, "none")
    assert list(_iter_wrapped(model)) == []
    assert not any(layer._forward_hooks for layer in find_layers(model))
    assert {n: m.forward for n, m in model.named_modules()} == plain
    assert_same(step(model), ref)


def test_under_torch_compile_the_layers_run_eagerly(offload_everything: None, copies: list[Tensor]) -> None:
    """A graph break at each offloaded layer (aot_eager: no code generation); the same copies as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(tiny_gpt(n_layers=2, dropout=0.0), attention="eager").train()
    ref = step(model)
    apply(model, "offload")
    step(model)
    eager = len(copies)
    model.zero_grad(set_to_none=True)
    loss = loss_of(torch.compile(model, backend="aot_eager"), *batch())
    loss.backward()
    torch._dynamo.reset()
    assert len(copies) == 2 * eager
    torch.testing.assert_close(loss.detach(), ref[0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[1][name], msg=lambda m, n=name: f"{n}: {m}")


# --- what is copied, and that the backward reads the copies ------------------------------------------------


class ViewLayer(nn.Module):
    """Saves views (chunks with offsets), a transposed and a strided one of one storage, its input (the previous
    layer's output, via the linear) and an output of its own (exp)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 3 * d)
        self.kept: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.kept = h = self.fc(x)  # (b, d) -> (b, 3d); the layer keeps a handle, to tamper with later
        q, k, v = h.chunk(3, dim=-1)
        a = q.t().sin().t()  # sin saves q.t(): non-contiguous, offset 0
        c = v[:, ::2].cos()  # cos saves a strided view at an offset
        return x + a + 0.1 * k.exp() + 0.1 * c.repeat_interleave(2, dim=-1)


class ViewModel(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViewLayer(d) for _ in range(n))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().sum()


def view_grads(model: ViewModel, x: Tensor, tamper: bool = False) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    if tamper:  # overwrite what the layers saved, behind autograd's back (no version bump)
        for layer in model.layers:
            assert layer.kept is not None
            layer.kept.data.fill_(0.5)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_views_and_non_contiguous_tensors_are_rebuilt_on_one_copy(
    offload_everything: None, copies: list[Tensor]
) -> None:
    torch.manual_seed(0)
    model, x = ViewModel().double(), torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    ref = view_grads(model, x)
    apply(model, "offload")
    handles = []
    pack = Offloader._pack

    def spy(self: Offloader, index: int, outer: object, t: Tensor) -> object:
        packed = pack(self, index, outer, t)  # type: ignore[arg-type]
        handles.append(packed)
        return packed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Offloader, "_pack", spy)
        got = view_grads(model, x)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)
    # Saved per layer: x (the layer input, but layer 0's, a leaf), q.t() and v[:, ::2] (views of h), exp(k).
    offloaded = [h for h in handles if isinstance(h, _Handle)]
    assert (len(offloaded), len(copies)) == (3 + 4 + 4, 2 + 3 + 3)
    by_stash: dict[int, list[_Handle]] = {}
    for h in offloaded:
        by_stash.setdefault(id(h.stash), []).append(h)
    shared = [sorted((h.size, h.stride, h.offset) for h in hs) for hs in by_stash.values() if len(hs) > 1]
    assert shared == [[((8, 8), (48, 2), 32), ((16, 8), (1, 48), 0)]] * 3  # h copied once per layer


def test_the_backward_reads_the_host_copies(offload_everything: None) -> None:
    """Overwriting the device tensors after the forward changes a plain model's gradients, not an offloaded one's."""
    torch.manual_seed(0)
    model, x = ViewModel().double(), torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    ref = view_grads(model, x)
    assert view_grads(model, x, tamper=True)["layers.0.fc.weight"].ne(ref["layers.0.fc.weight"]).any()
    apply(model, "offload")
    got = view_grads(model, x, tamper=True)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_small_tensors_stay(copies: list[Tensor]) -> None:
    """At the default threshold (64 KiB) only the GELU's input and output (b, s, 4h) in fp32 leave the device."""
    assert offload_module.MIN_BYTES == 64 * 1024
    torch.manual_seed(0)
    model = build_model(tiny_gpt(n_layers=2), attention="eager").train()
    apply(model, "offload")
    step(model)
    assert [t.untyped_storage().nbytes() for t in copies] == [B * S * 4 * 64 * 4] * 4


def test_weights_are_never_copied(offload_everything: None, copies: list[Tensor]) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_llama(n_layers=2), attention="eager").train()
    apply(model, "offload")
    step(model)
    weights = {id(p.untyped_storage()) for p in model.parameters()}
    assert copies and not any(id(t.untyped_storage()) in weights for t in copies)


def test_each_layer_comes_back_one_layer_ahead(offload_everything: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer i-1's copies start when layer i's backward starts, before it reads anything, not earlier."""
    events: list[tuple[str, int]] = []
    copy_in, unpack = Offloader._copy_in, Offloader._unpack

    def spy_copy_in(self: Offloader, stash: offload_module._Stash) -> None:
        if stash.fetched is None:
            events.append(("copy back", max(stash.layers)))
        copy_in(self, stash)

    def spy_unpack(self: Offloader, index: int, outer: object, packed: object) -> Tensor:
        events.append(("read", index))
        return unpack(self, index, outer, packed)  # type: ignore[arg-type]

    monkeypatch.setattr(Offloader, "_copy_in", spy_copy_in)
    monkeypatch.setattr(Offloader, "_unpack", spy_unpack)
    torch.manual_seed(0)
    model = build_model(tiny_llama(n_layers=3), attention="flash").train()
    apply(model, "offload")
    step(model)
    runs = [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]
    assert runs == [
        ("copy back", 2),
        ("copy back", 1),
        ("read", 2),
        ("copy back", 0),
        ("read", 1),
        ("read", 0),
    ]


def test_without_the_output_hooks_unpack_fetches(offload_everything: None) -> None:
    """The fallback: a layer whose backward starts unannounced is copied back at its first read."""
    torch.manual_seed(0)
    model = build_model(tiny_gpt(n_layers=3), attention="eager").train()
    ref = step(model)
    apply(model, "offload")
    for handle in model.__dict__["_recompute_hooks"]:
        handle.remove()
    assert_same(step(model), ref)


# --- the trace and the analytic model -----------------------------------------------------------------------

SPEC = tiny_llama(n_layers=4, hidden=256, max_positions=256)
WL = Workload(micro_batch=2, seq_len=256, dtype="fp32", device="cpu", attention="flash")


def test_the_trace_counts_the_copies_as_host_memory() -> None:
    none, off = trace(SPEC, WL, "none"), trace(SPEC, WL, "offload")
    assert all(layer.total < 64 * 1024 for layer in off.layers)  # only what is under the threshold stays
    assert [p.total + p.host for p in off.layers] == [p.total for p in none.layers]
    assert off.host == sum(p.host for p in off.layers)  # all of them in host memory at the end of the forward
    assert off.peak < none.peak
    assert off.peak_phase == "backward of layer 1"  # layer 1 being consumed, layer 0 prefetched
    assert (off.head, off.embedding) == (none.head, none.embedding)


def test_a_scaled_trace_equals_the_full_one() -> None:
    """Layer 1's backward holds layer 0's prefetched copies too: the largest, and neither first nor last."""
    spec = ModelSpec(**{**SPEC.to_dict(), "n_layers": 6})
    full, scaled = trace(spec, WL, "offload"), trace(spec, WL, "offload", layers=2)
    assert full.peak_phase == "backward of layer 1"
    for figure in ("layers", "embedding", "head", "peak", "peak_phase", "peak_breakdown", "phases", "host"):
        assert getattr(scaled, figure) == getattr(full, figure), figure
    with pytest.raises(ConfigError, match="trace at least 2 layers") as e:
        trace(spec, WL, "offload", layers=1)
    assert "\n" not in str(e.value)


def test_a_per_layer_trace() -> None:
    mixed = trace(SPEC, WL, Policy(layers=("offload", "block", "none", "offload")))
    assert [p.host > 0 for p in mixed.layers] == [True, False, False, True]
    assert mixed.layers[1].components.keys() == {"checkpoint"}


def test_the_fake_trace_equals_a_real_step() -> None:
    torch.manual_seed(0)
    model = build_model(SPEC, attention="flash").train()
    apply(model, "offload")
    real = trace_module(model, (torch.randint(128, (2, 256)), torch.randint(128, (2, 256))))
    fake = trace(SPEC, WL, "offload")
    for figure in ("layers", "embedding", "head", "peak", "peak_phase", "host", "phases"):
        assert getattr(fake, figure) == getattr(real, figure), figure


@cpu_flash_gqa
def test_the_analytic_model_costs_offload() -> None:
    none, off = estimate(SPEC, WL, "none"), estimate(SPEC, WL, "offload")
    assert off.recompute_flops == 0
    outside = ("embedding", "head", "logits")
    assert {k: v for k, v in off.activations.items() if v} == {k: none.activations[k] for k in outside}
    assert off.host == pytest.approx(sum(none.activations[g] for g in ("attention", "mlp", "norms")))
    assert off.peak < none.peak
    traced = trace(SPEC, WL, "offload")
    assert off.peak_phase == traced.peak_phase
    assert off.peak == pytest.approx(traced.peak, rel=0.03)  # none's is as close
    assert off.host == pytest.approx(traced.host, rel=0.01)
    assert any("host memory" in n for n in off.notes)


def test_the_planner_leaves_offload_out() -> None:
    """Its price is copy time, which no cost here models: in FLOPs it would be free and win every plan."""
    assert "offload" in OFFLOAD_POLICIES and "offload" not in POLICIES and "offload" in ALL_POLICIES
    points = frontier(analytic_table(SPEC, WL))
    assert not any("offload" in p.layers for p in points)
    found = best_uniform(SPEC, WL, estimate(SPEC, WL, "offload").peak, names=("offload",))
    assert found is not None and found[0] == Policy("offload", every=1)


def test_the_commands_show_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", "gpt2", "--seq-len", "128", "--scale-from", "2", "--policy", "offload"]) == 0
    out = capsys.readouterr().out
    assert "host memory: " in out and "in host memory" in out
    assert main(["estimate", "--model", "gpt2", "--seq-len", "128", "--policy", "offload", "--no-time"]) == 0
    out = capsys.readouterr().out
    assert "breakdown of offload" in out and "host memory (offloaded)" in out


# --- input ---------------------------------------------------------------------------------------------------


def test_a_policy_file_naming_offload_loads(tmp_path: Path, offload_everything: None) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "recompute.policy/1", "layers": ["offload", "none", "offload"]}))
    assert Policy.load(path) == Policy.from_dict(json.loads(path.read_text()))
    assert Policy.load(path).describe() == "per-layer none x1, offload x2"
    torch.manual_seed(0)
    model = build_model(tiny_gpt(n_layers=3), attention="eager").train()
    ref = step(model)
    apply(model, path)
    assert offloader_of(model).layers == (0, 2)
    assert_same(step(model), ref)


def test_a_model_without_layers_is_one_line() -> None:
    with pytest.raises(ConfigError, match="found no transformer layers in Sequential") as e:
        apply(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), "offload")
    assert "\n" not in str(e.value)


def test_no_grad_forward_runs_plain(offload_everything: None, copies: list[Tensor]) -> None:
    model = build_model(tiny_gpt(n_layers=2), attention="eager").eval()
    apply(model, "offload")
    with torch.no_grad():
        model(batch()[0])
    assert copies == []


# --- on a GPU -------------------------------------------------------------------------------------------------


def cuda_step(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[int, Grads]:
    """Peak bytes allocated beyond the model's (forward and backward), and the gradients."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = loss_of(model, idx, targets)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return peak, (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_peak_drops_and_the_gradients_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned host buffers and side-stream copies; the peak falls by most of the layers' saved bytes."""
    spec = ModelSpec(**{**SPEC.to_dict(), "n_layers": 8, "max_positions": 1024})
    wl = dataclasses.replace(WL, micro_batch=4, seq_len=1024, device="cuda", attention="eager")
    torch.manual_seed(0)
    model = build_model(spec, attention=wl.attention).cuda().train()
    g = torch.Generator(device="cuda").manual_seed(0)
    idx, targets = (torch.randint(spec.vocab, (wl.micro_batch, wl.seq_len), device="cuda", generator=g) for _ in "ab")
    peak_none, ref = cuda_step(model, idx, targets)
    streamed: list[bool] = []
    copy_out = Offloader._copy_out

    def spy(self: Offloader, t: Tensor) -> offload_module._Stash:
        stash = copy_out(self, t)
        streamed.append(stash.streamed and stash.host.is_pinned())
        return stash

    monkeypatch.setattr(Offloader, "_copy_out", spy)
    apply(model, "offload")
    peak_offload, got = cuda_step(model, idx, targets)
    assert streamed and all(streamed)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-5)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    layer = layer_activations(spec, wl).total
    assert peak_offload < peak_none - 4 * layer  # 8 layers stored under none, at most 2 at once under offload
