"""How long a full-size MoE profile takes and how much memory it needs, and how fast a plan from it is.

Issue 13's targets: profiling a Qwen3-30B-A3B shape (48 MoE layers, 128 experts, top-8) at s = 4096 in under
30 s with under 2 GB resident on this CPU; a plan from the cached profile in under 0.5 s, process start
included. The profile runs in a child process (its peak resident set is that process's ``ru_maxrss``); the
plan runs as the console command with ``--profile``, N times, and must not import torch.

    python benchmarks/profile_speed.py [--seq-len 4096] [--runs 5]

Writes benchmarks/results/profile_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recompute.core.profile import Profile
from recompute.core.search import smallest_peak

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

CHILD = """
import json, resource, sys, time
from recompute import Workload
from recompute.trace import profile
from recompute.models.source import ModelSource
config, seq_len, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
start = time.perf_counter()
result = profile(ModelSource.from_config(config), Workload(seq_len=seq_len, micro_batch=1, dtype="bf16", device="cpu"))
seconds = time.perf_counter() - start
result.save(out)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
steps = sum(len(t) * len(next(iter(t.values()))) for t in result.links.values()) + len(result.last)
print(json.dumps({"seconds": seconds, "max_rss_bytes": rss, "kinds": len(result.kinds), "steps": steps}))
"""

PLAN = (
    "import sys; from recompute.cli import main; rc = main(['plan', *sys.argv[1:]]); "
    "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    config, saved = folder / "config.json", folder / "profile.json"
    config.write_text(json.dumps(QWEN3_30B_A3B))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(config), str(args.seq_len), str(saved)],
        capture_output=True,
        text=True,
        check=True,
    )
    prof = json.loads(child.stdout.strip().splitlines()[-1])
    loaded = Profile.load(saved)
    none = loaded.cost_table().compose(["none"] * loaded.n_layers).peak
    budget = (none + int(smallest_peak(loaded.cost_table()))) // 2  # between the extremes: a plan with work to do
    times, imported = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", PLAN, "--profile", str(saved), "--budget", str(budget), "--json"],
            capture_output=True,
            text=True,
        )
        times.append(time.perf_counter() - start)
        imported.append(done.stderr.strip().splitlines()[-1] == "True" if done.stderr.strip() else None)
        plan_rc = done.returncode
    result = {
        "model": "Qwen3-30B-A3B shape (qwen3_moe, 48 layers, 128 experts, top-8)",
        "workload": {"seq_len": args.seq_len, "micro_batch": 1, "dtype": "bf16", "device": "cpu"},
        "profile": prof,
        "plan": {
            "budget_bytes": budget,
            "median_s": statistics.median(times),
            "max_s": max(times),
            "runs": args.runs,
            "rc": plan_rc,
        },
        "plan_imported_torch": any(bool(x) for x in imported),
        "targets": {"profile_s": 30, "profile_rss_bytes": 2e9, "plan_s": 0.5},
        "machine": platform.platform(),
        "python": platform.python_version(),
        "command": f"python benchmarks/profile_speed.py --seq-len {args.seq_len} --runs {args.runs}",
    }
    out = Path(__file__).parent / "results" / "profile_speed.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"profile: {prof['seconds']:.1f} s, {prof['max_rss_bytes'] / 2**30:.2f} GiB resident, {prof['steps']} short "
        f"steps (targets 30 s, 2 GB); plan from the profile: median {result['plan']['median_s']:.2f} s "
        f"(max {result['plan']['max_s']:.2f} s, target 0.5 s), torch imported: {result['plan_imported_torch']}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
