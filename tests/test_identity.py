"""A plan is about a model, not a file name: the identity (``recompute.core.identity``) of a model however it is
built, and ``apply``, ``verify``, ``train`` and ``bench`` taking a plan for that model and refusing one for another.

The identity hashes what determines the model's shapes: a preset's spec, a transformers config's architecture
fields, a module's parameter shapes and classes. The same config read from a config.json, its folder, a dict,
``AutoConfig`` and the models ``from_config`` and ``from_pretrained`` build must hash alike; a change of width or
depth must not.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from recompute import ConfigError, ModelSpec, Policy
from recompute.checkpointing import _iter_wrapped, applied_policy, apply
from recompute.cli import main
from recompute.core.analytic.table import analytic_table
from recompute.core.identity import ModelId, config_id, spec_id
from recompute.core.plan import plan
from recompute.core.workload import Workload
from recompute.models import build_model
from recompute.models.hf import build_hf_model
from recompute.models.identity import config_identity, model_identity, source_identity
from recompute.models.source import resolve_source
from recompute.trace._profile import profile_key
from tiny import tiny_gpt

QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
"""A tiny Qwen2 config as a hub config.json states it (a hub-style name, dtype and token ids besides)."""
NOT_SHAPES = {"_name_or_path": "Qwen/Qwen2.5-0.5B", "torch_dtype": "bfloat16", "bos_token_id": 1, "use_cache": True}


def hf_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' own checkpointing on or off (``activation_*`` in transformers 5, ``gradient_*`` before)."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    getattr(model, f"{name}_checkpointing_{'enable' if on else 'disable'}")()


def folder(tmp_path: Path, name: str = "qwen05", **changes: Any) -> Path:
    """A folder holding a config.json."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**QWEN2, **NOT_SHAPES, **changes}))
    return path


def from_config(path: Path, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path), **kw)


def plan_file(
    path: Path, identity: ModelId, layers: tuple[str, ...], loss: str = "full", chunk: int | None = None
) -> Path:
    """A plan file in the parts ``apply`` reads (``recompute plan -o`` writes these and more)."""
    data = {
        "format": "recompute.plan/2",
        "model": identity.to_dict(),
        "policy": Policy(layers=layers, model=identity).to_dict(),
        "loss": {"mode": loss, "chunk": chunk},
    }
    path.write_text(json.dumps(data))
    return path


# --- the identity -----------------------------------------------------------------------------------------


def test_one_config_hashes_alike_however_it_is_read_or_built(tmp_path: Path) -> None:
    path = folder(tmp_path)
    saved = tmp_path / "saved"
    from_config(path).save_pretrained(saved)  # config.json of transformers' own (a diff against defaults)
    ids = {
        "config.json": config_identity(path / "config.json"),
        "folder": config_identity(path),
        "dict": config_identity(dict(QWEN2)),
        "AutoConfig": config_identity(transformers.AutoConfig.from_pretrained(path)),
        "source": source_identity(resolve_source(str(path / "config.json"))),
        "from_config": model_identity(from_config(path)),
        "from_config eager bf16": model_identity(from_config(path, attn_implementation="eager", dtype=torch.bfloat16)),
        "from_pretrained": model_identity(transformers.AutoModelForCausalLM.from_pretrained(saved)),
        "saved config.json": config_identity(saved),
    }
    assert len({i.hash for i in ids.values()}) == 1, {k: i.hash for k, i in ids.items()}
    assert len(ids["folder"].hash) == 16
    assert ids["folder"].name == ids["source"].name == "qwen05"  # a file is named by its folder
    assert ids["AutoConfig"].name == str(path) and ids["dict"].name == "qwen2"  # from_pretrained's path; model_type


@pytest.mark.parametrize("change", [{"hidden_size": 128}, {"num_hidden_layers": 3}, {"vocab_size": 512}])
def test_a_change_of_shape_changes_the_hash(tmp_path: Path, change: dict[str, int]) -> None:
    assert config_identity(folder(tmp_path, **change)) != config_identity(folder(tmp_path, "same"))
    assert config_identity(folder(tmp_path, "other", **change)).hash != config_identity(dict(QWEN2)).hash


def test_what_shapes_nothing_is_left_out() -> None:
    base = config_id({**QWEN2, "dtype": None})
    for key, value in [*NOT_SHAPES.items(), ("architectures", ["Qwen2ForCausalLM"]), ("output_hidden_states", True)]:
        assert config_id({**QWEN2, key: value}).hash == base.hash, key
    assert config_id({**QWEN2, "hidden_act": "gelu"}).hash != base.hash  # what the step computes is kept


