"""``benchmarks/gpu_truth.py --device cpu --tiny``: the GPU check's own code, on tiny shapes on the CPU.

The script is run as a user runs it (a subprocess); its one JSON must describe the device and software, hold every
case of the script, and every row it measured must be within 1 % of the peak bench predicted for it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_truth.py"
sys.path.insert(0, str(SCRIPT.parent))

from gpu_truth import CASES  # noqa: E402  (benchmarks/ is not a package)

ROW = {"policy", "loss", "peak", "predicted_peak", "peak_error", "reserved", "predicted_reserved", "step_s"}


def test_the_tiny_run_holds_every_prediction_within_one_percent(tmp_path: Path) -> None:
    out = tmp_path / "truth.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "tiny" and data["device"].startswith("cpu") and data["driver"] is None
    assert {"torch", "cuda", "transformers", "wall_s"} <= data.keys()
    assert [c["case"] for c in data["cases"]] == [c.label for c in CASES]
    has_hf = importlib.util.find_spec("transformers") is not None
    for case, made in zip(data["cases"], CASES):
        expected = "ran" if made.model == "gpt2" or (has_hf and not made.plan) else "skipped"
        assert case["status"] == expected, case
        if case["status"] != "ran":
            continue
        assert f"{case['case']}: ran in {case['seconds']:.1f} s" in done.stdout
        assert len(case["rows"]) == (1 if made.plan else len(made.policies_run(True)) * len(made.losses_run(True)))
        for row in case["rows"]:
            assert row.keys() >= ROW and row["reserved"] is None  # no caching allocator on the CPU
            assert abs(row["predicted_peak"] / row["peak"] - 1) < 0.01, (case["case"], row)
        if made.plan:
            plan = case["plan"]
            assert case["rows"][0]["policy"] == plan["policy"] and plan["planned_peak"] <= plan["budget"]


def test_bad_arguments_are_one_line_before_any_case(capsys: Any, tmp_path: Path) -> None:
    from gpu_truth import main

    for argv, says in [
        (["--only", "nonsense"], "gpu_truth: --only names no case nonsense; the cases: "),
        (["--budget-s", "-5"], "gpu_truth: --budget-s must be a positive number of seconds, got -5"),
    ]:
        assert main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "x.json"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(says) and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()
