"""Issue 38: the last tracebacks and silent answers, each one line and exit 2 before any work (or answered right).

A config.json's sizes are checked by one function for the analytic model and transformers' class alike; a plan
file (hand-edited, damaged) by one schema check shared by the CLI, ``apply`` and the Trainer callback; a profile's
cache is not read for a workload a profile cannot measure; aliases count as the policy they name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import recompute
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.core.plan_file import check_plan_dict
from recompute.core.policy import Policy, distinct_policies
from test_reliability_inputs import refused

SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--steps", "1", "--no-time"]
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert (
        main(["plan", "--model", "gpt2", "--seq-len", "256", "--budget", "3GiB", "--cost", "flops", "-o", str(path)])
        == 0
    )
    data: dict[str, Any] = json.loads(path.read_text())
    return data


DAMAGE = {
    "budget a string": ("budget", "abc", "budget must be a positive finite number, got 'abc'"),
    "budget zero": ("budget", 0, "budget must be a positive finite number, got 0"),
    "seq_len 1e30": ("workload", {"seq_len": 1e30}, "workload: seq_len must be a positive integer"),
    "unknown workload key": ("workload", {"seq_length": 4}, "workload: unknown workload fields ['seq_length']"),
    "loss mode": ("loss", {"mode": "partial"}, "loss must be a map with mode ('full', 'chunked')"),
    "loss chunk": ("loss", {"mode": "chunked", "chunk": -3}, "loss chunk must be a positive whole number, got -3"),
    "frontier": ("frontier", "x", "frontier must be a list of plan points, got 'x'"),
    "predicted peak": ("predicted", {"peak": -1, "cost": 0, "overhead": 0}, "predicted's peak must be a non-negative"),
    "model": ("model", "gpt2", "model must be a {name, hash} map, got 'gpt2'"),
}


def _damaged(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(data))
    out[key] = {**out[key], **value} if key == "workload" else value
    return out


@pytest.mark.parametrize(("key", "value", "says"), list(DAMAGE.values()), ids=list(DAMAGE))
def test_a_damaged_plan_is_refused_by_every_reader(
    plan_data: dict[str, Any], key: str, value: Any, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The schema check's line, from the CLI (bench --plan), from ``apply`` of the dict and from the Trainer
    callback's construction (a budget of "abc" failed at the first training step)."""
    from recompute.integrations.hf import RecomputeCallback
    from recompute.models import build_model
    from tiny import tiny_gpt

    bad = _damaged(plan_data, key, value)
    with pytest.raises(ConfigError, match=r"^the plan's "):
        check_plan_dict(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    line = refused(capsys, "bench", "--plan", str(path), *SMALL)
    assert line.startswith(f"recompute bench: error: plan file '{path}': the plan's ") and says in line, line
    with pytest.raises(ConfigError, match="the plan's"):
        recompute.apply(build_model(tiny_gpt()), bad)
    with pytest.raises(ConfigError, match="the plan's"):
        RecomputeCallback(bad)


def test_an_intact_plan_passes_the_schema(plan_data: dict[str, Any]) -> None:
    check_plan_dict(plan_data)
    check_plan_dict({"name": "block"})  # a policy file: Policy.from_dict's to check


def test_a_config_size_of_the_wrong_type_is_one_line_in_the_analytic_model_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``"hidden_size": "4096"`` was a TypeError in the analytic model's arithmetic; the builder refused it."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": "64"}))
    says = "the llama config's hidden_size must be a whole number from 1 to 1,048,576, got '64'; fix the config.json"
    assert refused(capsys, "estimate", "--model", str(path), "--analytic", "--no-time").endswith(says)
    assert refused(capsys, "trace", "--model", str(path), "--seq-len", "16").endswith(says)


@pytest.mark.parametrize("consider", ["offload", 5, ["offload", 3]])
def test_plan_consider_must_be_a_list_of_names(consider: Any) -> None:
    with pytest.raises(ConfigError, match="consider must be a list of offload and chunked"):
        recompute.plan("gpt2", "3GiB", seq_len=512, consider=consider)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"gpu": 5}, "gpu must be a GPU's name, got 5"),  # was an AttributeError ('int' has no attribute 'strip')
        ({"compiled": "no"}, "compiled must be True or False, got 'no'"),  # was taken as true
        ({"trace": "yes"}, "trace must be True or False, got 'yes'"),
    ],
    ids=["gpu a number", "compiled a string", "trace a string"],
)
def test_plan_options_of_the_wrong_type_are_refused(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=f"^{says}$"):
        recompute.plan("gpt2", "3GiB", seq_len=512, **options)


def test_plan_consider_none_is_the_default_set() -> None:
    """``consider=None`` was a TypeError (not iterable); it means what leaving it out means: offload and chunked."""
    assert recompute.plan("gpt2", "3GiB", seq_len=512, cost="flops", consider=None) == recompute.plan(
        "gpt2", "3GiB", seq_len=512, cost="flops"
    )


