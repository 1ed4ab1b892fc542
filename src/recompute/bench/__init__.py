"""``recompute bench``: real training steps under each policy, measured next to the prediction.

``bench`` runs one process (peak memory, step time, tokens/s, overhead against the analytic figures);
``bench_parallel`` runs under torchrun with tensor, sequence and data parallelism and measures what one rank
keeps per layer. ``read_bench`` reads either's JSON back (``recompute.core.results``).
"""

from recompute.bench._predict import MAX_MINUTES, run_precision
from recompute.bench._single import CPU_GPT2, BenchResult, BenchRow, bench, bench_source, bench_spec, render_bench
from recompute.bench._torchrun import (
    ParallelBench,
    RankRow,
    bench_parallel,
    predict_parallel,
    render_parallel_bench,
    with_predictions,
)

__all__ = [
    "CPU_GPT2",
    "MAX_MINUTES",
    "BenchResult",
    "BenchRow",
    "ParallelBench",
    "RankRow",
    "bench",
    "bench_parallel",
    "bench_source",
    "bench_spec",
    "predict_parallel",
    "render_bench",
    "render_parallel_bench",
    "run_precision",
    "with_predictions",
]
