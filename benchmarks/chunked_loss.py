"""Chunked cross-entropy against the plain loss: the loss phase's peak memory and the step time, on this CPU.

The model is the last part of a Llama: its final norm (the one "layer", so that ``recompute.apply`` finds a
layer list), the output layer and the loss, with Llama 3's 128256-token vocabulary and a hidden size that a
CPU runs (64 by default); its input is the (b, s, h) hidden state, as the last transformer layer gives it.
``recompute.apply(model, "none", loss="chunked")`` is the chunked variant (default chunk: 512 tokens).

Memory of one forward + backward, the bytes allocated at the peak beyond what exists before it (weights,
AdamW state, the batch), three ways:

- ``trace``: the step on fake tensors under ``StepTracker`` (``recompute.trace.trace_module``), the larger of
  its head-and-loss phase peaks (forward and backward);
- ``tracked``: the same tracker on real tensors (what ``recompute bench`` measures on a CPU);
- ``rss``: the process's resident-memory high-water mark (Linux's ``VmHWM``) over its resident size before
  the step, each variant in a fresh process (what the operating system saw, allocator included).

Time: forward + backward of the two variants alternately (ABBA) after a warm-up; the figure is the median over
back-to-back pairs of chunked / full. Targets: the loss phase's peak cut at least 4x, the step at most 5 %
slower. Prints the figures and writes ``benchmarks/results/chunked_loss.json``; exits with 1 when a target is
missed.

    python benchmarks/chunked_loss.py                      # h=64, v=128256, s=4096, b=1
    python benchmarks/chunked_loss.py --hidden 256 --loss-chunk 1024
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

import recompute
from recompute.core.workload import default_loss_chunk
from recompute.models.core import cross_entropy
from recompute.trace import TraceResult, trace_module
from recompute.trace._build import fakeify

__all__ = ["LlamaHead", "main"]

OUT = Path(__file__).parent / "results" / "chunked_loss.json"
TARGETS = {"peak_cut": 4.0, "time_ratio": 1.05}
HEAD_PHASES = ("forward: head and loss", "backward: head and loss")


class LlamaHead(nn.Module):
    """Llama's final RMSNorm, output layer and cross-entropy: ``forward(x, targets) -> (logits, loss)``."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.RMSNorm(hidden)])  # the final norm, as the one layer apply looks for
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.loss_fn: Callable[..., Tensor] = cross_entropy
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def forward(self, x: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.lm_head(self.layers[0](x))  # (b, s, v)
        return logits, None if targets is None else self.loss_fn(logits, targets)


def build(args: argparse.Namespace, loss: str, device: str = "cpu") -> LlamaHead:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaHead(args.hidden, args.vocab)
    if loss == "chunked":
        recompute.apply(model, "none", loss="chunked", loss_chunk=args.loss_chunk)
    return model


def batch(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.micro_batch, args.seq_len, args.hidden, generator=g)
    return x, torch.randint(args.vocab, (args.micro_batch, args.seq_len), generator=g)


def head_peak(r: TraceResult) -> int:
    """Bytes at the larger head-and-loss phase peak beyond the step's resident ones (weights, AdamW, batch)."""
    return max(r.phases[p] for p in HEAD_PHASES) - (r.parameters + r.optimizer + r.other)


def traced(args: argparse.Namespace, loss: str) -> TraceResult:
    """The step on fake tensors: nothing allocated."""
    model = build(args, loss, device="meta")
    mode = FakeTensorMode()
    fakeify(model, mode)
    with mode:
        x = torch.empty(args.micro_batch, args.seq_len, args.hidden)
        targets = torch.zeros(args.micro_batch, args.seq_len, dtype=torch.long)
        return trace_module(model, (x, targets), name=f"llama head ({loss})")


def tracked(args: argparse.Namespace, loss: str) -> TraceResult:
    """The step on real tensors under the same tracker (``recompute bench``'s CPU measurement)."""
    return trace_module(build(args, loss), batch(args), name=f"llama head ({loss})")


def rss_child(args: argparse.Namespace) -> dict[str, int]:
    """In a fresh process: one forward + backward; the high-water mark of the resident size over it before.

    Linux's ``VmHWM``, not ``ru_maxrss``: the latter carries over the parent's peak through fork and exec.
    """
    model, (x, targets) = build(args, args.rss_child), batch(args)
    before = _status("VmRSS")
    _, loss = model(x, targets)
    loss.backward()
    return {"rss_before": before, "rss_peak": _status("VmHWM")}


def _status(key: str) -> int:
    """A size from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status (this measurement needs Linux)")


def rss(args: argparse.Namespace, loss: str) -> int:
    argv = [sys.executable, __file__, "--rss-child", loss, *_size_argv(args)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.splitlines()[-1])
    return int(r["rss_peak"] - r["rss_before"])


def _size_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--hidden", str(args.hidden), "--vocab", str(args.vocab), "--seq-len", str(args.seq_len)]
    argv += ["--micro-batch", str(args.micro_batch), "--threads", str(args.threads)]
    return argv + (["--loss-chunk", str(args.loss_chunk)] if args.loss_chunk else [])


def timings(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Forward + backward times of the full and the chunked model, alternately (ABBA), after a warm-up."""
    full = build(args, "full")
    chunked = copy.deepcopy(full)
    recompute.apply(chunked, "none", loss="chunked", loss_chunk=args.loss_chunk)
    x, targets = batch(args)

    def step(model: nn.Module) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(x, targets)[1].backward()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step(full), step(chunked)
    times: dict[str, list[float]] = {"full": [], "chunked": []}
    for r in range(args.reps):
        order = (("full", full), ("chunked", chunked)) if r % 2 == 0 else (("chunked", chunked), ("full", full))
        for name, model in order:
            times[name].append(step(model))
    return times["full"], times["chunked"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    chunk = args.loss_chunk or min(default_loss_chunk(args.vocab), args.micro_batch * args.seq_len)
    memory = {}
    for loss in ("full", "chunked"):
        memory[loss] = {
            "trace": head_peak(traced(args, loss)),
            "tracked": head_peak(tracked(args, loss)),
            "rss": rss(args, loss),
        }
    full_t, chunked_t = timings(args)
    # Note: [paired ratio] as benchmarks/apply_overhead.py: the median of back-to-back ratios cancels drift.
    ratio = statistics.median(c / f for c, f in zip(chunked_t, full_t))
    cuts = {k: memory["full"][k] / memory["chunked"][k] for k in memory["full"]}
    return {
        "what": "llama head (final RMSNorm, output layer, cross-entropy): loss-phase peak and forward+backward time",
        "hidden": args.hidden,
        "vocab": args.vocab,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "loss_chunk": chunk,
        "peak_bytes": memory,
        "peak_cut": cuts,
        "median_full_s": statistics.median(full_t),
        "median_chunked_s": statistics.median(chunked_t),
        "time_ratio": ratio,
        "ratio_of_medians": statistics.median(chunked_t) / statistics.median(full_t),
        "targets": TARGETS,
        "peak_target_met": min(cuts.values()) >= TARGETS["peak_cut"],
        "time_target_met": ratio <= TARGETS["time_ratio"],
        "reps": args.reps,
        "warmup": args.warmup,
        "times_full_s": full_t,
        "times_chunked_s": chunked_t,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def render(r: dict[str, Any]) -> str:
    mib = 2**20
    rows = [
        f"{how:8s} {r['peak_bytes']['full'][how] / mib:10,.1f} {r['peak_bytes']['chunked'][how] / mib:12,.1f} "
        f"{r['peak_cut'][how]:8.2f}x"
        for how in ("trace", "tracked", "rss")
    ]
    return "\n".join(
        [
            f"chunked loss: llama head h={r['hidden']} v={r['vocab']}, b={r['micro_batch']} s={r['seq_len']}, "
            f"{r['loss_chunk']} tokens per chunk; CPU x{r['threads']} threads, torch {r['torch']}",
            "loss-phase peak    full MiB  chunked MiB      cut",
            *rows,
            f"forward+backward: full {r['median_full_s'] * 1e3:,.0f} ms, chunked {r['median_chunked_s'] * 1e3:,.0f} ms "
            f"(medians of {r['reps']}); chunked / full: median of paired ratios {r['time_ratio']:.3f} "
            f"(ratio of medians {r['ratio_of_medians']:.3f})",
            f"targets: peak cut >= {r['targets']['peak_cut']:g}x {'met' if r['peak_target_met'] else 'NOT met'}; "
            f"time <= {r['targets']['time_ratio']:g}x {'met' if r['time_target_met'] else 'NOT met'}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64, a size a CPU runs)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary (default: Llama 3's 128256)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--loss-chunk", type=int, help="tokens per chunk (default: recompute's, 512 for 128256)")
    p.add_argument("--reps", type=int, default=10, help="timed steps of each variant (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed pairs first (default: 2)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads (default: all)")
    p.add_argument("--rss-child", choices=("full", "chunked"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=OUT, help=f"JSON output (default: {OUT})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rss_child:
        print(json.dumps(rss_child(args)))
        return 0
    result = run(args)
    print(render(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["peak_target_met"] and result["time_target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
