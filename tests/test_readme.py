"""README.md opens with the two commands a newcomer runs, and CI runs the second as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_readme_opens_with_setup_and_test_commands() -> None:
    main_job, tests = readme_commands()
    assert main_job.startswith("python -m pip install torch==2.13.0 ") and "recompute " in main_job
    assert tests == "bash scripts/install-test-deps && bash scripts/check"
    assert "torch==2.13.0" in (ROOT / "scripts" / "install-test-deps").read_text()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    _, tests = readme_commands()
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()
