"""``recompute trace``: every byte a training step allocates, from the real PyTorch step on fake tensors.

The model runs forward, backward and an AdamW step under ``FakeTensorMode`` (nothing is allocated) while
``StepTracker`` (MemTracker plus saved-tensor hooks) records parameters, gradients, optimizer state, what each
layer saves for the backward (by component and by the op that reads it back) and the peak with its phase.

Example:
    >>> from recompute import ModelSpec, Workload
    >>> from recompute.trace import trace
    >>> r = trace(ModelSpec.from_name("gpt2"), Workload(seq_len=1024, device="cpu"), "block")
    >>> r.layers[0].components
    {'checkpoint': 1572864}
"""

from recompute.models.source import ModelSource, resolve_source
from recompute.trace._compiled import (
    PARTITIONERS,
    capture_backend,
    compiled_regions,
    graph_flops,
    saved_by_compiled,
    saved_by_eager,
    traces_compiled_peaks,
)
from recompute.trace._compiled_run import CHUNKED_WHOLE, CompiledTrace, render_compiled, trace_budgets, trace_compiled
from recompute.trace._flops import flop_counter
from recompute.trace._profile import cached_profile, cached_profiles, profile, profile_key, profiles, with_loss
from recompute.trace._ranks import saved_bytes_per_layer
from recompute.trace._render import render_trace
from recompute.trace._result import COMPONENTS, PartTrace, TraceResult
from recompute.trace._run import step_needs, step_record, step_work, step_works, trace, trace_layer, trace_module
from recompute.trace._work import cached_works

__all__ = [
    "CHUNKED_WHOLE",
    "COMPONENTS",
    "PARTITIONERS",
    "CompiledTrace",
    "ModelSource",
    "PartTrace",
    "TraceResult",
    "cached_profile",
    "cached_profiles",
    "cached_works",
    "capture_backend",
    "compiled_regions",
    "flop_counter",
    "graph_flops",
    "profile",
    "profile_key",
    "profiles",
    "render_compiled",
    "render_trace",
    "resolve_source",
    "saved_by_compiled",
    "saved_by_eager",
    "saved_bytes_per_layer",
    "step_needs",
    "step_record",
    "step_work",
    "step_works",
    "trace",
    "trace_budgets",
    "trace_compiled",
    "trace_layer",
    "trace_module",
    "traces_compiled_peaks",
    "with_loss",
]
