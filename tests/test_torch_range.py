"""The torch range (``recompute.core.torch_range``, ``recompute._compat``): what is outside it is refused in one
line before any work, what recompute needs from a torch inside it is checked, and no error inside a fake step
can abort the process (issue 34: a C++ ``terminate`` with no message on every torch but 2.13)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from recompute import ConfigError
from recompute.cli import main
from recompute.core import torch_range
from recompute.core.torch_range import NEWEST, OLDEST, installed_torch, require_supported_torch, torch_release
from recompute.trace._flops import flop_counter
from recompute.trace._tracker import StepTracker

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["2.4.1", "2.5.0+cu121", "2.14.0", "2.14.0.dev20260101+cpu", "3.0.0", "junk"])
def test_a_torch_outside_the_range_is_refused_in_one_line(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOMPUTE_ANY_TORCH", raising=False)
    with pytest.raises(ConfigError) as e:
        require_supported_torch(version)
    line = str(e.value)
    assert "\n" not in line and f"torch {version}" in line and "torch 2.6 to 2.13" in line
    assert "pip install 'torch>=2.6,<2.14'" in line
    monkeypatch.setenv("RECOMPUTE_ANY_TORCH", "1")
    require_supported_torch(version)  # the user's own risk


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.8.0", "2.10.0+cu128", "2.12.1", "2.13.0+cpu"])
def test_a_torch_inside_the_range_is_taken(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RECOMPUTE_ANY_TORCH", raising=False)
    require_supported_torch(version)
    require_supported_torch(None)  # no torch at all: the torch-free commands still run


def test_the_version_read_without_torch_is_the_one_imported() -> None:
    code = "import sys; from recompute.core.torch_range import installed_torch as v; print(v(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [torch.__version__, "False"]
    assert installed_torch() == torch.__version__ and torch_release(torch.__version__) is not None
    assert OLDEST <= torch_release(torch.__version__) <= NEWEST  # type: ignore[operator]


def test_pyproject_and_ci_take_the_oldest_release_verified() -> None:
    """pyproject.toml's floor is OLDEST, and CI runs the fast tests under it (scripts/check-oldest-torch)."""
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    ci = re.search(r"^TORCH=(\d+)\.(\d+)\.\d+ ", (ROOT / "scripts" / "check-oldest-torch").read_text(), re.M)
    assert floor is not None and ci is not None
    assert tuple(map(int, floor.groups())) == tuple(map(int, ci.groups())) == OLDEST


@pytest.mark.parametrize(
    "argv", [["estimate", "--model", "gpt2"], ["trace", "--seq-len", "64"], ["plan", "--budget", "1GiB", "-o", "{out}"]]
)
def test_the_cli_refuses_it_before_any_work(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("RECOMPUTE_ANY_TORCH", raising=False)
    monkeypatch.setattr(torch_range, "installed_torch", lambda: "2.4.1")
    monkeypatch.setattr("recompute.cli.installed_torch", lambda: "2.4.1")
    out = tmp_path / "plan.json"
    assert main([a.format(out=out) for a in argv]) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"recompute {argv[0]}: error: recompute supports torch 2.6 to 2.13, and this environment has")
    assert not out.exists()


def test_the_api_refuses_it_with_a_config_error() -> None:
    """``recompute.apply`` (the torch library) on a torch outside the range: a ConfigError naming it, no work."""
    code = textwrap.dedent(
        """
        import torch
        torch.__version__ = "2.4.1"
        import recompute
        try:
            recompute.apply
        except recompute.ConfigError as e:
            print("ConfigError:", e)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(
        "ConfigError: recompute supports torch 2.6 to 2.13, and this environment has torch 2.4.1"
    )


def test_a_tracker_without_what_it_needs_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(MemTracker, "_update_and_maybe_create_winfos")
    expected = rf"needs torch's MemTracker._update_and_maybe_create_winfos, which torch {re.escape(torch.__version__)} "
    with pytest.raises(ConfigError, match=expected + "does not have; recompute supports torch 2.6 to 2.13"):
        StepTracker([])


def test_an_error_in_a_device_query_is_a_python_error_not_an_abort() -> None:
    """The autograd engine asks each gradient's ``.device`` from C++ that cannot pass an exception on; an error
    the tracker raises there must come out of ``backward`` as a Python exception (issue 34's abort)."""
    code = textwrap.dedent(
        """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from recompute.trace._tracker import StepTracker

        DEVICE = torch.ops.prim.device.default

        class Faulty(StepTracker):
            querying = False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.querying = func is DEVICE
                return super().__torch_dispatch__(func, types, args, kwargs)

            def _update_peak_stats(self, state):
                if self.querying and self.stage == "backward":
                    raise RuntimeError("an error in a device query")
                super()._update_peak_stats(state)

        with FakeTensorMode():
            layer = torch.nn.Linear(8, 8)
            x = torch.randn(4, 8)
            tracker = Faulty([layer])
            try:
                with tracker:
                    tracker.set_stage("forward")
                    loss = layer(x).square().sum()
                    tracker.set_stage("backward")
                    loss.backward()
            except RuntimeError as e:
                print("raised:", e)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert run.returncode == 0 and "terminate called" not in run.stderr, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip() == "raised: an error in a device query"


B, H, S, D = 2, 8, 32, 16
"""Batch, query heads, sequence, head size of the attention below (2 key/value heads: 4 query heads each)."""
BMM = 2 * B * H * S * S * D
"""FLOPs of one (b*h, s, d) x (b*h, d, s) batched matmul (2 FLOPs per multiply-add)."""


def _attention(kernel: str) -> None:
    """SDPA's ``kernel``, forward and backward, on meta tensors with grouped-query shapes (the CUDA kernels' own
    shape rules run; nothing is computed)."""
    aten = torch.ops.aten
    q = torch.empty(B, H, S, D, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(B, 2, S, D, device="meta", dtype=torch.bfloat16)
    if kernel == "flash":
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
        aten._scaled_dot_product_flash_attention_backward(
            out, q, kv, kv, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset
        )
    else:
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, kv, kv, None, True)
        aten._scaled_dot_product_efficient_attention_backward(
            out, q, kv, kv, None, out, lse, seed, offset, 0.0, [True] * 4
        )


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_grouped_query_attention_flops_are_counted_on_every_torch(kernel: str) -> None:
    """torch <= 2.11's FlopCounterMode raised on these shapes (issue 34, a bench of a transformers Llama on CUDA);
    ``flop_counter`` counts what 2.13's does: the forward's QK^T and PV over every query head, and the backward's
    five matmuls (the scores recomputed, then the gradients of both products)."""
    with flop_counter() as counter:
        _attention(kernel)
    assert counter.get_total_flops() == (2 + 5) * BMM
    if torch_release(torch.__version__) >= (2, 13):  # type: ignore[operator]
        with FlopCounterMode(display=False) as theirs:
            _attention(kernel)
        assert theirs.get_total_flops() == counter.get_total_flops()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
