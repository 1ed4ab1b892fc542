"""Model states under a precision mode, for a step traced in one dtype. Torch-free.

A traced step (``recompute.trace``, a profile) is plain training in one dtype: parameters, gradients and
AdamW's moments all in the activation dtype (fp32: 4 + 4 + 8 = 16 B per parameter, the ``fp32`` mode; bf16 or
fp16: 2 + 2 + 4 = 8 B, the ``bf16`` mode), or, under ``amp``, autocast over fp32 states (16 B), traced as
itself. A workload may ask for another mode (``mixed``: 18 B, Megatron's;
``distributed`` over d data-parallel ranks: 6 + 12/d). The activations do not change; the states do, and so
does every phase of the step that holds them:

    phase' = phase + N (w' - w) + N (o' - o) + G (g'/g - 1)  [+ T (m'/m - 1) in the optimizer step]

with N the parameters on the rank, w, g, o the bytes per parameter of weights, gradients and optimizer state
(``recompute.core.analytic.params.bytes_per_param``), G the gradient bytes at the phase's peak (the backward
makes them as it goes; all of them with ``keep_grads``) and T the optimizer step's temporaries, which are of
one moment's dtype (m). tests/test_trace.py holds a repriced trace to the preset's formula and to a real
optimizer step's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from recompute.core.analytic.params import bytes_per_param
from recompute.core.errors import require
from recompute.core.workload import AMP

__all__ = ["Restate", "traced_precision"]


def traced_precision(dtype: str, precision: str | None = None) -> str:
    """The precision mode a step traced in ``dtype`` runs: autocast over fp32 states under ``amp`` (the step is
    traced as itself), else everything in that dtype."""
    if precision == AMP:
        return AMP
    return "fp32" if dtype == "fp32" else "bf16"


def _moment(precision: str) -> float:
    """Bytes of one element of an Adam moment: fp32 but in the bf16 mode."""
    return 2.0 if precision == "bf16" else 4.0


@dataclass(frozen=True)
class Restate:
    """How a traced step's figures change when its states are priced for another precision mode."""

    params: float
    """N: parameters on the rank."""
    traced: str
    wanted: str
    dp: int = 1
    fsdp: bool = False
    """The wanted states are FSDP's shards (``bytes_per_param(..., fsdp=True)``); its gathered parameters and
    unsharded gradients are the caller's (``recompute.core.analytic.sharding``)."""

    @classmethod
    def of(
        cls,
        parameter_bytes: float,
        dtype: str,
        precision: str | None,
        dp: int = 1,
        *,
        traced: str | None = None,
        fsdp: bool = False,
    ) -> Restate:
        """From the traced step's parameter bytes and dtype, to ``precision`` (None: as traced). ``traced``: the
        precision the step ran (``amp``, or None for one dtype).

        Raises:
            ConfigError: one side is ``amp`` and the other is not: autocast changes what the step saves, not
                only its states, so such a step is traced under the precision asked, never restated.
        """
        ran = traced_precision(dtype, traced)
        wanted = precision or ran
        require(
            (ran == AMP) == (wanted == AMP),
            f"a step traced {'under amp' if ran == AMP else f'in {dtype}'} cannot be priced for {wanted} precision: "
            "autocast changes the activations, not only the model states; trace it with that precision",
            fields=("precision",),
        )
        n = parameter_bytes / bytes_per_param(ran)["parameters"]
        return cls(n, ran, wanted, dp, fsdp)

    @property
    def identity(self) -> bool:
        return self.traced == self.wanted and not self.fsdp

    def _now(self) -> dict[str, float]:
        return bytes_per_param(self.wanted, self.dp, fsdp=self.fsdp)

    def states(self, traced: Mapping[str, float]) -> dict[str, float]:
        """Parameters, gradients and optimizer bytes under the wanted mode, from the traced ones (what is not
        per parameter, such as AdamW's step counters, stays as traced)."""
        was, now = bytes_per_param(self.traced), self._now()
        return {k: traced[k] + self.params * (now[k] - was[k]) for k in now}

    def phase(self, total: float, breakdown: Mapping[str, float], *, optimizer: bool = False) -> float:
        """A phase's peak under the wanted mode, from its traced peak and MemTracker's categories there."""
        if self.identity:
            return total
        was, now = bytes_per_param(self.traced), self._now()
        out = total + self.params * (now["parameters"] - was["parameters"] + now["optimizer"] - was["optimizer"])
        out += breakdown.get("Gradient", 0.0) * (now["gradients"] / was["gradients"] - 1)
        if optimizer:  # the distributed optimizer and FSDP step their shard of the parameters, 1/d of them
            shard = self.dp if self.wanted == "distributed" or self.fsdp else 1
            out += self.temporaries(breakdown) * (self._moment() / _moment(self.traced) / shard - 1)
        return out

    def _moment(self) -> float:
        """Bytes of one element of the wanted Adam moments (FSDP's: the shards' dtype)."""
        if self.fsdp:
            return self._now()["optimizer"] * self.dp / 2
        return _moment(self.wanted)

    def temporaries(self, breakdown: Mapping[str, float]) -> float:
        """T: the optimizer step's temporaries at its peak. MemTracker files what the step allocates under the
        optimizer's own category (``Optstate``, with the moments), so T is that less the traced moments."""
        was = bytes_per_param(self.traced)
        held = breakdown.get("Optstate", 0.0) - self.params * was["optimizer"]
        return breakdown.get("Temp", 0.0) + max(held, 0.0)

    def note(self) -> str:
        per = self._now()
        traced = f"{self.traced}: {sum(bytes_per_param(self.traced).values()):g} B"
        if self.fsdp:
            return (
                f"model states FSDP2 full shard over {self.dp} ranks, {self.wanted} precision ({sum(per.values()):g} "
                f"B per parameter on a rank), the gathered parameters and unsharded gradients added by phase; the "
                f"one-device step measured ({traced}), activations unchanged"
            )
        return (
            f"model states then priced for {self.wanted} precision ({sum(per.values()):g} B per parameter) instead "
            f"of the traced step's {traced}; activations as traced"
        )
