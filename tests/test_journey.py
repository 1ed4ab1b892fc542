"""Issue 36: what a new user trips on between the README and a run (the install, the outputs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def test_a_chunked_llama_gives_its_logits_wherever_they_are_asked_for(tmp_path: Path) -> None:
    """``recompute.apply(..., loss="chunked")`` on a transformers Llama: the training forward drops the logits (the
    memory saving); eval mode and ``no_grad`` return the plain model's, and a real Trainer's ``evaluate`` (with
    ``compute_metrics``) and ``predict`` equal a run without recompute (issue 36 item 1)."""
    import copy

    import torch

    import recompute

    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(ref)
    recompute.apply(model, "block", loss="chunked", loss_chunk=16)
    ids = torch.randint(256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids)
        model.train()
        got = model(input_ids=ids, labels=ids)  # train mode, autograd off
    torch.testing.assert_close(got.logits, want.logits)
    model.eval()
    got = model(input_ids=ids, labels=ids)  # eval mode, autograd on
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    model.train()
    assert model(input_ids=ids, labels=ids).logits is None  # the training forward keeps the saving

    def accuracy(pred: Any) -> dict[str, float]:
        logits, labels = pred.predictions, pred.label_ids
        return {"accuracy": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}

    rows = ids.tolist() * 2
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    runs = {}
    for name, net in (("ref", ref), ("chunked", model)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_eval_batch_size=2, use_cpu=True, report_to=[]
        )
        trainer = transformers.Trainer(model=net, args=args, eval_dataset=data, compute_metrics=accuracy)
        metrics, predicted = trainer.evaluate(), trainer.predict(data)
        assert predicted.predictions.shape == (4, 24, 256)
        runs[name] = (metrics, torch.as_tensor(predicted.predictions))
    assert runs["chunked"][0]["eval_accuracy"] == runs["ref"][0]["eval_accuracy"]
    assert runs["chunked"][0]["eval_loss"] == pytest.approx(runs["ref"][0]["eval_loss"], rel=1e-6)
    torch.testing.assert_close(runs["chunked"][1], runs["ref"][1])


def _cold_config(tmp_path: Path, vocab: int) -> str:
    """A tiny Llama no other test profiles (its own vocabulary): its profile is measured, never the store's."""
    config = tmp_path / f"cold-{vocab}.json"
    config.write_text(json.dumps(LLAMA | {"vocab_size": vocab}))
    return str(config)


SMALL_STEP = {"seq_len": 16, "micro_batch": 1, "dtype": "fp32", "device": "cpu", "cost": "flops"}


@pytest.mark.slow
def test_the_python_api_reports_progress_to_a_callback(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``recompute.plan`` was silent for the minutes of a cold profile, where the command line shows a bar: a
    callback receives every step, from the command line's progress machinery, and nothing is printed."""
    import recompute

    steps: list[tuple[str, int, int]] = []
    capfd.readouterr()
    config = _cold_config(tmp_path, 264)
    recompute.plan(config, "1GiB", consider=(), progress=lambda *step: steps.append(step), **SMALL_STEP)
    assert steps and all(isinstance(label, str) and 0 <= done <= total for label, done, total in steps), steps
    assert steps[-1][1] == steps[-1][2]  # the last step says it is done
    assert capfd.readouterr().err == ""


@pytest.mark.slow
def test_the_python_api_is_silent_off_a_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default (``"auto"``) progress shows only when stderr is a terminal (the command line's bar);
    ``progress=True`` shows it in a log too, as the command line's plain lines."""
    import inspect

    import recompute
    from recompute.core.progress import no_progress
    from recompute.progress import shown_progress

    assert inspect.signature(recompute.plan).parameters["progress"].default == "auto"
    assert inspect.signature(recompute.profile).parameters["progress"].default == "auto"
    with shown_progress("plan", "auto") as show:
        assert show is no_progress  # pytest's stderr is no terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with shown_progress("plan", "auto") as show:
        assert show is not no_progress
    monkeypatch.undo()
    capfd.readouterr()
    recompute.profile(_cold_config(tmp_path, 272), 16, dtype="fp32", device="cpu", progress=True)
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("profile: ") for line in lines), lines


@pytest.mark.parametrize("progress", ["yes", 1.5, None])
def test_a_bad_progress_argument_is_refused_in_one_line(progress: Any) -> None:
    import recompute

    with pytest.raises(recompute.ConfigError, match=r"progress must be a callback .* True, False or 'auto'"):
        recompute.plan("gpt2", "3GiB", seq_len=256, cost="flops", progress=progress)
