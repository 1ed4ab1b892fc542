"""The path a real step takes through transformers, kept by a step on fake tensors (issue 37, item 2).

transformers reads a few tensors' values to choose its path, and takes a tensor it cannot read (``is_tracing``:
a FakeTensor, a compile or export trace) as a reason to take the general one. For a training step the one that
matters is the packed-sequence check: with no attention mask and no cache (``use_cache=False``, or a class that
makes none in training) ``create_causal_mask`` asks ``find_packed_sequence_indices`` whether the position ids hold
several sequences. A real step's are the model's own ``arange``, so it finds one sequence, builds no mask and SDPA
runs with ``is_causal`` (and ``enable_gqa`` for grouped-query attention). On fake position ids the check cannot
read them and answers "packed": a boolean mask of (b, s, s) goes to every layer, SDPA converts it and keeps the
result for its backward (one more (s, s) tensor per layer), and grouped-query attention repeats K and V to every
head instead. Phi-3 at published width with ``use_cache=False`` traced 2 MiB a layer above a real step at s = 1024.

``real_step_path`` answers the check as the real step does. Every step recompute traces passes token ids and
labels only (``recompute.models.loss``), so the position ids are the model's own: one sequence per row.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["real_step_path"]


@contextlib.contextmanager
def real_step_path() -> Iterator[None]:
    """Inside, transformers' packed-sequence check finds one sequence per row on fake position ids, as a real step
    on the model's own position ids does (the module docstring). Outside transformers, or on real tensors, nothing
    changes."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield
        return

    def unpacked(position_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor | None:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids, *args, **kwargs)  # type: ignore[no-any-return]

    setattr(masking, "find_packed_sequence_indices", unpacked)  # noqa: B010  (a module mypy does not know)
    try:
        yield
    finally:
        setattr(masking, "find_packed_sequence_indices", original)  # noqa: B010
