"""ModelSpec, presets and Workload: published sizes, derived fields, HF configs, validation."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from recompute import ConfigError, ModelSpec, Policy, Workload
from recompute.core.analytic import bytes_per_param, model_states, n_params
from recompute.core.identity import ModelId
from recompute.core.presets import PRESETS

# Published parameter counts (memory-and-flops.md section 3; Korthikanti Table 3 sizes are nominal).
PUBLISHED = {
    "gpt2": (124.44e6, 0.001),
    "gpt2-medium": (354.82e6, 0.001),
    "gpt2-large": (774.03e6, 0.001),
    "gpt2-xl": (1557.6e6, 0.001),
    "llama3.1-8b": (8.03e9, 0.001),
    "llama3.1-70b": (70.55e9, 0.001),
    "llama3.1-405b": (405.85e9, 0.001),
    "gpt3-175b": (174.6e9, 0.001),
    "22b": (22e9, 0.01),
    "175b": (175e9, 0.01),
    "530b": (530e9, 0.01),
    "1t": (1e12, 0.01),
}


def test_every_preset_has_a_published_size() -> None:
    assert set(PUBLISHED) == set(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS), ids=list(PRESETS))
def test_preset_parameter_count_matches_published(name: str) -> None:
    expected, rel = PUBLISHED[name]
    assert n_params(ModelSpec.from_name(name)) == pytest.approx(expected, rel=rel)


def test_exact_counts_of_reference_models() -> None:
    assert n_params(ModelSpec.from_name("gpt2")) == 124_439_808  # nanoGPT's count, wpe included
    assert n_params(ModelSpec.from_name("llama3.1-8b")) == 8_030_261_248


@pytest.mark.parametrize("name", list(PRESETS), ids=list(PRESETS))
def test_presets_name_their_source(name: str) -> None:
    spec = ModelSpec.from_name(name)
    assert spec.source and spec.name == name


def test_derived_fields() -> None:
    gpt = ModelSpec.from_name("gpt2")
    assert (gpt.head_dim, gpt.n_kv_heads, gpt.d_ff) == (64, 12, 3072)
    llama = ModelSpec.from_name("llama3.1-70b")
    assert (llama.head_dim, llama.n_kv_heads, llama.d_ff, llama.kv_dim) == (128, 8, 28672, 1024)
    # Llama's rule for an unspecified SwiGLU width: 2/3 of 4h rounded up to 256.
    assert ModelSpec(hidden=4096, n_heads=32, mlp="swiglu").d_ff == 11008


def test_overrides() -> None:
    spec = ModelSpec.from_name("gpt2", n_layers=2, dropout=0.0)
    assert (spec.n_layers, spec.dropout, spec.hidden) == (2, 0.0, 768)


def _gpt2_hf_dict() -> dict[str, object]:
    return {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "vocab_size": 50257,
        "n_positions": 1024,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }


def _llama_hf_dict() -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }


@pytest.mark.parametrize(
    ("raw", "preset", "mlp"),
    [(_gpt2_hf_dict(), "gpt2", "gelu_new"), (_llama_hf_dict(), "llama3.1-8b", "swiglu")],
    ids=["gpt2", "llama"],
)
def test_from_hf_config_dict_and_file(raw: dict[str, object], preset: str, mlp: str, tmp_path) -> None:
    """The preset's shape; transformers' GPT-2 writes its tanh GELU out in ops (``gelu_new``)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    for source in (raw, path, tmp_path):
        spec = ModelSpec.from_hf_config(source)
        assert n_params(spec) == n_params(ModelSpec.from_name(preset))
        assert (spec.mlp, spec.norm, spec.position) == (
            mlp,
            ModelSpec.from_name(preset).norm,
            ModelSpec.from_name(preset).position,
        )


def test_from_hf_config_object() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**{k: v for k, v in _llama_hf_dict().items() if k != "model_type"})
    assert n_params(ModelSpec.from_hf_config(cfg)) == 8_030_261_248


def test_precision_modes() -> None:
    assert sum(bytes_per_param("fp32").values()) == 16
    assert sum(bytes_per_param("mixed").values()) == 18
    assert sum(bytes_per_param("distributed", dp=8).values()) == 6 + 12 / 8
    assert sum(bytes_per_param("bf16").values()) == 8
    spec = ModelSpec.from_name("llama3.1-8b")
    assert model_states(spec, Workload()).total == 18 * 8_030_261_248
    assert model_states(spec, Workload(dtype="fp32")).total == 16 * 8_030_261_248


def test_states_are_sharded_by_tensor_and_pipeline_parallelism() -> None:
    spec = ModelSpec.from_name("175b")
    whole = model_states(spec, Workload()).params
    # 8-way TP and 8-way PP: about 1/64 of the model, plus the first stage's embedding share.
    shard = model_states(spec, Workload(tp=8, pp=8)).params
    assert whole / 64 < shard < whole / 64 * 1.1


