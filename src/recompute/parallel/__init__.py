"""Tensor and sequence parallelism for recompute's GPT and Llama (Korthikanti et al. 2022), on DTensor; FSDP2
full shard for any transformer.

``parallelize(model, mesh)`` splits each layer Megatron's way over the ``tp`` ranks of a DeviceMesh with
``torch.distributed.tensor.parallel``, and shards it with FSDP2 over a ``dp`` dim; ``recompute.apply`` then
composes with it (every policy). ``shard(model, dp_mesh, mp_dtype=...)`` is the FSDP2 part alone, for any model
with a layer list (transformers' classes too): ``fully_shard`` on each layer, then the root, with FSDP's
``MixedPrecisionPolicy`` when asked (``mixed_dtype(workload)``); call it after ``apply`` (torchtitan's order).
Launch with torchrun; ``init_from_env`` starts gloo (CPU) or NCCL (CUDA).

Each layer, per rank:

- attention runs on a/t query and kv/t key/value heads; the Q/K/V projections and the MLP's first linear(s)
  are column-parallel (``ColwiseParallel``'s row-sharded weights), the output projections (``c_proj``, ``wo``,
  ``w2``) row-parallel (``RowwiseParallel``);
- without sequence parallelism (``sp=False``), classic Megatron: norms and residual stream replicated, an
  all-reduce after each row-parallel linear;
- with it, the norms (``SequenceParallel``), the residual-branch dropouts and the residual stream hold s/t
  positions; each row-parallel output is reduce-scattered to them and each column-parallel input all-gathered.
  Note: [save the shard, gather twice] that gather is Megatron's, not a DTensor redistribution before the
  linear: an autograd Function keeps only the shard and gathers again in the backward (Sec. 4.2.2), so the
  inputs of Q/K/V and of the MLP's first matmul take sbh/t, not sbh. Llama's wq/wk/wv share one gather, and
  w1/w3 another; GPT's fused ``c_attn`` rows are reordered so that a rank's row block is its own q, k and v
  heads (``qkv_row_order``; a plain GPT's state dict needs them put back).

One layer then keeps what ``recompute.core.analytic.layer_activations`` counts for t and sp: sbh(10 + 24/t +
5as/(ht)) in the paper's fp16 accounting with TP, sbh(34/t + 5as/(ht)) with TP+SP, 34sbh/t with SP and
``core_attn``; ``recompute.trace.saved_bytes_per_layer`` measures it.

Outside the layers: the token embedding is vocabulary-parallel (rows of the table per rank, output
all-reduced), GPT's position embedding replicated; with SP the sequence is split right after the embeddings,
so the embedding dropout masks s/t positions (a local slice where Megatron reduce-scatters the embedding:
one all-reduce instead). The final norm is parallel like the layers' norms. The output layer is
vocabulary-parallel and column-parallel like Q/K/V: the logits are a DTensor sharded on the vocabulary,
(b, s, v/t) per rank, and the model's loss is Megatron's vocabulary-parallel cross-entropy, which never
gathers them and keeps 4sbv/t bytes of fp32 softmax per rank. GPT's tied embedding stays one parameter (both
uses shard it by vocabulary rows).

Dropout: each rank draws its masks from its own generator. Without SP the residual and embedding dropouts act
on replicated tensors, so seed every rank alike (``torch.manual_seed``): the ranks then draw the same masks.
Attention-probability dropout then also draws one stream for every rank's heads (Megatron keeps a separate
tensor-parallel generator for it; not done here). Masks never equal a single-device run's, so comparisons
with one are made at dropout 0.

Order: build the model (same seed on every rank), ``parallelize``, ``recompute.apply``, then the optimizer.
torch.compile is not covered.
"""

import recompute._compat  # noqa: F401  (a torch outside the supported range: one ConfigError, here)
from recompute.parallel._env import end_process_group, init_from_env, under_torchrun
from recompute.parallel._fsdp import mixed_dtype, reduce_dtype, shard
from recompute.parallel._ops import column_parallel, scatter_sequence, vocab_parallel_cross_entropy
from recompute.parallel._plan import check_parallel, parallelize, qkv_row_order

__all__ = [
    "check_parallel",
    "column_parallel",
    "end_process_group",
    "init_from_env",
    "mixed_dtype",
    "parallelize",
    "qkv_row_order",
    "reduce_dtype",
    "scatter_sequence",
    "shard",
    "under_torchrun",
    "vocab_parallel_cross_entropy",
]
