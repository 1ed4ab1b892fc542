"""Cold operands for calibration: an op timed on a ring of copies of its operands, so that no call finds them in
the cache, as an op of a training step does not (Note: [cold operands] in ``recompute.bench.calibrate``)."""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from recompute.trace._flops import span, tensors_of

__all__ = ["MAX_COPIES", "Rotation", "copied", "copies_of", "pool_bytes", "rotation"]

MAX_COPIES = 1024
"""At most so many copies of a small op's operands: below ``pool / MAX_COPIES`` bytes an op's ring is smaller than
the pool (1024 copies of a 4 KiB add: 12 MiB, out of a core's L1 and L2, not out of a large L3; the small
tensors of a step are mostly recent ones)."""


def pool_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of operand copies a CPU op rotates through: twice the largest cache the kernel reports under
    ``caches``, at least 64 and at most 512 MiB (256 MiB where it reports none)."""
    units = {"": 0, "K": 10, "M": 20, "G": 30}
    sizes = []
    for index in caches.glob("index*"):
        try:
            found = re.fullmatch(r"(\d+)([KMG]?)", (index / "size").read_text().strip())
        except OSError:
            found = None
        if found:
            sizes.append(int(found[1]) << units[found[2]])
    return min(max(2 * max(sizes, default=128 << 20), 64 << 20), 512 << 20)


def rotation(fn: Callable[..., Any], args: tuple[Any, ...], pool: int) -> Callable[[], Any]:
    """``fn(*args)`` as a call on the next copy of its tensor operands each time, ``pool`` bytes of copies and
    results in all (at most ``MAX_COPIES``); ``fn`` on ``args`` themselves where the pool holds one or none."""
    if not pool:
        return partial(fn, *args)
    inputs, outputs = tensors_of(args, fn(*args))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs}
    nbytes = sum(storages.values()) + sum(span(t) for t in outputs)
    copies = min(MAX_COPIES, -(-pool // max(nbytes, 1)))
    return Rotation(fn, args, copies) if copies > 1 else partial(fn, *args)


class Rotation:
    """``fn`` on the next of ``copies`` copies of ``args`` at each call, the last ``copies`` results kept (so
    each output lands in a buffer freed ``copies`` calls before); the copies are made at the first call."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], copies: int) -> None:
        self.fn, self.args, self.copies = fn, args, copies
        self.turn: Iterator[tuple[Any, ...]] | None = None
        self.kept: collections.deque[Any] = collections.deque(maxlen=copies)

    def __call__(self) -> None:
        if self.turn is None:
            self.turn = itertools.cycle(copies_of(self.args, self.copies))
        self.kept.append(self.fn(*next(self.turn)))

    def close(self) -> None:
        """Let the copies and the kept results go."""
        self.turn = None
        self.kept.clear()


def copied(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every tensor in them (nested ones too) copied into storage of its own, strides, offset and
    ``requires_grad`` kept: a transposed view stays transposed, views of one storage stay views of one copy."""
    return copies_of(args, 1)[0]


def copies_of(args: tuple[Any, ...], n: int) -> list[tuple[Any, ...]]:
    """``n`` copies of ``args`` as ``copied`` makes one, ``args`` walked once, not once a copy: 1024 copies of the
    operands of each of the 27 named ops at 4 KiB take 0.65 s, against 2.1 to 2.7 s copy by copy (issue 39)."""
    leaves, spec = tree_flatten(args)
    flat = len(leaves) == len(args) and all(leaf is a for leaf, a in zip(leaves, args, strict=True))
    storages: dict[int, tuple[torch.Tensor, int]] = {}  # storage -> (its bytes, whole elements' bytes)
    views = []  # (leaf index, storage, dtype, size, stride, offset, requires_grad) of each tensor
    for i, a in enumerate(leaves):
        if isinstance(a, torch.Tensor):
            key = a.untyped_storage().data_ptr()
            if key not in storages:
                raw = torch.empty(0, dtype=torch.uint8, device=a.device).set_(a.untyped_storage())  # its bytes
                storages[key] = raw, -(-raw.numel() // a.element_size()) * a.element_size()  # whole elements
            views.append((i, key, a.dtype, a.size(), a.stride(), a.storage_offset(), a.requires_grad))
    out = []
    for _ in range(n):
        bases = {}
        for key, (raw, whole) in storages.items():
            base = torch.empty(whole, dtype=torch.uint8, device=raw.device)
            (base if whole == raw.numel() else base[: raw.numel()]).copy_(raw)
            bases[key] = base
        twins = list(leaves)
        for i, key, dtype, size, stride, offset, grad in views:
            twin = bases[key].view(dtype).as_strided(size, stride, offset)
            twins[i] = twin.detach().requires_grad_() if grad else twin
        out.append(tuple(twins) if flat else tree_unflatten(twins, spec))
    return out
