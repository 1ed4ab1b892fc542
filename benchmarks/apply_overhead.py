"""Overhead of ``recompute.apply(model, "block")`` against a hand-written loop of ``torch.utils.checkpoint``.

Both variants run the same model (same weights, same batch) and recompute the same layers; they differ only
in how the checkpoint is put in place: ``apply`` wraps each layer's ``forward`` in place, the hand-written
loop calls ``checkpoint(layer, x, use_reentrant=False)`` in a copy of the model's forward. Steps alternate
between the two (ABBA order) after a warm-up; the target is a median step-time ratio (over back-to-back pairs) of
at most 1.03. Prints the figures and writes them to ``benchmarks/results/apply_overhead.json``.

    python benchmarks/apply_overhead.py                      # GPT-2 small shape, 4 layers, CPU
    python benchmarks/apply_overhead.py --model llama3.1-8b --layers 2 --hidden 1024 --heads 16 --vocab 8192

Exits with 1 when the ratio is above the target.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import recompute
from recompute import ModelSpec
from recompute.models import build_model
from recompute.models.llama import rope_tables

__all__ = ["handwritten_loss", "interleave", "main"]

TARGET = 1.03
OUT = Path(__file__).parent / "results" / "apply_overhead.json"

Step = Callable[[], float]


def handwritten_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
    """recompute's GPT/Llama forward, written out with a checkpoint around every layer (the baseline)."""
    s = idx.size(1)
    if model.spec.position == "learned":
        x = model.drop(model.tok_emb(idx) + model.pos_emb(torch.arange(s, device=idx.device)))
        extra: tuple[Tensor, ...] = ()
    else:
        x = model.drop(model.tok_emb(idx))
        extra = rope_tables(s, model.spec.head_dim, model.spec.rope_theta, device=idx.device, dtype=x.dtype)
    for layer in model.layers:
        x = checkpoint(layer, x, *extra, use_reentrant=False)
    logits = model.lm_head(model.norm(x))
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def timed_step(model: nn.Module, loss_fn: Callable[[], Tensor]) -> Step:
    def run() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn().backward()
        return time.perf_counter() - start

    return run


def interleave(a: Step, b: Step, *, reps: int, warmup: int) -> tuple[list[float], list[float]]:
    """Run ``a`` and ``b`` alternately (ABBA ...), ``warmup`` untimed pairs first; the times of each."""
    for _ in range(warmup):
        a(), b()
    times_a, times_b = [], []
    for r in range(reps):
        if r % 2 == 0:
            times_a.append(a())
            times_b.append(b())
        else:
            times_b.append(b())
            times_a.append(a())
    return times_a, times_b


def build_pair(spec: ModelSpec, *, attention: str, seq_len: int, micro_batch: int) -> tuple[Step, Step, bool]:
    """The two timed steps, on identical models and one batch, and whether their gradients agree exactly."""
    torch.manual_seed(0)
    applied = build_model(spec, attention=attention).train()
    manual = copy.deepcopy(applied)
    recompute.apply(applied, "block")
    gen = torch.Generator().manual_seed(0)
    idx, targets = torch.randint(spec.vocab, (2, micro_batch, seq_len), generator=gen)
    step_a = timed_step(applied, lambda: applied(idx, targets)[1])
    step_b = timed_step(manual, lambda: handwritten_loss(manual, idx, targets))
    torch.manual_seed(1)
    step_a()
    torch.manual_seed(1)
    step_b()
    same = all(torch.equal(p.grad, q.grad) for p, q in zip(applied.parameters(), manual.parameters()))
    return step_a, step_b, same


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {k: v for k, v in dict(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads).items() if v}
    if args.vocab:
        overrides["vocab"] = args.vocab
    if "hidden" in overrides:
        overrides.update(d_ff=0, head_dim=0)
    spec = ModelSpec.from_name(args.model, dropout=args.dropout, **overrides)
    step_a, step_b, same = build_pair(
        spec, attention=args.attention, seq_len=args.seq_len, micro_batch=args.micro_batch
    )
    times_a, times_b = interleave(step_a, step_b, reps=args.reps, warmup=args.warmup)
    # Note: [paired ratio] each A/B pair runs back to back, so the median of the per-pair ratios cancels the
    # slow drifts of a shared machine that the ratio of the two medians still carries; both are reported.
    ratio = statistics.median(a / b for a, b in zip(times_a, times_b))
    return {
        "what": "median over back-to-back pairs of step time apply(model, 'block') / hand-written checkpoint loop",
        "model": args.model,
        "spec": spec.to_dict(),
        "attention": args.attention,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "reps": args.reps,
        "warmup": args.warmup,
        "median_apply_s": statistics.median(times_a),
        "median_handwritten_s": statistics.median(times_b),
        "ratio": ratio,
        "ratio_of_medians": statistics.median(times_a) / statistics.median(times_b),
        "target": TARGET,
        "passed": ratio <= TARGET,
        "gradients_identical": same,
        "times_apply_s": times_a,
        "times_handwritten_s": times_b,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def render(r: dict[str, Any]) -> str:
    spec = r["spec"]
    return "\n".join(
        [
            f"apply overhead: {r['model']} ({spec['n_layers']} layers, h={spec['hidden']}, dropout {spec['dropout']}), "
            f"b={r['micro_batch']} s={r['seq_len']}, {r['attention']} attention, CPU x{r['threads']} threads, "
            f"torch {r['torch']}",
            f"{r['reps']} interleaved steps each after {r['warmup']} warm-up pairs",
            f"median step  apply(model, 'block'): {r['median_apply_s'] * 1e3:8.1f} ms",
            f"median step  hand-written loop:     {r['median_handwritten_s'] * 1e3:8.1f} ms",
            f"median of paired ratios {r['ratio']:.4f} (ratio of medians {r['ratio_of_medians']:.4f}); "
            f"target <= {r['target']}: {'met' if r['passed'] else 'NOT met'}",
            f"gradients identical: {r['gradients_identical']}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="gpt2", help="preset name (default: gpt2)")
    p.add_argument("--layers", type=int, default=4, help="layers to keep (default: 4)")
    p.add_argument("--hidden", type=int, help="override the width")
    p.add_argument("--heads", type=int, help="override the head count")
    p.add_argument("--vocab", type=int, help="override the vocabulary")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout (default: 0.1, replayed by both)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--attention", choices=("eager", "flash"), default="eager")
    p.add_argument("--reps", type=int, default=30, help="timed steps of each variant (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed pairs first (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1, steadier on a shared machine)")
    p.add_argument("--out", type=Path, default=OUT, help=f"JSON output (default: {OUT})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args)
    print(render(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["passed"] and result["gradients_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
