"""Korthikanti et al. 2022's four configurations, predicted: per-layer times and end-to-end iteration times.

The paper (arXiv 2205.05198) runs GPT models of 22B, 175B, 530B and 1T parameters on A100 80GB GPUs (Selene:
8 GPUs per node on NVLink/NVSwitch, eight 200 Gb/s HDR adapters per node), t = 8, s = 2048, v = 51200, mixed
precision, Megatron's attention (the s^2 softmax stored: ``--attention eager``), dropout; Table 3 gives p, the
global and micro batch (no data parallelism), Sec. 6 the interleaved schedule of 3 chunks for 175B and 530B.
Table 4 times one transformer layer of the 22B model (forward, backward) with no recomputation, sequence
parallelism, full recomputation, selective recomputation and selective + sequence parallelism; Figure 8 gives
the same breakdown for all four as a chart (its numbers are not in the text: only the overheads it quotes, 2 %
against 36 % for 530B and 1T); Table 5 the iteration times with full recomputation and with selective + SP.

This script predicts all of it with recompute's time model on the A100 80GB datasheet row (``--gpu
a100-80gb``: kernels of rank 0's traced step on the roofline, collectives on NVLink by NCCL's model, the
pipeline laid out by ``recompute.core.pricing``) and writes benchmarks/results/paper_time.json.

    python benchmarks/paper_time.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from recompute import ModelSpec, Workload
from recompute.core.pricing import Job, choose_device, phase_seconds, step_time
from recompute.trace import cached_works

# Table 3: (model, t, p, interleave, global batch, micro batch); Sec. 6: interleaving of 3 for 175B and 530B.
CONFIGS = [
    ("22b", 8, 1, 1, 4, 4),
    ("175b", 8, 8, 3, 64, 1),
    ("530b", 8, 35, 3, 280, 1),
    ("1t", 8, 64, 1, 512, 1),
]
# Table 4 (22B, one layer; ms): forward, backward.
PAPER_LAYER_22B = {
    "no recompute": (7.7, 11.9),
    "sequence parallelism": (7.2, 11.8),
    "full recompute": (7.7, 19.5),
    "selective recompute": (7.7, 13.2),
    "selective + sequence": (7.2, 13.1),
}
# Table 5: iteration time (s) with full recomputation and with selective + SP (present work); MFU of the latter.
PAPER_ITERATION = {
    "22b": (1.42, 1.10, 0.415),
    "175b": (18.13, 13.75, 0.514),
    "530b": (49.05, 37.83, 0.560),
    "1t": (94.42, 71.49, 0.563),
}
# Figure 8's text: the recompute overhead of 530B and 1T, full and present work.
PAPER_OVERHEAD_530B_1T = {"full recompute": 0.36, "selective + sequence": 0.02}
EXPERIMENTS = {  # name: (policy, sequence parallelism)
    "no recompute": ("none", False),
    "sequence parallelism": ("none", True),
    "full recompute": ("block", False),
    "selective recompute": ("core_attn", False),
    "selective + sequence": ("core_attn", True),
}
A100_PEAK = 312e12


def model_flops(spec: ModelSpec, batch: int, s: int) -> float:
    """Model FLOPs of one iteration (Korthikanti et al. Appendix A): 72 B s L h^2 (1 + s/(6h) + V/(12 h L))."""
    h, L, v = spec.hidden, spec.n_layers, spec.vocab
    return 72 * batch * s * L * h * h * (1 + s / (6 * h) + v / (12 * h * L))


def predict(name: str, t: int, p: int, v: int, batch: int, b: int, gpu: str) -> dict[str, object]:
    spec = ModelSpec.from_name(name)
    device = choose_device(gpu=gpu)
    base = Workload(
        micro_batch=b, seq_len=2048, dtype="fp16", attention="eager", tp=t, pp=p, interleave=v,
        n_microbatches=batch // b,
    )  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for experiment, (policy, sp) in EXPERIMENTS.items():
        wl = dataclasses.replace(base, sp=sp)
        works = cached_works(spec, wl, ["none", policy])
        job = Job.of(spec, wl)
        phases = phase_seconds(works[policy], device, job, base=works["none"])
        step = step_time(works[policy], device, job, base=works["none"])
        out[experiment] = {
            "forward_ms": 1e3 * phases["forward of layer 1"],
            "backward_ms": 1e3 * phases["backward of layer 1"],
            "iteration_s": step.step,
            "mfu": model_flops(spec, batch, 2048) / (step.step * t * p * A100_PEAK),
        }
    full, present = out["full recompute"]["iteration_s"], out["selective + sequence"]["iteration_s"]
    return {
        "model": name,
        "t": t,
        "p": p,
        "interleave": v,
        "global_batch": batch,
        "micro_batch": b,
        "experiments": out,
        "throughput_increase": full / present - 1,
        "paper": {
            "iteration_full_s": PAPER_ITERATION[name][0],
            "iteration_present_s": PAPER_ITERATION[name][1],
            "throughput_increase": PAPER_ITERATION[name][0] / PAPER_ITERATION[name][1] - 1,
            "mfu_present": PAPER_ITERATION[name][2],
        },
    }


def render(results: list[dict]) -> str:
    lines = ["Per layer (ms), predicted (paper's Table 4 for 22B in brackets):", ""]
    lines.append("| model | experiment | forward | backward | combined | overhead |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        exps = r["experiments"]
        plain = exps["no recompute"]["forward_ms"] + exps["no recompute"]["backward_ms"]
        for name, e in exps.items():
            f, bwd = e["forward_ms"], e["backward_ms"]
            cells = [f"{f:.1f}", f"{bwd:.1f}", f"{f + bwd:.1f}", f"{100 * ((f + bwd) / plain - 1):+.0f} %"]
            if r["model"] == "22b":
                pf, pb = PAPER_LAYER_22B[name]
                paper_over = 100 * ((pf + pb) / sum(PAPER_LAYER_22B["no recompute"]) - 1)
                cells = [
                    f"{f:.1f} ({pf})",
                    f"{bwd:.1f} ({pb})",
                    f"{f + bwd:.1f} ({pf + pb:.1f})",
                    f"{100 * ((f + bwd) / plain - 1):+.0f} % ({paper_over:+.0f} %)",
                ]
            lines.append(f"| {r['model']} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "End to end, predicted (paper's Table 5 in brackets):", ""]
    head = ["model", "t, p, interleave", "micro-batches", "full recompute (s)", "selective + SP (s)"]
    lines.append("| " + " | ".join([*head, "throughput increase", "MFU (selective + SP)"]) + " |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        e, paper = r["experiments"], r["paper"]
        lines.append(
            f"| {r['model']} | {r['t']}, {r['p']}, {r['interleave']} | {r['global_batch'] // r['micro_batch']} | "
            f"{e['full recompute']['iteration_s']:.2f} ({paper['iteration_full_s']}) | "
            f"{e['selective + sequence']['iteration_s']:.2f} ({paper['iteration_present_s']}) | "
            f"{100 * r['throughput_increase']:+.1f} % ({100 * paper['throughput_increase']:+.1f} %) | "
            f"{100 * e['selective + sequence']['mfu']:.1f} % ({100 * paper['mfu_present']:.1f} %) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="a100-80gb")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "paper_time.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    for config in CONFIGS:
        results.append(predict(*config, gpu=args.gpu))
        print(f"{config[0]}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print(render(results))
    Path(args.out).write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "gpu": args.gpu,
                "paper": "Korthikanti et al. 2022, arXiv 2205.05198, Tables 3-5",
                "paper_overhead_530b_1t": PAPER_OVERHEAD_530B_1T,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
