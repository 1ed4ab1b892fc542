"""How long profiling a full-size model takes, before and after issue 24's changes, side by side in one run; how
much memory it needs, and how fast a plan from the profile is.

Targets (issue 24, item 3): a dense Llama-3.1-8B-shaped config.json at s = 4096 in under 20 s and the
Qwen3-30B-A3B MoE shape in under 30 s on this CPU (issue 13: under 2 GB resident); a plan from the cached
profile in under 0.5 s, process start included, without importing torch. Each profile runs in a child process
(its seconds, CPU seconds and peak resident set are that process's), alternating the code before (``--before``,
a git revision of this repository, exported to a temporary folder) and after (this tree), with the load
average noted around each run: the machine is shared, so the CPU seconds are the steadier figure. After: the
8B shape is also profiled for both loss modes in one pass (``recompute.trace.profiles``) and for a CUDA
step on this CPU-only machine (``--device cuda``: fake CPU tensors under CUDA's rules).

    python benchmarks/profile_speed.py [--seq-len 4096] [--runs 5] [--before 9f6a878]

Writes benchmarks/results/profile_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from recompute.core.profile import Profile
from recompute.core.search import smallest_peak

ROOT = Path(__file__).resolve().parent.parent

LLAMA31_8B = {  # meta-llama/Llama-3.1-8B config.json
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

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

MODELS = {
    "llama3.1-8b": ("Llama-3.1-8B shape (llama, 32 layers, h 4096, GQA 32/8)", LLAMA31_8B, 20),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B shape (qwen3_moe, 48 layers, 128 experts, top-8)", QWEN3_30B_A3B, 30),
}

CHILD = """
import json, resource, sys, time
from recompute import Workload
from recompute.models.source import ModelSource
import recompute.trace as trace
config, seq_len, out, device, losses = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
source = ModelSource.from_config(config)
wl = Workload(seq_len=seq_len, micro_batch=1, dtype="bf16", device=device)
start, cpu = time.perf_counter(), time.process_time()
if losses == "one":
    result = trace.profile(source, wl)
else:
    result = trace.profiles(source, wl, ("full", "chunked"))["full"]
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
result.save(out)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "max_rss_bytes": rss, "kinds": len(result.kinds)}))
"""

PLAN = (
    "import sys; from recompute.cli import main; rc = main(['plan', *sys.argv[1:]]); "
    "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)"
)


IDENTIFIERS = ("key", "model_hash", "phase_states", "seconds", "workload", "versions")
"""What names or times a profile rather than measures it: the store key (its format bumped since), the model's
hash (issue 24), the phases' states (issue 28), the profiling time and the workload's spelling."""


OFFLOAD_FIELDS = ("offload", "host", "below", "offload_shared")
"""What a profile measures of ``offload`` (issue 23: measured in the chained step since, after the revision
compared): left out of both sides, so that the figures of every other policy are compared."""


def _figures(path: Path) -> dict[str, Any]:
    """A profile file's measured figures: everything but ``IDENTIFIERS`` and the offload measurements."""
    data: dict[str, Any] = json.loads(path.read_text())
    return _without_offload({k: v for k, v in data.items() if k not in IDENTIFIERS})


def _without_offload(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_offload(v) for k, v in value.items() if k not in OFFLOAD_FIELDS}
    if isinstance(value, list):
        return [_without_offload(v) for v in value]
    return value


def export(revision: str, folder: Path) -> Path:
    """The ``src`` tree of ``revision`` of this repository, in ``folder``."""
    archive = folder / "before.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder / "before", filter="data")
    return folder / "before" / "src"


def profiled(src: Path, config: Path, seq_len: int, out: Path, *, device: str = "cpu", losses: str = "one") -> dict:
    """One profile in a child process importing ``recompute`` from ``src``; the load average before and after."""
    env = {**os.environ, "PYTHONPATH": str(src), "RECOMPUTE_CACHE": str(out.parent / "cache")}
    load = os.getloadavg()[0]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(config), str(seq_len), str(out), device, losses],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return {**result, "load_before": load, "load_after": os.getloadavg()[0]}


PLAIN_BF16 = ("--precision", "bf16")
"""The plan prices the states as profiled (plain bf16): the budget lies between that profile's extremes."""


def plan_times(saved: Path, runs: int) -> dict[str, Any]:
    loaded = Profile.load(saved)
    none = loaded.cost_table().compose(["none"] * loaded.n_layers).peak
    budget = (none + int(smallest_peak(loaded.cost_table()))) // 2  # between the extremes: a plan with work to do
    times, imported, rc = [], [], 0
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", PLAN, "--profile", str(saved), "--budget", str(budget), *PLAIN_BF16, "--json"],
            capture_output=True,
            text=True,
        )
        times.append(time.perf_counter() - start)
        imported.append(done.stderr.strip().splitlines()[-1] == "True" if done.stderr.strip() else None)
        rc = done.returncode
    return {
        "budget_bytes": budget,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "runs": runs,
        "rc": rc,
        "imported_torch": any(bool(x) for x in imported),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", default="9f6a878", help="the revision whose profile is timed as before")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    before_src, after_src = export(args.before, folder), ROOT / "src"
    models: dict[str, Any] = {}
    for name, (label, config, target) in MODELS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(config))
        before = profiled(before_src, path, args.seq_len, folder / f"{name}-before.json")
        after = profiled(after_src, path, args.seq_len, folder / f"{name}-after.json")
        same = _figures(folder / f"{name}-before.json") == _figures(folder / f"{name}-after.json")
        models[name] = {"model": label, "target_s": target, "before": before, "after": after, "equal_profiles": same}
        print(
            f"{name}: before {before['seconds']:.1f} s ({before['cpu_seconds']:.1f} s CPU), after "
            f"{after['seconds']:.1f} s ({after['cpu_seconds']:.1f} s CPU), target {target} s; "
            f"load {before['load_before']:.1f}-{after['load_after']:.1f}; equal profiles: {same}"
        )
    llama = folder / "llama3.1-8b.json"
    both = profiled(after_src, llama, args.seq_len, folder / "both.json", losses="both")
    on_cuda = profiled(after_src, llama, args.seq_len, folder / "cuda.json", device="cuda")
    models["llama3.1-8b"]["after_both_losses"] = both
    models["llama3.1-8b"]["after_device_cuda"] = on_cuda
    print(
        f"llama3.1-8b after, both loss modes in one pass: {both['seconds']:.1f} s ({both['cpu_seconds']:.1f} s "
        f"CPU); --device cuda: {on_cuda['seconds']:.1f} s ({on_cuda['cpu_seconds']:.1f} s CPU)"
    )
    plan = plan_times(folder / "qwen3-30b-a3b-after.json", args.runs)
    result = {
        "workload": {"seq_len": args.seq_len, "micro_batch": 1, "dtype": "bf16", "device": "cpu"},
        "before_revision": args.before,
        "profiles": models,
        "plan_from_qwen3_30b_a3b_profile": plan,
        "targets": {"profile_s": {n: m[2] for n, m in MODELS.items()}, "profile_rss_bytes": 2e9, "plan_s": 0.5},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": f"python benchmarks/profile_speed.py --seq-len {args.seq_len} --runs {args.runs} "
        f"--before {args.before}",
    }
    out = Path(__file__).parent / "results" / "profile_speed.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"plan from the 30B-A3B profile: median {plan['median_s']:.2f} s (max {plan['max_s']:.2f} s, target 0.5 s), "
        f"torch imported: {plan['imported_torch']}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
