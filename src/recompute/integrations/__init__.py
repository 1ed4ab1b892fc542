"""recompute inside the training stacks people already use; each integration is its own module, imported on use.

- ``recompute.integrations.hf``: the Hugging Face ``Trainer`` (and accelerate, which it runs on):
  ``RecomputeCallback(plan)`` and ``prepare(model, training_args, plan)`` (``accelerator=`` for a loop of your
  own on accelerate);
- ``recompute.integrations.lightning``: a Lightning ``Trainer``: ``RecomputeLightning(plan)``.

A plain PyTorch loop needs none: ``recompute.apply(model, "plan.json")``, then ``torch.compile``, then FSDP2's
``fully_shard`` (torchtitan's order; docs/integrations.md).
"""

from __future__ import annotations

__all__: list[str] = []
