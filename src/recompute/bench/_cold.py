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
from torch.utils._pytree import tree_map

from recompute.trace._flops import span, tensors_of

__all__ = ["MAX_COPIES", "Rotation", "copied", "pool_bytes", "rotation"]

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
            self.turn = itertools.cycle([copied(self.args) for _ in range(self.copies)])
        self.kept.append(self.fn(*next(self.turn)))

    def close(self) -> None:
        """Let the copies and the kept results go."""
        self.turn = None
        self.kept.clear()


def copied(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every tensor in them (nested ones too) copied into storage of its own, strides, offset and
    ``requires_grad`` kept: a transposed view stays transposed, views of one storage stay views of one copy."""
    bases: dict[int, torch.Tensor] = {}

    def copy(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        storage = a.untyped_storage()
        key = storage.data_ptr()
        if key not in bases:
            raw = torch.empty(0, dtype=torch.uint8, device=a.device).set_(storage)  # the storage's bytes
            whole = -(-raw.numel() // a.element_size()) * a.element_size()  # whole elements: a.dtype's view holds
            flat = torch.empty(whole, dtype=torch.uint8, device=a.device)
            flat[: raw.numel()].copy_(raw)
            bases[key] = flat
        twin = bases[key].view(a.dtype).as_strided(a.size(), a.stride(), a.storage_offset())
        return twin.detach().requires_grad_(a.requires_grad)

    out: tuple[Any, ...] = tree_map(copy, args)
    return out