def test_a_step_without_a_key_value_cache_is_another_model(tmp_path: Path) -> None:
    """Note: [the key/value cache changes a step]: Phi-3 without the cache keeps 2·s·h·e more a layer
    (tests/test_real_step.py), so its plans and profiles are not those of Phi-3 with it. The cache on, as every
    config has it by default, hashes as before: written or not, the hash is the one of a config without the key."""
    base = config_id(QWEN2)
    assert config_id({**QWEN2, "use_cache": True}).hash == base.hash
    assert config_id({**QWEN2, "use_cache": False}).hash != base.hash
    spec = ModelSpec.from_name("gpt2")
    off = dataclasses.replace(spec, kv_cache=False)
    assert spec_id(off).hash != spec_id(spec).hash
    assert spec_id(off).name == "gpt2 with kv_cache=False"
    assert not build_hf_model(off, device="meta").config.use_cache  # transformers' class of it runs without one
    on, without = (resolve_source(str(folder(tmp_path, f"cache-{c}", use_cache=c))) for c in (True, False))
    assert source_identity(on).hash == config_identity(dict(QWEN2)).hash != source_identity(without).hash
    wl = Workload(seq_len=16)
    assert profile_key(on, wl) != profile_key(without, wl)  # the store keeps the two profiles apart
    plan_path = plan_file(tmp_path / "plan.json", source_identity(on), ("block",))
    model = from_config(folder(tmp_path, "no-cache", use_cache=False))
    with pytest.raises(ConfigError, match="make a plan for this model"):
        apply(model, plan_path)


def test_presets_hash_their_spec_and_resized_ones_say_how() -> None:
    spec = ModelSpec.from_name("gpt2")
    assert model_identity(build_model(spec, device="meta")) == spec_id(spec) == source_identity(resolve_source("gpt2"))
    assert spec_id(spec).name == "gpt2"
    assert spec_id(dataclasses.replace(spec, name="renamed", norm_eps=1e-6)).hash == spec_id(spec).hash
    resized = spec.resized(n_layers=4, vocab=256)
    assert spec_id(resized).hash != spec_id(spec).hash
    assert spec_id(resized).name == "gpt2 with n_layers=4, vocab=256"
    hf = source_identity(resolve_source("hf:gpt2"))  # transformers' class of the preset: its config
    assert hf.hash == model_identity(build_hf_model(spec, device="meta")).hash != spec_id(spec).hash


class Factory(nn.Module):
    def __init__(self, hidden: int = 16, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), act()) for _ in range(2))
        self.head = nn.Linear(hidden, 32)


def test_any_other_module_hashes_its_parameter_shapes_and_classes() -> None:
    one = model_identity(Factory())
    with torch.device("meta"):
        assert model_identity(Factory()) == one  # built anywhere
    assert model_identity(Factory(hidden=24)).hash != one.hash
    assert model_identity(Factory(act=nn.ReLU)).hash != one.hash  # no parameter changed, a class did
    assert one.name == "Factory"
    planned = source_identity(resolve_source(f"{__name__}:Factory"))  # what a plan of --model module:factory names
    assert planned == ModelId(f"{__name__}:Factory", one.hash)
    # a module that is recompute's model or transformers' is named by its spec or config, not its parameters
    spec = tiny_gpt()
    assert model_identity(build_model(spec)) == spec_id(spec)


def test_plan_files_older_than_the_hash_are_read_by_name(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model": "gpt2", "policy": {"layers": ["block"] * 12, "model": "gpt2"}}))
    policy = Policy.load(old)
    assert policy.model == ModelId("gpt2", "")
    assert ModelId("gpt2").same_model(ModelId("GPT-2", "0123456789abcdef"))  # no hash on one side: names
    assert not ModelId("a", "0123456789abcdef").same_model(ModelId("a", "fedcba9876543210"))  # hashes decide
    apply(build_model(ModelSpec.from_name("gpt2"), device="meta"), old)
    with pytest.raises(ConfigError, match=r"made for 'gpt2' but this model is 'custom'"):
        apply(build_model(tiny_gpt(n_layers=12), device="meta"), old)


# --- apply ------------------------------------------------------------------------------------------------


def test_a_preset_plan_carries_the_identity_into_its_file(tmp_path: Path) -> None:
    spec = ModelSpec.from_name("gpt2")
    made = plan(analytic_table(spec, Workload(seq_len=1024)), 10 * 2**30)
    assert made.identity == spec_id(spec) and made.policy.model == spec_id(spec)
    data = made.to_dict()
    assert data["model"] == data["policy"]["model"] == {"name": "gpt2", "hash": spec_id(spec).hash}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    model = build_model(spec, device="meta")
    apply(model, path)
    assert applied_policy(model) == made.policy
    apply(model, made)  # the Plan itself
    with pytest.raises(
        ConfigError, match=r"made for 'gpt2' \(\w{8}\) but this model is 'gpt2 with vocab=256' \(\w{8}\)"
    ):
        apply(build_model(spec.resized(vocab=256), device="meta"), path)


def test_a_plan_applies_to_its_model_however_built_and_refuses_another(tmp_path: Path) -> None:
    path = folder(tmp_path)
    plan_path = plan_file(tmp_path / "plan.json", source_identity(resolve_source(str(path))), ("block", "mlp"))
    saved = tmp_path / "saved"
    from_config(path).save_pretrained(saved)
    for built in (from_config(path), transformers.AutoModelForCausalLM.from_pretrained(saved)):
        apply(built, plan_path)
        assert [(type(m).__name__, a) for m, a in _iter_wrapped(built)] == [
            ("Qwen2DecoderLayer", "forward"),
            ("Qwen2MLP", "forward"),
        ]
    other = from_config(folder(tmp_path, "wider", hidden_size=128))
    with pytest.raises(ConfigError) as e:
        apply(other, plan_path)
    message = str(e.value)
    assert "\n" not in message and not list(_iter_wrapped(other))
    short = source_identity(resolve_source(str(path))).short
    assert f"made for 'qwen05' ({short}) but this model is '{tmp_path / 'wider'}' (" in message  # from_pretrained's


def test_apply_takes_the_loss_mode_and_chunk_from_the_plan(tmp_path: Path) -> None:
    path = folder(tmp_path)
    identity = config_identity(path)
    chunked = plan_file(tmp_path / "chunked.json", identity, ("block", "none"), loss="chunked", chunk=16)
    model = from_config(path, attn_implementation="eager")
    signature = inspect.signature(model.forward)
    ids = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids, labels=ids)
    apply(model, chunked)
    assert inspect.signature(model.forward) == signature  # the Trainer's column filter reads it
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None  # the chunked loss ran
    torch.testing.assert_close(out.loss, ref.loss)
    assert model._loss_function.args[2] == 16  # the plan's chunk
    apply(model, chunked, loss="chunked", loss_chunk=16)  # repeating the plan is fine
    with pytest.raises(ConfigError, match=r"^the plan was made with loss='chunked' but apply was given loss='full'"):
        apply(model, chunked, loss="full")
    with pytest.raises(ConfigError, match="made with loss_chunk=16 but apply was given loss_chunk=8"):
        apply(model, chunked, loss_chunk=8)
    assert applied_policy(model) is not None and model(input_ids=ids, labels=ids).logits is None  # unchanged