def test_a_profile_of_a_pipeline_is_refused_with_a_warm_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store's key holds no parallel sizes: the warm cache answered ``--pp 2`` with the one-device profile."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    assert main(["profile", "--model", str(path), "--seq-len", "16", "--no-time"]) == 0
    capsys.readouterr()
    line = refused(capsys, "profile", "--model", str(path), "--seq-len", "16", "--pp", "2", "--no-time")
    assert "a profile measures one device's step (or one FSDP rank's, with --fsdp); drop --pp 2 (recompute" in line


@pytest.mark.parametrize(
    ("policies", "says"),
    [
        ("full,block", "--policies names 'full' and 'block', one policy (block); give each once"),
        ("selective,core_attn", "--policies names 'selective' and 'core_attn', one policy (core_attn)"),
    ],
)
def test_aliases_count_as_the_policy_they_name(policies: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``compare-train --policies full,block`` ran block twice and reported it against itself."""
    assert says in refused(capsys, "bench", "--policies", policies, *SMALL)
    assert says in refused(capsys, "compare-train", "--policies", policies, "--steps", "1", "--layers", "1")
    with pytest.raises(ConfigError, match="one policy"):
        distinct_policies("--policies", policies.split(","))


def test_first_zero_is_not_a_policy_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """``full:first=0`` recomputed nothing under block's name."""
    with pytest.raises(ConfigError, match=r"first=0 recomputes nothing: use the policy none"):
        Policy.parse("full:first=0")
    assert "first must be a positive number of layers" in refused(capsys, "bench", "--policies", "none,full:first=0")


def test_questionable_inputs_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.core.hardware import datasheet_device

    assert refused(capsys, "validate", "--seq-lens", "").endswith(
        "--seq-lens '' names no length; give e.g. 512,1024, or drop it"
    )
    says = "--capacity-factor 4 sizes the experts' load; gpt2 is dense (no experts): drop --capacity-factor"
    assert refused(capsys, "estimate", "--model", "gpt2", "--capacity-factor", "4", "--no-time").endswith(says)
    datasheet_device("h100-80gb").save(tmp_path / "h100.json")
    line = refused(
        capsys, "estimate", "--model", "gpt2", "--gpu", "a100-80gb", "--device-profile", str(tmp_path / "h100.json")
    )
    assert "--gpu a100-80gb and --device-profile" in line and "name two devices; give one of them" in line


def test_refusals_name_only_the_flags_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--pp 2`` alone was told "drop --tp, --pp and --dp"; ``--every`` alone "--every/--first apply to ..."."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    line = refused(capsys, "plan", "--model", str(path), "--seq-len", "16", "--tp", "2", "--budget", "1GiB")
    assert line.endswith(
        "a profile measures one device's step; drop --tp 2 (recompute estimate --analytic models them)"
    )
    line = refused(capsys, "bench", "--model", str(path), "--seq-len", "16", "--steps", "1", "--no-time", "--dp", "2")
    assert line.endswith(
        f"--dp 2 bench recompute's reference GPT/Llama (recompute.parallel), not {path}; drop --dp 2, or bench a preset"
    )
    small = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--no-time"]
    line = refused(capsys, "bench", *small, "--steps", "2", "--rounds", "2", "--dp", "2")
    assert line.endswith("--rounds is the one-process bench's; drop it under --dp 2")
    line = refused(capsys, "estimate", "--model", "gpt2", "--no-time", "--policy", "block:every=2", "--every", "3")
    assert line.endswith(
        "--every applies to a plain policy name, not to 'block:every=2'; drop --every or give the layers in the "
        "name (NAME:every=K)"
    )


def test_a_policy_file_without_its_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``{"every": 2}`` (hand-written) was read as block every second layer: the name's default."""
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"every": 2}))
    line = refused(capsys, "estimate", "--model", "gpt2", "--no-time", "--policy", str(path))
    assert line.endswith(
        "a policy states its name (none, core_attn, attn, mlp, attn+mlp, block, experts, offload) or one per layer "
        "(layers); got only the keys ['every']"
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"budget": "abc"}, "the plan's budget must be a positive finite number, got 'abc'"),
        ({"policy": {"name": "block", "layers": "blockblock"}}, "a policy's layers must be a list of names"),
        ({"policy": {"name": "block", "save_ops": 5}}, "a policy's save_ops must be a list of names, got 5"),
        ({"policy": {"name": "block", "offload": "yes"}}, "a policy's offload must be true or false, got 'yes'"),
    ],
    ids=["budget", "layers a string", "save_ops a number", "offload a string"],
)
def test_a_damaged_plan_passed_as_a_policy_is_refused(
    plan_data: dict[str, Any], change: dict[str, Any], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``estimate --policy plan.json`` read the policy alone: a budget of "abc" passed, layers "blockblock" were
    read letter by letter ("'b' is not a policy") and an offload of "yes" was taken as true."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan_data, **change}))
    line = refused(capsys, "estimate", "--model", "gpt2", "--no-time", "--policy", str(path))
    assert line.startswith(f"recompute estimate: error: policy file '{path}': ") and says in line, line
