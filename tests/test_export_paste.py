"""Issue 36 item 3: each ``plan --export`` snippet runs as pasted, imports included, against the real library.

Lightning's ``FSDPStrategy`` set of classes needed the classes imported (a NameError when pasted): the snippet now
takes them by name from the model in scope, and Lightning's own ``_setup_activation_checkpointing`` (what
``FSDPStrategy`` runs on the module) wraps what recompute's ``apply`` wraps. Under FSDP the HF export writes
FSDP's own checkpointing (``fsdp_config``), not the ``activation_checkpointing`` argument transformers warns
against, and names the ``RecomputeCallback`` for the exact plan.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from recompute import Workload
from recompute.cli import main
from recompute.core.analytic.table import analytic_tables
from recompute.core.costs import CostTable
from recompute.core.export import STACKS, export

sys.path.insert(0, str(Path(__file__).parent))
from test_export import SPEC, TABLES, WL, _tiny_hf_llama, planned
from tiny import tiny_llama

N = 3
FSDP = Workload(seq_len=4096, micro_batch=1, precision="mixed", dp=8, fsdp=True)


def _named(tables: tuple[CostTable, ...], name: str) -> tuple[CostTable, ...]:
    """The tables with their layer kind named as a profile of the model names it (``_label``)."""
    return tuple(
        dataclasses.replace(t, kinds=tuple(dataclasses.replace(k, name=name) for k in t.kinds)) for t in tables
    )


def _run(text: str, **scope: Any) -> dict[str, Any]:
    """The exported file executed as a pasted script, with ``scope`` defined before it."""
    exec(compile(text, "plan.exported.py", "exec"), scope)
    return scope


def _wrapped(model: Any) -> list[str]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sorted(
        type(m._checkpoint_wrapped_module).__name__ for m in model.modules() if isinstance(m, CheckpointWrapper)
    )


def _models() -> dict[str, Any]:
    """A tiny transformers Llama and a tiny recompute Llama, each with its layers' regions by option."""
    from recompute.checkpointing import _sub_block
    from recompute.models import build_model

    out = {}
    for name, build, layers in (
        ("transformers", lambda: _tiny_hf_llama(N), lambda m: m.model.layers),
        ("recompute", lambda: build_model(tiny_llama(N)), lambda m: m.layers),
    ):
        layer = layers(build())[0]
        attn, mlp = _sub_block(layer, "attn", None, None), _sub_block(layer, "mlp", None, None)
        regions = {"block": [layer], "attn": [attn], "mlp": [mlp], "attn+mlp": [attn, mlp]}
        out[name] = (build, layer, {k: sorted([type(m).__name__ for m in v] * N) for k, v in regions.items()})
    return out


@pytest.mark.parametrize("source", ["transformers", "recompute"])
def test_lightning_export_runs_as_pasted(source: str) -> None:
    """Every Lightning setting, executed with only ``model`` defined, builds Lightning's FSDPStrategy, which wraps
    the modules recompute's ``apply`` wraps for that option on every layer."""
    pytest.importorskip("lightning")
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from lightning.pytorch.strategies import FSDPStrategy

    from recompute.trace._kinds import _label

    build, layer, regions = _models()[source]
    tables = _named(analytic_tables(dataclasses.replace(SPEC, n_layers=N), WL), _label(layer, None))
    for s in STACKS["lightning"].settings(tables[0]):
        out = export(planned(tables, s.layers), tables, "lightning")
        model = build()
        strategy = _run(out.text, model=model)["strategy"]
        assert isinstance(strategy, FSDPStrategy)
        _setup_activation_checkpointing(model, strategy._activation_checkpointing_kwargs)
        assert _wrapped(model) == regions.get(s.layers[0], []), (source, s.label)


def test_lightning_export_names_what_the_model_lacks() -> None:
    """Class names the model has none of (the placeholders of an analytic table) stop the script in one line."""
    pytest.importorskip("lightning")
    s = STACKS["lightning"].settings(TABLES[0])[1]
    text = export(planned(TABLES, s.layers), TABLES, "lightning").text
    with pytest.raises(ValueError, match=r"no module of class \['DecoderLayer'\]"):
        _run(text, model=_tiny_hf_llama(N))


def test_hf_export_under_fsdp_uses_fsdp_checkpointing(caplog: pytest.LogCaptureFixture) -> None:
    """With --fsdp, the HF export's settings are FSDP's own checkpointing in fsdp_config, all layers or none; run as
    pasted, TrainingArguments hands it to accelerate's FSDP plugin and does not warn (it warns for the
    activation_checkpointing argument under FSDP: a redundant all-gather in the backward)."""
    transformers = pytest.importorskip("transformers")
    tables = analytic_tables(dataclasses.replace(SPEC, n_layers=N), FSDP)
    settings = STACKS["hf"].settings(tables[0])
    assert [s.layers for s in settings] == [("none",) * N, ("block",) * N]
    logger = transformers.utils.logging.get_logger("transformers.training_args")
    for s in settings:
        out = export(planned(tables, s.layers), tables, "hf")
        assert out.exact and "RecomputeCallback" in out.text
        logger.addHandler(caplog.handler)
        try:
            args = _run(out.text.replace('output_dir="out"', 'output_dir="out", report_to=[]'))["args"]
        finally:
            logger.removeHandler(caplog.handler)
        assert args.fsdp and not args.activation_checkpointing
        assert args.fsdp_plugin_args["activation_checkpointing"] is (s.layers[0] == "block")
        assert "activation_checkpointing" not in caplog.text


def test_hf_export_names_the_callback_and_its_lines_run() -> None:
    """The exact line of the HF export is the Trainer's callback; its import and construction run as written."""
    pytest.importorskip("transformers")
    out = export(planned(TABLES, ("mlp",) * TABLES[0].n), TABLES, "hf", plan_file="plan.json")
    code = [line[4:] for line in out.text.splitlines() if line.startswith(("#   from ", "#   trainer ="))]
    assert code[0] == "from recompute.integrations.hf import RecomputeCallback"
    assert code[1].endswith('callbacks=[RecomputeCallback("plan.json")])')
    compile("\n".join(code), "exact", "exec")
    assert _run(code[0])["RecomputeCallback"].__name__ == "RecomputeCallback"


def test_cli_fsdp_hf_export_file_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``recompute plan --fsdp --export hf``: the file written beside the plan runs as it is."""
    pytest.importorskip("transformers")
    args = ["plan", "--model", "llama3.1-8b", "--seq-len", "8192", "--dp", "8", "--fsdp", "--precision", "mixed"]
    args += ["--analytic", "--cost", "flops", "--budget", "40GiB", "-o", str(tmp_path / "plan.json"), "--export", "hf"]
    assert main(args) == 0
    capsys.readouterr()
    text = (tmp_path / "plan.hf.py").read_text()
    assert "activation_checkpointing=" not in text.replace("fsdp_config", "")
    scope = _run(text.replace('output_dir="out"', f"output_dir={str(tmp_path)!r}, report_to=[]"))
    assert scope["args"].fsdp_config["activation_checkpointing"] is True
