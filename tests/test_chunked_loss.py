"""``apply(model, policy, loss="chunked")``: the output layer and the loss over chunks of tokens.

The loss and every gradient equal the plain model's (recompute's GPT and Llama, transformers' Llama, GPT-2 and
Qwen3, tensor parallel too), the logits' gradients to the bit; ignored targets count as ``F.cross_entropy``
counts them; ``apply`` without ``loss`` gives the plain model back; bad input is one ``ConfigError`` (exit
code 2 at the CLI); and the analytic loss phase is the trace's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import recompute
from recompute import ConfigError, ModelSpec, Workload, estimate
from recompute.cli import main
from recompute.core.workload import default_loss_chunk
from recompute.models import build_model
from recompute.models.core import cross_entropy
from recompute.trace import trace
from tiny import tiny_gpt, tiny_llama

B, S, V = 3, 40, 128


def batch(vocab: int = V, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (B, S), generator=g), torch.randint(vocab, (B, S), generator=g)


def own(name: str) -> nn.Module:
    torch.manual_seed(0)
    spec = tiny_gpt(dropout=0.0) if name == "gpt" else tiny_llama()
    return build_model(spec, attention="eager").double()


def hf(name: str) -> nn.Module:
    import transformers

    small = {"vocab_size": V, "max_position_embeddings": 64, "bos_token_id": None, "eos_token_id": None}
    llama = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**small, **llama, num_key_value_heads=2),
        "qwen3": lambda: transformers.Qwen3Config(**small, **llama, num_key_value_heads=2, head_dim=8),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        ),
    }  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[name](), attn_implementation="eager").double()


def own_loss(model: nn.Module, idx: Tensor, tgt: Tensor) -> tuple[Any, Tensor]:
    logits, loss = model(idx, tgt)
    return logits, loss


def hf_loss(model: nn.Module, idx: Tensor, tgt: Tensor) -> tuple[Any, Tensor]:
    out = model(input_ids=idx, labels=tgt)
    return out.logits, out.loss


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., tuple[Any, Tensor]]]] = {
    "gpt": (lambda: own("gpt"), own_loss),
    "llama": (lambda: own("llama"), own_loss),
    "hf-llama": (lambda: hf("llama"), hf_loss),
    "hf-gpt2": (lambda: hf("gpt2"), hf_loss),
    "hf-qwen3": (lambda: hf("qwen3"), hf_loss),
}


def grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare(name: str, policy: str, chunk: int | None, tgt_edit: Callable[[Tensor], None] | None = None) -> None:
    build, loss_of = MODELS[name]
    ref = build()
    model = copy.deepcopy(ref)
    recompute.apply(model, policy, loss="chunked", loss_chunk=chunk)
    idx, tgt = batch()
    if tgt_edit is not None:
        tgt_edit(tgt)
    logits_ref, loss_ref = loss_of(ref, idx, tgt)
    loss_ref.backward()
    logits, loss = loss_of(model, idx, tgt)
    loss.backward()
    assert logits is None and logits_ref is not None
    torch.testing.assert_close(loss, loss_ref)
    want, got = grads(ref), grads(model)
    assert want.keys() == got.keys()
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, msg=lambda m, n=n: f"grad of {n}: {m}")


@pytest.mark.parametrize("chunk", [7, 48, None], ids=["7 tokens", "48 tokens", "default"])
@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_gradients_equal_the_plain_loss(name: str, chunk: int | None) -> None:
    compare(name, "none", chunk)


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_with_a_recomputation_policy(name: str) -> None:
    compare(name, "block", 16)


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_a_scaled_loss_and_accumulated_micro_batches(name: str) -> None:
    """The backward scales the gradients made in the forward (gradient accumulation divides the loss), and a
    second micro-batch's add to the first's."""
    build, loss_of = MODELS[name]
    ref = build()
    model = copy.deepcopy(ref)
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    for seed in (0, 1):
        idx, tgt = batch(seed=seed)
        for m in (ref, model):
            (loss_of(m, idx, tgt)[1] / 4).backward()
    want, got = grads(ref), grads(model)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, msg=lambda m, n=n: f"grad of {n}: {m}")


def test_no_flops_are_replayed() -> None:
    """The chunked step runs the plain step's matmul FLOPs: each chunk's gradients are taken in the forward."""
    from torch.utils.flop_counter import FlopCounterMode

    ref = own("llama")
    model = copy.deepcopy(ref)
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    counted = []
    for m in (ref, model):
        with FlopCounterMode(display=False) as counter:
            m(*batch())[1].backward()
        counted.append(counter.get_total_flops())
    assert counted[0] == counted[1] > 0


def test_a_second_backward_is_refused() -> None:
    model = own("gpt")
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    _, loss = model(*batch())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="its backward ran twice") as e:
        loss.backward()
    assert "\n" not in str(e.value)


class ForeignHead(nn.Module):
    """A head that reads a scale it does not own: its gradient would not reach the scale."""

    def __init__(self, inner: nn.Module, scale: nn.Parameter) -> None:
        super().__init__()
        self.inner, self.scale_owner = inner, [scale]  # a list: not registered as the head's parameter

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x) * self.scale_owner[0]


def test_a_head_reading_a_parameter_it_does_not_own_is_refused() -> None:
    model = own("gpt")
    model.scale = nn.Parameter(torch.ones((), dtype=torch.float64))
    model.lm_head = ForeignHead(model.lm_head, model.scale)
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    with pytest.raises(ConfigError, match="not a parameter of the head") as e:
        model(*batch())
    assert "\n" not in str(e.value)


def test_fp16_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Gradients taken in the forward come before a loss scaler scales them: fp16's would underflow."""
    model = own("gpt").half()
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    with pytest.raises(ConfigError, match="chunked loss in fp16") as e:
        model(*batch())
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="dtype fp16 with the chunked loss"):
        Workload(loss="chunked", dtype="fp16")
    assert main(["estimate", "--loss", "chunked", "--dtype", "fp16"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--dtype fp16 with the chunked loss" in err
    assert main(["plan", "--model", "gpt2", "--dtype", "fp16", "--budget", "80GiB", "--cost", "flops"]) == 0
    assert "the chunked loss not considered: in fp16 its gradients" in capsys.readouterr().out


def test_a_head_emptied_outside_its_forward_is_refused() -> None:
    """ZeRO-3 partitions a module's weights outside its forward; the chunks run the head's forward hooks aside."""
    model = own("gpt")
    model.lm_head = nn.Linear(32, V, bias=False).double()
    model.lm_head.weight = nn.Parameter(torch.empty(0, dtype=torch.float64))
    recompute.apply(model, "none", loss="chunked", loss_chunk=16)
    with pytest.raises(ConfigError, match="the head's weight is empty outside its forward") as e:
        model(*batch())
    assert "\n" not in str(e.value)


def ignore_some(tgt: Tensor) -> None:
    tgt[0, :] = -100  # a whole chunk of ignored targets among others
    tgt[1, 5:9] = -100


@pytest.mark.parametrize("name", list(MODELS))
def test_ignored_targets_count_as_in_cross_entropy(name: str) -> None:
    """The mean is over the targets that are not -100, over the whole batch (not a mean of chunk means)."""
    compare(name, "none", 10, ignore_some)


def test_hf_num_items_in_batch_is_honoured() -> None:
    ref = hf("llama")
    model = copy.deepcopy(ref)
    recompute.apply(model, "none", loss="chunked", loss_chunk=9)
    idx, tgt = batch()
    a = ref(input_ids=idx, labels=tgt, num_items_in_batch=torch.tensor(500)).loss
    b = model(input_ids=idx, labels=tgt, num_items_in_batch=torch.tensor(500)).loss
    torch.testing.assert_close(b, a)


def test_the_logits_gradient_is_bit_exact() -> None:
    """Each logit's gradient is the same float with and without chunks (fp32; captured where the loss gets them)."""
    torch.manual_seed(0)
    ref = build_model(tiny_llama(), attention="eager")
    model = copy.deepcopy(ref)
    seen: dict[str, list[Tensor]] = {"ref": [], "chunked": []}

    def spy(key: str) -> Callable[..., Tensor]:
        def loss_fn(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
            logits.register_hook(seen[key].append)
            return cross_entropy(logits, targets, reduction=reduction)

        return loss_fn

    ref.loss_fn, model.loss_fn = spy("ref"), spy("chunked")
    recompute.apply(model, "none", loss="chunked", loss_chunk=32)
    idx, tgt = batch()
    tgt[1, 3:30] = -100
    for m in (ref, model):
        m(idx, tgt)[1].backward()
    (whole,) = seen["ref"]
    chunks = seen["chunked"]  # taken in the forward, first chunk to last
    assert [c.size(0) for c in chunks] == [32, 32, 32, 24]
    assert torch.equal(torch.cat(chunks), whole.reshape(-1, V))


def test_without_targets_the_model_returns_its_logits() -> None:
    for name in ("gpt", "hf-gpt2"):
        ref = MODELS[name][0]()
        model = copy.deepcopy(ref)
        recompute.apply(model, "block", loss="chunked")
        idx, _ = batch()
        if name == "gpt":
            assert torch.equal(model(idx)[0], ref(idx)[0])
        else:
            # No key/value cache: a checkpointed layer runs without one, which changes the sums' rounding.
            got, want = (m(input_ids=idx, use_cache=False).logits for m in (model, ref))
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
@pytest.mark.parametrize("again", ["none", "block"])
def test_apply_without_loss_restores_the_plain_loss(name: str, again: str) -> None:
    build, loss_of = MODELS[name]
    model = build()
    recompute.apply(model, "block", loss="chunked", loss_chunk=16)
    recompute.apply(model, "attn", loss="chunked", loss_chunk=16)  # applying twice wraps the originals once
    recompute.apply(model, again)
    head = model.get_output_embeddings() if name.startswith("hf") else model.lm_head
    for m in (model, head):
        assert "_recompute_saved" not in m.__dict__ and "forward" not in m.__dict__
    assert "_loss_function" not in model.__dict__
    if name == "gpt":
        assert model.loss_fn is cross_entropy
    logits, loss = loss_of(model, *batch())
    assert logits is not None and logits.shape == (B, S, V) and loss.isfinite()


def test_default_chunk_is_256_mib_of_fp32_logits() -> None:
    assert default_loss_chunk(128256) == 512 and default_loss_chunk(50257) == 1024
    assert default_loss_chunk(151936) == 256 and default_loss_chunk(V) == 2**19


# --- bad input --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss": "chunked", "loss_chunk": 0}, "loss_chunk must be a positive integer, got 0"),
        ({"loss": "chunked", "loss_chunk": -4}, "loss_chunk must be a positive integer, got -4"),
        ({"loss": "chunked", "loss_chunk": 2.5}, "loss_chunk must be a positive integer, got 2.5"),
        ({"loss": "chunked", "loss_chunk": True}, "loss_chunk must be a positive integer, got True"),
        ({"loss": "chunky"}, "loss must be one of full, chunked; got 'chunky'"),
        ({"loss_chunk": 64}, "loss_chunk 64 needs loss='chunked'"),
    ],
)
def test_bad_chunks_are_refused_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    model = own("gpt")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        recompute.apply(model, "block", **kwargs)
    assert "\n" not in str(e.value)
    assert "_recompute_saved" not in model.__dict__  # refused before anything changed


def test_a_chunk_longer_than_the_batch_is_refused_at_the_first_forward() -> None:
    model = own("llama")
    recompute.apply(model, "none", loss="chunked", loss_chunk=B * S + 1)
    with pytest.raises(ConfigError, match=f"loss_chunk {B * S + 1} is more than the {B * S} tokens"):
        model(*batch())
    recompute.apply(model, "none", loss="chunked", loss_chunk=B * S)  # one chunk: fine
    assert model(*batch())[1].isfinite()


class NoHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Tensor:
        return x


class InlineLoss(NoHead):
    """nanoGPT's convention: a head, and F.cross_entropy written in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(8, 16)

    def forward(self, x: Tensor, targets: Tensor | None = None) -> Any:
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, 16), targets.view(-1)) if targets is not None else None


def test_models_whose_head_or_loss_cannot_be_found_are_refused() -> None:
    with pytest.raises(ConfigError, match="found no output layer in NoHead"):
        recompute.apply(NoHead(), "none", loss="chunked")
    with pytest.raises(ConfigError, match="found no loss in InlineLoss"):
        recompute.apply(InlineLoss(), "none", loss="chunked")
    model = own("gpt")
    model.loss_fn = lambda logits, targets: F.cross_entropy(logits.view(-1, V), targets.view(-1))
    with pytest.raises(ConfigError, match="takes no reduction argument"):
        recompute.apply(model, "none", loss="chunked")


def test_logits_changed_between_head_and_loss_are_refused() -> None:
    """Cohere scales its logits before the loss: the chunks would skip that, so the first forward says so."""
    import transformers

    config = transformers.CohereConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    recompute.apply(model, "none", loss="chunked")
    idx, tgt = batch()
    with pytest.raises(ConfigError, match="changes the logits between its head and its loss_function"):
        model(input_ids=idx, labels=tgt)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["estimate", "--loss", "chunked", "--loss-chunk", "0"], "--loss-chunk must be a positive integer, got 0"),
        (
            ["plan", "--budget", "70GiB", "--loss", "chunked", "--loss-chunk", "-8"],
            "--loss-chunk must be a positive integer, got -8",
        ),
        (["trace", "--loss-chunk", "64"], "--loss-chunk 64 needs --loss chunked"),
        (["estimate", "--loss", "chunked", "--seq-len", "512", "--loss-chunk", "513"], "more than the 512 tokens"),
        (["bench", "--loss", "chunked", "--loss-chunk", "0"], "--loss-chunk must be a positive integer"),
        (["train", "--loss", "chunked", "--loss-chunk", "0"], "--loss-chunk must be a positive integer"),
        (["train", "--loss-chunk", "8"], "--loss-chunk 8 needs --loss chunked"),
    ],
)
def test_cli_refuses_bad_chunks_with_exit_code_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_rejects_a_non_integer_chunk(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["trace", "--loss", "chunked", "--loss-chunk", "1.5"])
    assert e.value.code == 2 and "invalid int value: '1.5'" in capsys.readouterr().err


# --- memory: the analytic model against the trace -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "wl", "policy"),
    [
        ("gpt2", {"seq_len": 1024, "micro_batch": 2, "dtype": "fp32", "loss_chunk": 100}, "none"),
        ("gpt2", {"seq_len": 1024, "dtype": "bf16", "attention": "eager"}, "block"),
        ("llama3.1-8b", {"seq_len": 4096, "dtype": "bf16", "loss_chunk": 2048}, "block"),
        ("llama3.1-8b", {"seq_len": 4096, "dtype": "bf16"}, "attn+mlp"),
        ("llama3.1-8b", {"seq_len": 4096, "dtype": "bf16", "loss_chunk": 4096}, "block"),
    ],
    ids=["gpt2 fp32 b=2 c=100", "gpt2 bf16 default", "llama c=2048", "llama default", "llama one chunk"],
)
def test_the_analytic_loss_phase_is_the_traced_one(name: str, wl: dict[str, Any], policy: str) -> None:
    """Within 1e-4 (``tests/test_validate.py``'s tolerance for peaks); the plain loss's phase is higher.

    The chunked loss takes its gradients in the forward, so its phase is the forward's (the backward's is lower).
    """
    spec = ModelSpec.from_name(name)
    precision = "fp32" if wl["dtype"] == "fp32" else "bf16"
    chunked = Workload(**wl, loss="chunked", device="cpu", precision=precision)
    traced, predicted = trace(spec, chunked, policy, layers=2), estimate(spec, chunked, policy)
    loss_phase = traced.phases["forward: head and loss"]
    assert traced.phases["backward: head and loss"] < loss_phase
    assert predicted.loss_phase == pytest.approx(loss_phase, rel=1e-4)
    if predicted.peak_phase == "loss":
        assert traced.peak_phase == "forward (head and loss)"
        assert predicted.peak == pytest.approx(traced.peak, rel=1e-4)
    assert predicted.peak >= traced.peak * (1 - 1e-4)  # a layer's backward: its workspace is an upper bound
    full = Workload(**{k: v for k, v in wl.items() if k != "loss_chunk"}, device="cpu", precision=precision)
    assert estimate(spec, full, policy).loss_phase > predicted.loss_phase
    assert traced.head.ops.get("LogSoftmaxBackward0", 0) == 0  # no log-probabilities kept to the backward


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_one_tensor_parallel_rank_is_close_to_the_estimate(sp: bool) -> None:
    """t=2 on a fake process group, within ``tests/test_trace_parallel.py``'s 0.5 %."""
    spec = ModelSpec.from_name("gpt2")
    wl = Workload(seq_len=1024, tp=2, sp=sp, attention="eager", dtype="bf16", precision="bf16", device="cpu",
                  loss="chunked", loss_chunk=256)  # fmt: skip
    traced = trace(spec, wl, "core_attn", layers=2)
    loss_phase = traced.phases["forward: head and loss"]
    assert estimate(spec, wl, "core_attn").loss_phase == pytest.approx(loss_phase, rel=0.005)


def test_trace_cli_measures_the_chunked_loss(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["trace", "--model", "gpt2", "--seq-len", "512", "--scale-from", "1", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*base, "--loss", "chunked", "--loss-chunk", "128"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    loss = "backward: head and loss"
    assert chunked["phases"][loss] < full["phases"][loss]
    assert chunked["workload"]["loss"] == "chunked" and chunked["workload"]["loss_chunk"] == 128


# --- bench and train run it ------------------------------------------------------------------------------


def test_bench_measures_the_chunked_loss_as_the_trace_predicts() -> None:
    """Real CPU steps under MemTracker: the chunked model's peak is the fake trace's, below the plain loss's."""
    from recompute.bench import bench

    spec = ModelSpec(hidden=32, n_layers=2, n_heads=4, vocab=4096, max_positions=64, name="wide-vocab")
    wl = {"attention": "eager", "micro_batch": 2, "seq_len": 64, "dtype": "fp32", "device": "cpu"}
    full = bench(spec, Workload(**wl), ["none"], steps=1, warmup=1)
    chunked_wl = Workload(**wl, loss="chunked", loss_chunk=32)
    chunked = bench(spec, chunked_wl, ["none"], steps=1, warmup=1)
    (row,), (ref,) = chunked.rows, full.rows
    assert row.peak == row.traced_peak == trace(spec, chunked_wl, "none").peak
    assert row.peak < ref.peak


def test_train_losses_equal_the_plain_loss(tmp_path: Path) -> None:
    from recompute.train import train
    from recompute.train.config import TrainConfig
    from tiny import TRAIN

    config = TrainConfig.of(**{**TRAIN, "steps": 3, "out": str(tmp_path / "full")})
    full = [m.loss for m in train(config).metrics]
    chunked = train(config.replace(out=str(tmp_path / "chunked"), loss="chunked", loss_chunk=40))
    assert [m.loss for m in chunked.metrics] == pytest.approx(full, rel=1e-5)


# --- tensor parallelism, on two real ranks ------------------------------------------------------------------


def test_tensor_parallel_chunks_equal_one_process(tmp_path: Path) -> None:
    """TP and TP+SP (t=2, gloo): each chunk's loss is Megatron's vocabulary-parallel one, gathered over ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    from test_parallel import failures, run_worker

    assert not failures(run_worker("chunked", 2, tmp_path), "chunked ")
