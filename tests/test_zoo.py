"""The model zoo: transformers' own classes built from tiny configs, traced, counted for real and verified.

Every config is written to a config.json and read back through ``--model``'s path (``resolve_source``); the
class built is whatever ``AutoModelForCausalLM.from_config`` builds for it. The trace on fake tensors must
save, layer by layer, exactly the bytes a real CPU step of the same class saves (counted here independently of
the trace's tracker), and ``verify`` must find gradients bit-equal under whole-layer and sub-block policies.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from recompute import Workload
from recompute.check_gradients import verify
from recompute.checkpointing import apply, find_layers
from recompute.cli import main
from recompute.core.analytic import layer_activations
from recompute.core.errors import ConfigError
from recompute.core.policy import ALL_POLICIES
from recompute.core.spec import spec_from_config
from recompute.models.source import ModelSource, build_source, resolve_source
from recompute.runtime import TORCH_DTYPES
from recompute.trace import trace

transformers = pytest.importorskip("transformers")

SIZE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
GPT2_SIZE = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=64, bos_token_id=None)
MOE = dict(num_experts_per_tok=2)
ZOO: dict[str, dict[str, Any]] = {
    "llama": SIZE,
    "qwen2": SIZE,
    "mistral": SIZE,
    "gemma2": {**SIZE, "head_dim": 16},
    "phi3": SIZE,
    "olmo2": SIZE,
    "mixtral": {**SIZE, **MOE, "num_local_experts": 4},
    "qwen3_moe": {**SIZE, **MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
    "gpt_neox": SIZE,
    "gpt2": GPT2_SIZE,
}
"""Two layers, h = 64, 4 heads (2 KV heads where the class has GQA), vocab 128; MoE: 4 experts, top-2."""

WL = Workload(seq_len=32, micro_batch=2, dtype="fp32", attention="flash", device="cpu")


def config_json(kind: str, folder: Path) -> Path:
    path = folder / f"{kind}.json"
    path.write_text(json.dumps({"model_type": kind, **ZOO[kind]}))
    return path


@pytest.fixture(params=list(ZOO))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def saved_storages(model: nn.Module, idx: Tensor, targets: Tensor) -> tuple[list[int], list[int]]:
    """Per layer, the bytes of the distinct storages that the tensors autograd saved still keep alive when the
    backward starts (a view keeps its whole storage; what a dropped branch saved is freed by then), each by the
    layer that saved it first, no weights; and the bytes of those first tensors themselves (views as views)."""
    layers = find_layers(model)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current: list[int | None] = [None]
    saved: list[tuple[int, weakref.ref[Tensor]]] = []
    handles = [
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)) for i, layer in enumerate(layers)
    ]
    handles += [layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)) for layer in layers]

    def pack(t: Tensor) -> Tensor:
        if current[0] is not None:
            saved.append((current[0], weakref.ref(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=idx, labels=targets).loss
    storages: dict[int, tuple[int, int]] = {}
    views = [0] * len(layers)
    for layer, ref in saved:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in weights | storages.keys():
            storages[t.untyped_storage().data_ptr()] = (layer, t.untyped_storage().nbytes())
            views[layer] += t.numel() * t.element_size()
    loss.backward()
    for h in handles:
        h.remove()
    kept = [0] * len(layers)
    for layer, nbytes in storages.values():
        kept[layer] += nbytes
    return kept, views


def real_saved_per_layer(model: nn.Module, idx: Tensor, targets: Tensor) -> list[int]:
    """Bytes each layer saves for the backward in a real step (``saved_storages``)."""
    return saved_storages(model, idx, targets)[0]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("fused", ["phi3", "gpt_neox", "gpt2"])
def test_saved_views_count_their_whole_storage(fused: str, batch: int, tmp_path: Path) -> None:
    """Phi-3's SDPA saves v as a view of the fused Q/K/V output (q and k are rotary copies), its SiLU and product
    views of the fused gate/up output; GPT-2's eager bmm at b = 1 saves k^T as a view of c_attn's output. Each
    keeps its whole storage alive: the trace and the analytic model count storages, once each, as the real step
    keeps them (counted here from the saved tensors), where the views' own bytes fall short (transformers 5.24
    GPT-NeoX saves no such view: checked exact all the same)."""
    source = resolve_source(str(config_json(fused, tmp_path)))
    for attention, dtype in (("flash", "fp32"), ("eager", "fp32"), ("flash", "bf16")):
        wl = Workload(seq_len=32, micro_batch=batch, dtype=dtype, attention=attention, device="cpu")
        torch.manual_seed(0)
        model = build_source(source, attention=attention, dtype=TORCH_DTYPES[dtype]).model.train()
        idx, targets = torch.randint(128, (2, batch, 32))
        kept, views = saved_storages(model, idx, targets)
        assert [p.total for p in trace(source, wl, "none").layers] == kept, (attention, dtype)
        spec = spec_from_config({"model_type": fused, **ZOO[fused]})
        assert [layer_activations(spec, wl, i).stored("none") for i in range(2)] == kept, (attention, dtype)
        if fused == "phi3" or (fused, batch, attention) == ("gpt2", 1, "eager"):  # measured: views fall short here
            assert all(v < k for v, k in zip(views, kept)), "no view keeps more than itself: the test proves nothing"


DEEPSEEK = {
    **SIZE, "model_type": "deepseek_v3", "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16,
}  # fmt: skip
"""DeepSeek-V3's shape, small: a dense layer, then MoE layers whose router picks expert groups."""


