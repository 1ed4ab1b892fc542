"""``recompute bench``: real training steps under each policy, measured next to the prediction.

``bench`` runs one process (peak memory, step time, tokens/s, overhead against the analytic figures);
``bench_parallel`` runs under torchrun with tensor, sequence and data parallelism and measures what one rank
keeps per layer; ``bench_fsdp`` runs FSDP2 full shard under torchrun and sets each rank's real step next to the
fake trace of that rank (``with_traces``). ``read_bench`` reads ``bench``'s and ``bench_parallel``'s JSON back
(``recompute.core.results``). ``allocator_peak`` reads the CPU allocator's own peak over a call (what a real
compiled CPU step allocates, which no dispatch mode sees).
"""

from recompute.bench._allocator import AllocatorPeak, allocator_peak
from recompute.bench._predict import MAX_MINUTES, run_precision
from recompute.bench._sharded import ShardedBench, ShardedRow, bench_fsdp, render_fsdp_bench, with_traces
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
    "AllocatorPeak",
    "BenchResult",
    "BenchRow",
    "ParallelBench",
    "RankRow",
    "ShardedBench",
    "ShardedRow",
    "allocator_peak",
    "bench",
    "bench_fsdp",
    "bench_parallel",
    "bench_source",
    "bench_spec",
    "predict_parallel",
    "render_bench",
    "render_fsdp_bench",
    "render_parallel_bench",
    "run_precision",
    "with_predictions",
    "with_traces",
]