BAD_SPECS = {
    "zero hidden": dict(hidden=0),
    "negative layers": dict(n_layers=-1),
    "heads do not divide hidden": dict(n_heads=5),
    "kv heads do not divide heads": dict(n_kv_heads=5),
    "zero vocab": dict(vocab=0),
    "dropout >= 1": dict(dropout=1.5),
    "unknown mlp": dict(mlp="relu"),
    "unknown norm": dict(norm="batchnorm"),
    "float layers": dict(n_layers=2.5),
}


@pytest.mark.parametrize("kwargs", list(BAD_SPECS.values()), ids=list(BAD_SPECS))
def test_bad_specs_raise_one_line_value_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError) as info:
        ModelSpec(**kwargs)
    assert isinstance(info.value, ConfigError) and "\n" not in str(info.value)


BAD_WORKLOADS = {
    "zero seq len": dict(seq_len=0),
    "negative micro-batch": dict(micro_batch=-1),
    "unknown dtype": dict(dtype="int8"),
    "unknown precision": dict(precision="fp8"),
    "unknown attention": dict(attention="magic"),
    "sp with seq not divisible by tp": dict(tp=8, sp=True, seq_len=1001),
    "interleave without pipeline": dict(interleave=2),
    "zero tp": dict(tp=0),
}


@pytest.mark.parametrize("kwargs", list(BAD_WORKLOADS.values()), ids=list(BAD_WORKLOADS))
def test_bad_workloads_raise_one_line_value_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError) as info:
        Workload(**kwargs)
    assert "\n" not in str(info.value)


BAD_PAIRS = {
    "tp does not divide heads": ("gpt2", dict(tp=5, seq_len=1024), "query heads"),
    "tp does not divide kv heads": ("llama3.1-8b", dict(tp=16), "key/value heads"),
    "pipeline deeper than the model": ("gpt2", dict(pp=13, seq_len=1024), "larger than the 12 layers"),
    "sequence beyond positions": ("gpt2", dict(seq_len=2048), "exceeds"),
    "interleave does not split layers": ("gpt2", dict(pp=2, interleave=5, seq_len=1024), "equal chunks"),
}


@pytest.mark.parametrize(("model", "kwargs", "words"), list(BAD_PAIRS.values()), ids=list(BAD_PAIRS))
def test_workloads_that_do_not_fit_the_model(model: str, kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Workload(**kwargs).check(ModelSpec.from_name(model))


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known models: gpt2, gpt2-medium"):
        ModelSpec.from_name("gpt5")


@pytest.mark.parametrize(
    "kwargs",
    [dict(name="sometimes"), dict(every=0), dict(every=2, first=3), dict(layers=("block", "bogus")), dict(first=-1)],
    ids=["unknown name", "every 0", "every and first", "unknown layer policy", "negative first"],
)
def test_bad_policies(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Policy(**kwargs)


def test_policy_layer_selection_and_json_round_trip(tmp_path) -> None:
    assert Policy("block", every=2).per_layer(5) == ("block", "none", "block", "none", "block")
    assert Policy("attn", first=2).per_layer(4) == ("attn", "attn", "none", "none")
    plan = Policy(layers=("block", "core_attn", "none"), model="gpt2")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Policy.parse(str(path)) == plan and Policy.parse(str(path)).model == ModelId("gpt2")
    with pytest.raises(ValueError, match="lists 3 layers but the model has 12"):
        plan.per_layer(12)


@pytest.mark.parametrize(
    ("config_class", "says"),
    [
        ("DeepseekV3Config", "model_type 'deepseek_v3' is not modelled by recompute's analytic model"),
        ("FalconConfig", "model_type 'falcon' is not modelled"),
        ("T5Config", "is not a decoder-only language model"),
    ],
)
def test_configs_it_cannot_model_exactly_are_refused(config_class: str, says: str, tmp_path) -> None:
    """No silent proxy: a config of another architecture is refused, not estimated as a dense Llama/GPT-2."""
    transformers = pytest.importorskip("transformers")
    raw = getattr(transformers, config_class)().to_dict()
    with pytest.raises(ConfigError, match=re.escape(says)):
        ModelSpec.from_hf_config(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    # --analytic: without it estimate profiles the real class (on fake tensors, for any device), no proxy either
    done = subprocess.run(
        [sys.executable, "-m", "recompute", "estimate", "--analytic", "--model", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_llama_config_with_experts_is_refused() -> None:
    raw = {**_llama_hf_dict(), "num_local_experts": 8}
    with pytest.raises(ConfigError, match=r"'llama' with mixture-of-experts layers .*recompute profile"):
        ModelSpec.from_hf_config(raw)
