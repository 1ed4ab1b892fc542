# mypy: disable-error-code="union-attr,method-assign,arg-type,operator,assignment"
# (nn.Module children are typed Tensor | Module; the TP plan reaches into GPT/Llama submodules by name.)
"""``parallelize(model, mesh)``: the tensor- and sequence-parallel plan for recompute's GPT and Llama.

The plan is the torchtitan one (``parallelize_llama``) with one change, Megatron's: the column-parallel
linears gather the sequence themselves and keep only the shard for the backward (``_ops``).
"""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from recompute._compat import require_fsdp
from recompute.core.errors import ConfigError
from recompute.core.spec import ModelSpec
from recompute.core.workload import check_head_split, check_sequence_split
from recompute.models.gpt import GPT
from recompute.models.llama import Llama
from recompute.parallel._fsdp import shard
from recompute.parallel._ops import (
    SEQ,
    column_parallel,
    scatter_sequence,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

__all__ = ["check_parallel", "parallelize", "qkv_row_order"]


def check_parallel(spec: ModelSpec, *, tp: int, seq_len: int | None = None, sp: bool = True) -> None:
    """Raise ConfigError unless ``spec`` splits over ``tp`` ranks (and ``seq_len`` too, with ``sp``).

    t must divide the attention heads and the key/value heads; with sequence parallelism it must divide the
    sequence length as well. ``seq_len=None`` checks the heads only. The messages are ``Workload``'s.
    """
    check_head_split(spec, tp)
    if sp and seq_len is not None:
        check_sequence_split(seq_len, tp)


def qkv_row_order(spec: ModelSpec, tp: int) -> Tensor:
    """Row order that ``parallelize`` gives GPT's fused ``c_attn`` (weight and bias) for ``tp`` ranks.

    Rank r holds rows [r*n/t, (r+1)*n/t) of a row-sharded weight; reordered, they are its own query heads,
    then its key heads, then its value heads (Megatron's layout). ``w_parallel = w[order]``, so
    ``w = w_parallel[order.argsort()]`` brings a gathered weight or gradient back to the single-device layout.
    """
    return _rank_major_qkv(torch.arange(spec.q_dim + 2 * spec.kv_dim), spec, tp)


def parallelize(
    model: nn.Module, mesh: DeviceMesh, *, sp: bool = True, mp_dtype: torch.dtype | None = None
) -> nn.Module:
    """Split ``model`` over ``mesh``, in place: tensor parallel, sequence parallel, and FSDP2 with ``dp``.

    Call it before building the optimizer; ``recompute.apply`` composes with it before or after (every
    policy). torchtitan's order, TP, then ``apply``, then FSDP, is ``parallelize(model, mesh["tp"])``,
    ``apply``, then ``shard(model, mesh["dp"])``, which is what the trace runs. Parameters become DTensors;
    GPT's fused ``c_attn`` rows are reordered (``qkv_row_order``).

    Args:
        model: recompute's ``GPT`` or ``Llama``, the same (same seed) on every rank.
        mesh: a 1-D tensor-parallel mesh, or a 2-D mesh with dims ``("dp", "tp")`` (1-D and named ``dp``:
            FSDP only); a ``dp`` dim of size > 1 shards each layer, then the root, with ``fully_shard``
            (``shard``; TP first, as torchtitan).
        sp: sequence parallelism: norms, dropouts and the residual stream hold s/t positions per rank.
        mp_dtype: with a ``dp`` dim, FSDP's ``MixedPrecisionPolicy`` in this dtype (``shard``'s).

    Returns:
        ``model``.

    Raises:
        ConfigError: another model, one already parallel, a mesh with other dims, or t not dividing the
            (key/value) heads.
    """
    if not isinstance(model, (GPT, Llama)):
        raise ConfigError(f"parallelize takes recompute's GPT or Llama, got {type(model).__name__}")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("the model is parallel already (its parameters are DTensors); parallelize a fresh model")
    tp_mesh, dp_mesh = _split_mesh(mesh)
    if dp_mesh is not None and dp_mesh.size() > 1:
        require_fsdp(dp_mesh.device_type)
    if tp_mesh is not None and tp_mesh.size() > 1:
        check_parallel(model.spec, tp=tp_mesh.size(), sp=sp)
        _tensor_parallel(model, tp_mesh, sp=sp)
    if dp_mesh is not None and dp_mesh.size() > 1:
        shard(model, dp_mesh, mp_dtype=mp_dtype)
    return model


def _split_mesh(mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """(tp mesh, dp mesh) of a 1-D (tp, or dp when so named) or 2-D ``("dp", "tp")`` mesh."""
    names = mesh.mesh_dim_names
    if mesh.ndim == 1:
        return (None, mesh) if names == ("dp",) else (mesh, None)
    if mesh.ndim != 2 or names != ("dp", "tp"):
        raise ConfigError(
            f"expected a 1-D tensor-parallel mesh or a 2-D mesh with dims ('dp', 'tp'), got {mesh.ndim}-D dims "
            f"{names}; build it with init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    return mesh["tp"], mesh["dp"]


def _tensor_parallel(model: GPT | Llama, mesh: DeviceMesh, *, sp: bool) -> None:
    tied = model.lm_head.weight is model.tok_emb.weight
    model.loss_fn = vocab_parallel_cross_entropy  # the logits stay sharded on the vocabulary
    norm = SequenceParallel(sequence_dim=SEQ, use_local_output=True) if sp else _ReplicateParallel()
    plan: dict[str, ParallelStyle] = {
        "tok_emb": _VocabParallel(),
        "norm": norm,
        "lm_head": _ColumnParallel(sp=sp, dtensor_output=True),  # vocabulary-parallel logits
    }
    if isinstance(model, GPT):
        plan["pos_emb"] = _ReplicateParallel()
    layer_plan = _gpt_layer if isinstance(model, GPT) else _llama_layer
    for i, layer in enumerate(model.layers):
        styles = layer_plan(layer, model.spec, mesh, sp=sp)
        plan |= {f"layers.{i}.{name}": style for name, style in {"norm1": norm, "norm2": norm, **styles}.items()}
        layer.attn.n_heads //= mesh.size()  # this rank's heads
        layer.attn.n_kv_heads //= mesh.size()
    parallelize_module(model, mesh, plan)
    if tied:  # both are Shard(0) over the vocabulary: one parameter again
        model.lm_head.weight = model.tok_emb.weight
    if sp:
        model.drop.register_forward_pre_hook(functools.partial(_scatter_hook, mesh=mesh, spec=model.spec))


def _gpt_layer(layer: nn.Module, spec: ModelSpec, mesh: DeviceMesh, *, sp: bool) -> dict[str, ParallelStyle]:
    """Styles of one GPT layer's linears; reorders the fused c_attn rows and sets this rank's Q/K/V split."""
    attn, t = layer.attn, mesh.size()
    with torch.no_grad():
        for p in attn.c_attn.parameters():
            p.copy_(_rank_major_qkv(p, spec, t))
    attn.split = tuple(d // t for d in attn.split)
    col, row = _ColumnParallel(sp=sp), _row_parallel(sp)
    return {"attn.c_attn": col, "attn.c_proj": row, "mlp.c_fc": col, "mlp.c_proj": row}


def _llama_layer(layer: nn.Module, spec: ModelSpec, mesh: DeviceMesh, *, sp: bool) -> dict[str, ParallelStyle]:
    """Styles of one Llama layer's linears; Q, K and V share one gather (and one saved shard), gate and up too."""
    attn, mlp = layer.attn, layer.mlp
    attn.qkv = functools.partial(_column_parallel_group, (attn.wq, attn.wk, attn.wv), mesh=mesh, sp=sp)
    mlp.gate_up = functools.partial(_column_parallel_group, (mlp.w1, mlp.w3), mesh=mesh, sp=sp)
    col, row = _ColumnParallel(sp=sp), _row_parallel(sp)
    return {"attn.wq": col, "attn.wk": col, "attn.wv": col, "attn.wo": row, "mlp.w1": col, "mlp.w3": col, "mlp.w2": row}


def _row_parallel(sp: bool) -> RowwiseParallel:
    """Row-parallel output projection: reduce-scattered to the sequence shard with SP, else all-reduced."""
    return RowwiseParallel(output_layouts=Shard(SEQ) if sp else Replicate())


def _rank_major_qkv(w: Tensor, spec: ModelSpec, t: int) -> Tensor:
    """``w[qkv_row_order(spec, t)]`` without an index tensor (so real, meta and fake tensors alike)."""
    q, k, v = w.split((spec.q_dim, spec.kv_dim, spec.kv_dim))
    return torch.cat([part for r in range(t) for part in (q.chunk(t)[r], k.chunk(t)[r], v.chunk(t)[r])])


def _column_parallel_group(linears: tuple[nn.Module, ...], x: Tensor, *, mesh: DeviceMesh, sp: bool) -> tuple:
    return column_parallel(x, list(linears), mesh, sp=sp)


def _scatter_hook(module: nn.Module, args: tuple[Tensor, ...], *, mesh: DeviceMesh, spec: ModelSpec) -> tuple:
    """Before the embedding dropout: keep this rank's share of the sequence (the layers run on it)."""
    (x,) = args
    check_parallel(spec, tp=mesh.size(), seq_len=x.size(SEQ), sp=True)
    return (scatter_sequence(x, mesh),)


class _ColumnParallel(ColwiseParallel):
    """ColwiseParallel's sharding (weight and bias by rows) with Megatron's forward (``_ops.column_parallel``).

    The module is called on a sequence shard with ``sp``, on the replicated input without; it returns the
    local (b, s, out/t) output, or with ``dtensor_output`` a DTensor sharded on its last dim (the logits).
    """

    def __init__(self, *, sp: bool, dtensor_output: bool = False) -> None:
        super().__init__()
        self.sp, self.dtensor_output = sp, dtensor_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"column parallelism needs an nn.Linear, got {type(module).__name__}")
        distribute_module(module, device_mesh, self._partition_linear_fn)  # no input/output hooks
        module.forward = functools.partial(
            _column_forward, module, mesh=device_mesh, sp=self.sp, dtensor_output=self.dtensor_output
        )
        return module


def _column_forward(module: nn.Linear, x: Tensor, *, mesh: DeviceMesh, sp: bool, dtensor_output: bool) -> Tensor:
    (y,) = column_parallel(x, [module], mesh, sp=sp)
    if not dtensor_output:
        return y
    # The global shape and strides, given: from_local would take v as t * (local v), wrong for uneven shards.
    shape = torch.Size((*y.shape[:-1], module.out_features))
    stride = tuple(itertools.accumulate(reversed(shape[1:]), operator.mul, initial=1))[::-1]  # contiguous
    return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape, stride=stride)


class _VocabParallel(RowwiseParallel):
    """RowwiseParallel's sharding of an embedding table (by vocabulary rows) with Megatron's lookup (``_ops``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"vocabulary parallelism needs an nn.Embedding, got {type(module).__name__}")
        distribute_module(module, device_mesh, self._partition_embedding_fn)  # no input/output hooks
        module.forward = functools.partial(_embedding_forward, module)
        return module


def _embedding_forward(module: nn.Embedding, ids: Tensor) -> Tensor:
    return vocab_parallel_embedding(ids, module.weight)


class _ReplicateParallel(ParallelStyle):
    """Parameters replicated (DTensors, as FSDP and the optimizer want them); runs on replicated inputs.

    For the norms without sequence parallelism, and GPT's position embedding.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _replicated_inputs, _local_output)


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for p_name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(p_name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Tensor:
    return output.to_local()