def test_a_loss_mode_the_model_cannot_take_is_refused(tmp_path: Path) -> None:
    class NoLoss(nn.Module):  # a layer stack and a head, but no loss to chunk
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.lm_head = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
            return self.lm_head(x)

    model = NoLoss()
    path = plan_file(tmp_path / "plan.json", model_identity(model), ("block", "block"), loss="chunked")
    with pytest.raises(ConfigError, match="found no loss in NoLoss"):
        apply(model, path)
    assert not list(_iter_wrapped(model))  # nothing changed


def test_transformers_checkpointing_is_refused_now_and_later(tmp_path: Path) -> None:
    path = folder(tmp_path)
    model = from_config(path).train()
    hf_checkpointing(model, True)
    with pytest.raises(ConfigError, match="transformers' activation \\(gradient\\) checkpointing is on together"):
        apply(model, "block")
    hf_checkpointing(model, False)
    apply(model, "block")
    ids = torch.randint(128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    hf_checkpointing(model, True)  # after apply: refused at the next training forward
    with pytest.raises(ConfigError, match="would replay whole layers on top of it"):
        model(input_ids=ids, labels=ids)
    model.eval()  # transformers checkpoints only in training: evaluation runs
    with torch.no_grad():
        model(input_ids=ids)
    hf_checkpointing(model.train(), False)
    model(input_ids=ids, labels=ids).loss.backward()
    apply(model, "none")  # the guard goes with the policy
    hf_checkpointing(model, True)
    model(input_ids=ids, labels=ids).loss.backward()


# --- the commands -----------------------------------------------------------------------------------------


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_verify_train_and_bench_take_a_plan_for_their_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = folder(tmp_path)
    identity = source_identity(resolve_source(str(path)))
    mine = plan_file(tmp_path / "mine.json", identity, ("block", "attn+mlp"), loss="chunked")
    other = plan_file(
        tmp_path / "other.json", config_identity(folder(tmp_path, "deeper", num_hidden_layers=3)), ("block",) * 2
    )
    small = ["--seq-len", "32", "--micro-batch", "2"]
    assert main(["verify", "--model", str(path / "config.json"), "--policy", str(mine), *small]) == 0
    capsys.readouterr()
    line = refused(capsys, "verify", "--model", str(path), "--policy", str(other), *small)
    assert line.startswith("recompute verify: error: the plan was made for 'deeper' (") and "this model is" in line
    run = ["train", "--model", str(path), "--steps", "2", "--warmup", "1", "--device", "cpu", *small]
    assert main([*run, "--plan", str(mine), "--out", str(tmp_path / "run"), "--checkpoint-every", "2"]) == 0
    assert f"({mine}, chunked loss) for 2 steps" in capsys.readouterr().out  # the plan's loss mode
    line = refused(capsys, *run, "--plan", str(other), "--out", str(tmp_path / "no-run"))
    assert "the plan was made for 'deeper'" in line and not (tmp_path / "no-run").exists()  # before any work
    line = refused(capsys, *run, "--plan", str(mine), "--loss", "full", "--out", str(tmp_path / "no-run"))
    assert "was made with --loss chunked, not full" in line
    bench = ["bench", "--model", str(path), "--policies", "none", "--steps", "1", "--warmup", "0", "--no-time", *small]
    line = refused(capsys, *bench, "--plan", str(other))
    assert "the plan was made for 'deeper'" in line
