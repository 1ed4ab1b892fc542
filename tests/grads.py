"""One seeded forward/backward and a bit-for-bit comparison of its loss and gradients: what the tests of
``apply`` and of offload hold every policy to."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Grads = tuple[Tensor, dict[str, Tensor]]


def grads_of(
    model: nn.Module, loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor], inputs: tuple[Tensor, Tensor]
) -> Grads:
    """The loss and every parameter's gradient of one forward/backward, the dropout RNG seeded."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # the same dropout masks in every run
    loss = loss_fn(model, *inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: Grads, ref: Grads) -> None:
    """Equal bit for bit: recomputation on the CPU runs the same kernels on the same inputs."""
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    assert got[1].keys() == ref[1].keys()
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