def test_a_dropped_branch_is_not_kept(tmp_path: Path) -> None:
    """DeepSeek-V3's router ranks expert groups with ``topk`` of scores it then drops: what autograd saved for
    that branch is freed with it during the forward. The trace keeps only what lives until the backward, as the
    real step does (the trace used to count those storages too: 896 B per MoE layer here)."""
    (tmp_path / "deepseek.json").write_text(json.dumps(DEEPSEEK))
    source = resolve_source(str(tmp_path / "deepseek.json"))
    torch.manual_seed(0)
    model = build_source(source).model.train()
    idx, targets = torch.randint(128, (2, 2, 32))
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    every: dict[int, torch.UntypedStorage] = {}  # held here: nothing saved is freed, no address reused

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            every.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=idx, labels=targets)
    kept, _ = saved_storages(model, idx, targets)
    result = trace(source, WL, "none")
    assert [p.total for p in result.layers] == kept
    assert sum(st.nbytes() for st in every.values()) > result.activations  # some saved storages died in the forward


def test_trace_equals_a_real_step(kind: str, tmp_path: Path) -> None:
    source = resolve_source(str(config_json(kind, tmp_path)))
    result = trace(source, WL, "none")
    torch.manual_seed(0)
    built = build_source(source)
    model = built.model.train()
    idx, targets = torch.randint(128, (2, 2, 32))
    assert [p.total for p in result.layers] == real_saved_per_layer(model, idx, targets)
    assert result.parameter_count == model.num_parameters()
    assert f"traced {built.class_name} built from {tmp_path / kind}.json" in result.notes[0]
    assert type(model).__module__.startswith("transformers.models")


@pytest.mark.parametrize("policy", list(ALL_POLICIES))
def test_verify_is_bit_exact(kind: str, policy: str, tmp_path: Path) -> None:
    """Every policy that applies keeps the gradients bit-equal; the one that does not (``experts`` on a dense
    MLP) is refused in one line."""
    torch.manual_seed(0)
    model = build_source(resolve_source(str(config_json(kind, tmp_path)))).model
    if policy == "experts" and "num_experts_per_tok" not in ZOO[kind]:
        with pytest.raises(ConfigError) as refused:
            verify(model, policy, micro_batch=2, seq_len=16)
        assert "\n" not in str(refused.value) and "experts" in str(refused.value)
        return
    result = verify(model, policy, micro_batch=2, seq_len=16)
    assert result.passed and result.bit_exact, result


