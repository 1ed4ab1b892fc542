"""``compare-train``: the same run under several policies from the same seed, side by side.

This is the seed blog's experiment as one command: does recomputation change the losses (it must not), and
what does it do to peak memory and step time?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from recompute.core.errors import ConfigError
from recompute.core.files import atomic_write
from recompute.core.progress import Progress, no_progress
from recompute.core.table import gib, render_table
from recompute.train.config import TrainConfig
from recompute.train.loop import RunResult, train
from recompute.train.run_files import clear_run, holds_run

__all__ = ["CompareRow", "compare_train", "plot_losses", "render_compare"]


@dataclass(frozen=True)
class CompareRow:
    """One policy's run against the ``none`` (or first) run."""

    policy: str
    final_loss: float
    max_loss_diff: float
    """Largest |loss - reference loss| over all steps."""
    tokens_per_s: float
    peak_bytes: int | None
    memory_change: float | None
    """Peak memory change against the reference, as a fraction."""
    time_change: float
    """Median step-time change against the reference, as a fraction."""


def _of_all(progress: Progress, policy: str, i: int, n: int, steps: int) -> Progress:
    """One run's progress as part of all ``n`` runs'."""

    def show(label: str, done: int, total: int) -> None:
        progress(f"{policy} ({i + 1}/{n}): {label}", i * steps + done, n * steps)

    return show


def compare_train(
    config: TrainConfig, policies: Sequence[str], *, progress: Progress = no_progress
) -> tuple[list[CompareRow], list[RunResult]]:
    """Train once per policy (same seed, data and options), each in ``out/<policy>``; compare to the first.

    Raises:
        ConfigError: ``out`` is not empty and ``config.overwrite`` is off (checked before any training), or
            two policies would share a folder.
    """
    out = Path(config.out)
    _check_out(out, policies, overwrite=config.overwrite)
    runs = []
    for i, p in enumerate(policies):
        shown = _of_all(progress, p, i, len(policies), config.steps)
        runs.append(train(config.replace(policy=p, out=str(out / _dirname(p)), resume=False), progress=shown))
    if config.overwrite:  # every new run is in: the earlier comparison's other runs go
        for sub in out.iterdir():
            if sub.is_dir() and sub.name not in {_dirname(p) for p in policies} and holds_run(sub):
                clear_run(sub)
    ref = runs[0]
    rows = []
    for policy, run in zip(policies, runs):
        peak, ref_peak = run.peak_bytes, ref.peak_bytes
        rows.append(
            CompareRow(
                policy=policy,
                final_loss=run.losses[-1],
                max_loss_diff=max(abs(a - b) for a, b in zip(run.losses, ref.losses)),
                tokens_per_s=config.tokens_per_step / run.median_step_time,
                peak_bytes=peak,
                memory_change=(peak / ref_peak - 1) if peak and ref_peak else None,
                time_change=run.median_step_time / ref.median_step_time - 1,
            )
        )
    return rows, runs


def _check_out(out: Path, policies: Sequence[str], *, overwrite: bool) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite``: then each policy's run replaces the one in its folder
    once its first checkpoint is written (``train``), and the runs of other policies go once every new run is
    in (other files stay)."""
    names = [_dirname(p) for p in policies]
    if twins := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"--policies would write two runs into {str(out / twins[0])!r}; give each policy once")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not overwrite:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"--out {str(out)!r} is not empty ({shown}); compare-train writes a run per policy there: "
            "give an empty --out, or --overwrite to delete the runs in it and start over"
        )


def _dirname(policy: str) -> str:
    return Path(policy).stem if policy.endswith(".json") else policy.replace("+", "_")


def render_compare(rows: Sequence[CompareRow]) -> str:
    """The comparison table (memory and time changes against the first row)."""
    pct = lambda x: "-" if x is None else f"{100 * x:+.1f}%"  # noqa: E731
    return render_table(
        ["policy", "final loss", "max |loss diff|", "tokens/s", "peak memory", "memory", "step time"],
        [
            [
                r.policy,
                f"{r.final_loss:.4f}",
                f"{r.max_loss_diff:.2e}",
                f"{r.tokens_per_s:,.0f}",
                gib(r.peak_bytes) if r.peak_bytes else "-",
                pct(r.memory_change),
                pct(r.time_change),
            ]
            for r in rows
        ],
    )


def plot_losses(runs: Sequence[RunResult], path: str | Path) -> None:
    """Loss against step for every run, one line each, as a PNG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = runs[0].spec
    model = f"{spec.name} ({spec.n_layers} layers, h={spec.hidden})" if spec is not None else runs[0].name
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        ax.plot([m.step + 1 for m in run.metrics], run.losses, styles[i % 4], label=run.config.policy, lw=1.6)
    ax.set(
        xlabel="step",
        ylabel="training loss",
        title=f"{model}: loss under each policy, same seed",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        atomic_write(Path(path), lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
