"""A plain PyTorch loop with FSDP2 in the documented order: ``recompute.apply``, then ``torch.compile``, then
``fully_shard`` (torchtitan's), run on every rank under torchrun (driven by tests/test_integrations.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/loop_worker.py --out r.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/loop_worker.py --out r.json --compile

Each rank builds the same model (recompute's Llama; transformers' Qwen2 from its config class), applies a plan
made for it (a plan file's content: its identity, a per-layer policy, its loss mode), with ``--compile``
compiles each layer (``aot_eager``: dynamo and AOTAutograd's partitioner over the checkpoint, no code
generation), shards each layer and the root with FSDP2 (``fully_shard``, gloo on the CPU), and takes its half
of a batch. The loss averaged over the ranks and every gradient (gathered) must equal one process's plain
model on the whole batch. Rank 0 writes ``{"checks": [...]}``, each check's outcome over all ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny.py

from recompute.checkpointing import _iter_wrapped, apply, find_layers
from recompute.core.policy import Policy
from recompute.models import build_model
from recompute.models.identity import model_identity
from tiny import tiny_llama

B, S, V = 2, 32, 128  # micro-batch per rank, sequence, vocabulary


def llama() -> tuple[nn.Module, Callable[[nn.Module, Tensor, Tensor], Tensor]]:
    return build_model(tiny_llama(n_layers=3), attention="eager"), lambda m, x, y: m(x, y)[1]


def qwen2() -> tuple[nn.Module, Callable[[nn.Module, Tensor, Tensor], Tensor]]:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return transformers.AutoModelForCausalLM.from_config(config), lambda m, x, y: m(input_ids=x, labels=y).loss


MODELS = {"recompute Llama": (llama, "full"), "transformers Qwen2": (qwen2, "chunked")}
"""Each model and the loss mode its plan takes."""
LAYERS = ("block", "attn+mlp", "none")


class Checks:
    """Named outcomes of this rank's checks: ``with checks("name"): assert ...``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        try:
            yield
            self.rows.append({"name": name, "ok": True, "detail": ""})
        except AssertionError as e:
            self.rows.append({"name": name, "ok": False, "detail": " ".join(str(e).split())[:600]})


def plan_for(model: nn.Module, loss: str) -> dict[str, Any]:
    """What ``recompute plan -o`` writes, in the parts ``apply`` reads."""
    identity = model_identity(model)
    return {
        "format": "recompute.plan/2",
        "model": identity.to_dict(),
        "policy": Policy(layers=LAYERS, model=identity).to_dict(),
        "loss": {"mode": loss, "chunk": 16 if loss == "chunked" else None},
    }


def check(checks: Checks, name: str, *, compiled: bool) -> None:
    build, loss_mode = MODELS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, loss_of = build()
    ref.train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(V, (B * world, S), generator=g), torch.randint(V, (B * world, S), generator=g)
    loss_ref = loss_of(ref, x, y)
    loss_ref.backward()

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    apply(model, plan_for(model, loss_mode))  # 1. recompute
    wrapped = len(list(_iter_wrapped(model)))
    layers = find_layers(model)
    if compiled:  # 2. torch.compile, layer by layer (torchtitan compiles each block)
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend="aot_eager")
    for layer in layers:  # 3. FSDP2, each layer and the root
        fully_shard(layer)
    fully_shard(model)
    mine = slice(rank * B, (rank + 1) * B)
    loss = loss_of(model, x[mine], y[mine])
    loss.backward()
    label = f"{name}, {loss_mode} loss, apply{', compile' if compiled else ''}, fully_shard"
    with checks(f"{label}: the plan's regions are wrapped"):
        chunked = 3 if loss_mode == "chunked" else 0  # the model's forward, the head's, the loss
        assert wrapped == 1 + 2 + chunked, wrapped  # block: the layer; attn+mlp: two sub-blocks
    with checks(f"{label}: loss and every gradient equal one process's"):
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, loss_ref.detach(), rtol=1e-5, atol=1e-6)
        got = {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            g = got[n]
            full = g.full_tensor() if isinstance(g, DTensor) else g
            torch.testing.assert_close(full, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    init_device_mesh("cpu", (dist.get_world_size(),))
    checks = Checks()
    for name in MODELS:
        check(checks, name, compiled=args.compile)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checks.rows)
    if dist.get_rank() == 0:
        rows = [
            {
                **row,
                "ok": all(r[i]["ok"] for r in everyone),
                "detail": " | ".join(r[i]["detail"] for r in everyone if r[i]["detail"]),
            }
            for i, row in enumerate(checks.rows)
        ]
        args.out.write_text(json.dumps({"checks": rows}, indent=1))
        print(f"{sum(r['ok'] for r in rows)}/{len(rows)} checks passed", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
