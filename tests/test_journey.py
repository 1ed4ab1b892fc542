"""Issue 36: what a new user trips on between the README and a run (the install, the outputs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    "call",
    [
        "main(['plan', '--model', CONFIG, '--seq-len', '64', '--budget', '1GiB'])",
        "main(['estimate', '--model', CONFIG, '--seq-len', '64'])",
        "main(['trace', '--model', CONFIG, '--seq-len', '64'])",
        "recompute.plan(CONFIG, '1GiB', seq_len=64)",
    ],
    ids=["plan", "estimate", "trace", "api plan"],
)
def test_a_config_without_transformers_names_the_extra(call: str, tmp_path: Path) -> None:
    """After the README's install line (no ``[hf]`` extra), a config.json ended in a ModuleNotFoundError traceback."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # as if it were not installed
        "import recompute; from recompute.cli import main\n"
        f"CONFIG = {str(config)!r}\n"
        "try:\n"
        f"    rc = {call}\n"
        "except recompute.ConfigError as e:\n"
        "    print(f'error: {e}', file=sys.stderr); rc = 2\n"
        "sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "needs the transformers package" in lines[0] and "pip install 'recompute[hf]'" in lines[0]


def test_results_print_in_one_short_line() -> None:
    """``print(plan)`` ran to 94,319 characters (every frontier point, ``held=-30009985024.0`` inside); each result
    now prints one line with its headline figures, the whole of it behind ``to_dict()``."""
    import recompute
    from recompute.core.policy import Policy

    plan = recompute.plan("llama3.1-8b", "70GiB", seq_len=8192, precision="distributed", dp=8)
    shown = {
        "plan": repr(plan),
        "policy": repr(plan.policy),
        "estimate": repr(recompute.estimate("llama3.1-8b", 4096, "block")),
        "every": repr(Policy("block", every=2)),
    }
    assert all(len(text) < 200 and "\n" not in text for text in shown.values()), shown
    assert shown["plan"].startswith("Plan('llama3.1-8b', b=1 s=8192: ") and " of 70.00 GiB, +" in shown["plan"]
    assert shown["every"] == "Policy(name='block', every=2)"
    assert len(plan.to_dict()["frontier"]) == len(plan.frontier) > 1


def test_a_dense_model_is_not_told_that_experts_do_not_apply(tmp_path: Path) -> None:
    """Every dense profile said 'note: experts does not apply ...': notes only where they say something."""
    from recompute.core.workload import Workload
    from recompute.models.source import ModelSource
    from recompute.trace import profile

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    notes = profile(ModelSource.from_config(str(config)), Workload(seq_len=16, device="cpu", dtype="fp32")).notes
    assert not any("experts does not apply" in n for n in notes), notes


def test_a_cpu_step_is_planned_in_flops_without_offload(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--device cpu`` plan was priced on an H100's datasheet row and offered offload."""
    import recompute
    from recompute.cli import main
    from recompute.core.pricing import CPU_IN_FLOPS

    assert main(["plan", "--model", "gpt2", "--seq-len", "256", "--device", "cpu", "--budget", "3GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cost_kind"] == "FLOPs" and CPU_IN_FLOPS in data["notes"]
    assert not any("offload" in p["layers"] for p in data["frontier"]) and "offload" not in data["uniform"]
    plan = recompute.plan("gpt2", "3GiB", seq_len=256, device="cpu")
    assert plan.cost_kind == "FLOPs" and CPU_IN_FLOPS in plan.notes


def test_nothing_fits_reads_as_one_sentence() -> None:
    """The report's answer read "Nothing fits. no plan fits 40.0 GiB: ...": the planner's own reason, capitalised,
    is the sentence; a reason that does not say it is why nothing fits."""
    import recompute
    from recompute.core.errors import ConfigError
    from recompute.report.answer import answer_data, answer_html

    with pytest.raises(ConfigError) as refused:
        recompute.plan("llama3.1-8b", "40GiB", seq_len=8192, precision="distributed", dp=8, consider=())
    reason = str(refused.value)
    assert reason.startswith("no plan fits 40.0"), reason
    shown = {}
    for said in (reason, "the budget is below the model states"):
        page = answer_html(answer_data(None, budget=40 * 2**30, gpu="H100", usable=80e9, command="c", refusal=said))
        shown[said] = page.split("<p class='verdict'>")[1].split("</p>")[0]
    assert shown[reason].startswith("No plan fits 40.") and "Nothing fits" not in shown[reason]
    assert shown[reason].endswith(".") and not shown[reason].endswith("..")
    assert shown["the budget is below the model states"] == "Nothing fits: the budget is below the model states."