def test_attention_refused_by_a_class_is_named(tmp_path: Path) -> None:
    built = build_source(resolve_source(str(config_json("gemma2", tmp_path))), device="meta")
    assert built.model.config._attn_implementation == "eager"
    assert "does not support sdpa" in built.notes[0]


def test_cli_trace_and_verify_run_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(config_json("mixtral", tmp_path))
    assert main(["trace", "--model", path, "--seq-len", "32", "--micro-batch", "2", "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "mixtral" and out["notes"][0].startswith("traced transformers.MixtralForCausalLM")
    assert main(["verify", "--model", path, "--policy", "mlp", "--seq-len", "16"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["verify", "--model", path, "--layers", "1"]) == 2
    assert "resizes presets" in capsys.readouterr().err


def test_layers_scaling_of_a_config(tmp_path: Path) -> None:
    raw = {"model_type": "llama", **SIZE, "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    full, scaled = (trace(str(tmp_path), WL, "block", layers=k) for k in (None, 1))
    assert scaled.scaled and [p.total for p in scaled.layers] == [p.total for p in full.layers]
    assert scaled.parameter_count == full.parameter_count


# --- factories ------------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """A factory model in recompute's convention: ``forward(idx, targets) -> (logits, loss)``, ``vocab`` ids."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, vocab)

    def forward(self, idx: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_factory() -> nn.Module:
    return TinyLM()


def not_a_module() -> int:
    return 3


def test_factory_traces_and_verifies() -> None:
    source = resolve_source(f"{__name__}:tiny_factory")
    result = trace(source, Workload(seq_len=8, micro_batch=2, dtype="fp32", device="cpu"), "block")
    assert result.n_layers == 2 and result.parameter_count == sum(p.numel() for p in TinyLM().parameters())
    assert result.layers[0].components == {"checkpoint": 2 * 8 * 16 * 4}
    model = build_source(source).model
    assert verify(model, "block", seq_len=8).bit_exact


# --- one-line refusals ------------------------------------------------------------------------------------

BAD_CONFIGS = {
    "encoder-only": ({"model_type": "bert", "hidden_size": 64}, "encoder-only"),
    "encoder-decoder": ({"model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
    "multimodal": ({"model_type": "llava", "text_config": {}, "vision_config": {}}, "multimodal"),
    "unknown model_type": ({"model_type": "no_such_model", **SIZE}, "no causal-LM class"),
    "no model_type": (SIZE, "no causal-LM class"),
    "missing fields": ({"model_type": "llama", "vocab_size": 128}, "lacks its hidden size, layer count, head count"),
}


@pytest.mark.parametrize("raw, expected", BAD_CONFIGS.values(), ids=list(BAD_CONFIGS))
def test_bad_config_is_one_line(raw: dict[str, Any], expected: str, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=expected) as e:
        resolve_source(str(tmp_path))
    assert "\n" not in str(e.value)


BAD_FACTORIES = {
    "does not import": ("no_such_package.models:build", "cannot import no_such_package"),
    "no such function": (f"{__name__}:no_such_function", "has no callable 'no_such_function'"),
    "not an nn.Module": (f"{__name__}:not_a_module", "returned int, expected an nn.Module"),
}


@pytest.mark.parametrize("text, expected", BAD_FACTORIES.values(), ids=list(BAD_FACTORIES))
def test_bad_factory_is_one_line(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as e:
        build_source(resolve_source(text))
    assert "\n" not in str(e.value)


def test_unknown_model_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a known model, an existing config.json path or a package.module:factory" in err


def test_applied_policies_reach_every_class(kind: str, tmp_path: Path) -> None:
    model = build_source(ModelSource.from_config(config_json(kind, tmp_path)), device="meta").model
    apply(model, "core_attn")
    assert len(find_layers(model)) == 2
