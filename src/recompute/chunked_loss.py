"""Chunked cross-entropy: the output layer and the loss over chunks of tokens, never all the logits at once.

``recompute.apply(model, policy, loss="chunked", loss_chunk=N)`` makes a forward given targets (recompute's models:
``model(idx, targets)``) or labels (transformers': ``model(input_ids=..., labels=...)``) run the output layer (the
head) and the cross-entropy N tokens at a time, and take each chunk's gradients (of the head input and of the
head's weights) right away, in the forward, while that chunk's logits are alive. So the (b, s, v) logits, their
fp32 log-probabilities and their gradients are never alive at once (one chunk's are), and nothing is replayed: the
step's FLOPs are the plain loss's. The backward only hands the gradients out, scaled by the loss's incoming
gradient (Liger-Kernel's fused linear cross-entropy works the same way, with hand-written kernels; here each chunk
runs the model's own head and loss under autograd). Such a forward returns no logits: ``(None, loss)``, or
transformers' output with ``logits=None``; without targets or labels, with autograd off or in eval mode (an
evaluation or a prediction: ``Trainer.evaluate`` and ``predict`` hand the logits to ``compute_metrics``) the model
runs as it always did, logits and all. What it costs: the head's weight gradient exists from the loss's forward on,
summed over the chunks in place (two at once while a chunk's is added); the backward runs once
(``retain_graph=True`` and a second backward are refused); and fp16 is refused, as its gradients, taken before a
loss scaler scales them, would underflow (bf16 needs no scaler).

How: three instance-level replacements, which the next ``apply`` restores (``apply(model, "none")`` too):

- the model's ``forward``: given targets or labels, it runs the original forward with the head deferred,
  then drops the logits from what it returns; ``inspect.signature`` sees the original's (the HF Trainer's
  ``remove_unused_columns`` reads it);
- the head (``lm_head``, or ``get_output_embeddings()``): deferred, it hands its input back unchanged (its
  module hooks see that one call); the chunks call its original ``forward`` directly, hooks aside, so that
  tools watching module backward hooks (``MemTracker``, ``ModTracker``) do not take the chunks' gradients for
  the backward. So a head whose weights are gathered only inside its own forward (ZeRO-3, or an FSDP2 unit of
  its own that reshards after its forward) is not covered; a head inside its parent's unit (the model's
  root, as ``recompute.parallel`` wraps it) is;
- the loss (``model.loss_fn`` of recompute's models, which ``recompute.parallel.parallelize`` makes
  vocabulary-parallel; ``model.loss_function`` of transformers'): handed the head's input, it runs
  head + loss chunk by chunk. A model that changes the logits between its head and its loss (Gemma's
  soft-capping, Cohere's logit scale) is refused at its first forward: the loss would not see the head's
  output; so is a head that reads a parameter not its own (its gradient would be lost).

The loss is the model's own: the mean over the targets that are not ``-100`` (``ignore_index``) of the whole
micro-batch, as ``F.cross_entropy``'s mean. Each chunk gives its sum over the batch's count (recompute's
models); transformers' loss function is called per chunk with the chunk's shifted labels (``shift_labels``,
labels shifted as it shifts them) and the batch's count (``num_items_in_batch``, the caller's when given), so
its chunks add up to its mean.

Note: [what is bit-exact] the gradient of every logit is the same float as without chunks: softmax minus
the one-hot target times 1/n, with the same 1/n (``F.cross_entropy``'s mean divides by the count as the chunk's
division does). The loss value, the head's weight gradient and the hidden states' gradient are sums taken in
another order (chunk by chunk; the weight gradient summed over the chunks), equal up to float rounding.
Under tensor parallelism the chunk is gathered over the ranks' sequence shards (N tokens per chunk in all).

Order with other transforms: ``parallelize``, then ``apply``, then ``torch.compile`` (not covered for the
chunked loss) and the optimizer.

Over 400 lines because the loss, its hand-written autograd function and the forward wrapper that keeps the model's
signature (recompute's and transformers' conventions) must agree on one chunking.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from recompute.core.errors import ConfigError, one_of, positive_int, require
from recompute.core.workload import LOSSES, loss_chunk_tokens

__all__ = ["IGNORE_INDEX", "LossParts", "check_loss", "chunked_replacements", "loss_parts"]

IGNORE_INDEX = -100
"""Targets with this value count for nothing, as in ``F.cross_entropy`` and transformers."""

_TARGETS = ("targets", "labels")
"""The forward's argument holding the targets: recompute's models (and nanoGPT's), transformers'."""


def check_loss(loss: str, loss_chunk: object) -> int | None:
    """``loss_chunk`` if ``loss``/``loss_chunk`` are a valid pair for ``apply``, else a ConfigError."""
    one_of("loss", loss, LOSSES)
    if loss_chunk is None:
        return None
    require(
        loss == "chunked",
        f"loss_chunk {loss_chunk!r} needs loss='chunked'; pass loss='chunked' or drop loss_chunk",
        fields=("loss_chunk", "loss"),
    )
    return positive_int("loss_chunk", loss_chunk)


@dataclass(frozen=True)
class LossParts:
    """Where a model's head and loss are, found before anything is replaced."""

    head: nn.Module
    """The output layer: ``lm_head``, or what ``get_output_embeddings()`` returns."""
    hook: str
    """The model's loss attribute: ``loss_fn`` (recompute's models) or ``_loss_function`` (transformers')."""
    targets: str
    """The forward's targets argument: ``targets`` or ``labels``."""
    signature: inspect.Signature = field(compare=False)


def loss_parts(model: nn.Module) -> LossParts:
    """The head, the loss hook and the targets argument of ``model``.

    Raises:
        ConfigError: no head (``lm_head`` or ``get_output_embeddings()``), no loss to chunk (``loss_fn``
            taking ``reduction=``, or transformers' ``ForCausalLMLoss``), or no targets/labels argument.
    """
    name = type(model).__name__
    head = _head(model)
    signature = inspect.signature(_unwrapped(model.forward))
    targets = next((t for t in _TARGETS if t in signature.parameters), None)
    require(
        targets is not None,
        f"{name}.forward takes no targets or labels argument, so chunked loss cannot tell a training forward; "
        "use loss='full'",
    )
    assert targets is not None
    return LossParts(head, _loss_hook(model), targets, signature)


def _head(model: nn.Module) -> nn.Module:
    """transformers' ``get_output_embeddings()``, else ``lm_head`` (recompute's and nanoGPT's name)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not any(m is head for m in model.modules()):
        raise ConfigError(
            f"found no output layer in {type(model).__name__} (an lm_head, or get_output_embeddings()); "
            "chunked loss runs the head per chunk: use loss='full'"
        )
    return head


def _loss_hook(model: nn.Module) -> str:
    """``loss_fn`` (recompute's models, taking ``reduction=``) or transformers' ``_loss_function``."""
    name = type(model).__name__
    fn = _unwrapped(model.__dict__.get("loss_fn"))
    if callable(fn):
        require(
            "reduction" in inspect.signature(fn).parameters,
            f"{name}.loss_fn ({getattr(fn, '__name__', fn)!r}) takes no reduction argument; chunked loss adds up "
            "per-chunk sums: give it reduction='sum' (as recompute.models.core.cross_entropy), or use loss='full'",
        )
        return "loss_fn"
    if hasattr(type(model), "loss_function"):
        from transformers.loss.loss_utils import LOSS_MAPPING

        require(
            _unwrapped(model.loss_function) is LOSS_MAPPING["ForCausalLM"],
            f"{name}'s loss is {getattr(model.loss_function, '__name__', 'custom')}, not transformers' "
            "ForCausalLMLoss, which chunked loss runs per chunk; use loss='full'",
        )
        return "_loss_function"
    raise ConfigError(
        f"found no loss in {name} (a loss_fn attribute, or transformers' loss_function); chunked loss computes "
        "the model's own loss per chunk: use loss='full'"
    )


def _unwrapped(value: Any) -> Any:
    """What a replacement below stands in for (``value`` itself if it is none of them)."""
    while isinstance(value, functools.partial) and value.func in _REPLACEMENTS:
        value = value.args[1]
    return value


# --- the replacements -------------------------------------------------------------------------------------


@dataclass
class _Deferred:
    """One training forward's deferred head: the input it was given, and whether the loss took it."""

    head: nn.Module
    x: Tensor | None = None
    used: bool = False


_DEFERRED: ContextVar[_Deferred | None] = ContextVar("recompute_chunked_loss", default=None)
"""Set while a chunked model's forward runs with targets (a context variable: threads see their own)."""


def chunked_replacements(model: nn.Module, parts: LossParts, chunk: int | None) -> list[tuple[nn.Module, str, Any]]:
    """``(module, attribute, value)`` triples that make ``model`` compute its loss in chunks of ``chunk`` tokens.

    Built from the attributes as they are now (``apply`` calls it on the restored model).
    """
    head_forward = parts.head.forward
    original: Callable[..., Tensor] = getattr(model, "loss_fn" if parts.hook == "loss_fn" else "loss_function")
    chunked = _chunked_lm_loss if parts.hook == "loss_fn" else _chunked_hf_loss
    loss = functools.partial(chunked, parts.head, original, chunk, head_forward)
    forward = functools.partial(_chunked_forward, parts, model.forward)
    # The model's own signature, not (*args, **kwargs): callers read it (the HF Trainer keeps the dataset's
    # columns the forward names, and passes num_items_in_batch only to a forward that takes **kwargs).
    forward.__signature__ = parts.signature  # type: ignore[attr-defined]
    forward.__doc__ = model.forward.__doc__
    return [
        (model, "forward", forward),
        (parts.head, "forward", functools.partial(_deferring_head, parts.head, head_forward)),
        (model, parts.hook, loss),
    ]


def _chunked_forward(parts: LossParts, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The model's forward; given targets, with the head deferred to the chunked loss and no logits returned."""
    try:
        targets = parts.signature.bind_partial(*args, **kwargs).arguments.get(parts.targets)
    except TypeError:  # arguments the forward does not take: let it say so
        targets = None
    model = getattr(original, "__self__", None)
    if targets is None or not torch.is_grad_enabled() or (isinstance(model, nn.Module) and not model.training):
        return original(*args, **kwargs)  # evaluation and prediction ask for the logits (issue 36)
    deferred = _Deferred(parts.head)
    token = _DEFERRED.set(deferred)
    try:
        out = original(*args, **kwargs)
    finally:
        _DEFERRED.reset(token)
    if not deferred.used:
        raise ConfigError(
            f"chunked loss: the model computed its loss without its {parts.hook} (was it replaced after apply, "
            "e.g. by parallelize?); call parallelize before recompute.apply, or use loss='full'"
        )
    return _without_logits(out, deferred.x)


def _without_logits(out: Any, logits: Any) -> Any:
    """``out`` with None where the deferred head input stands for the logits."""
    if isinstance(out, tuple) and not hasattr(out, "keys"):
        return tuple(None if v is logits else v for v in out)  # (logits, loss), or a return_dict=False tuple
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})  # transformers' ModelOutput


def _deferring_head(head: nn.Module, original: Callable[..., Any], x: Tensor, *args: Any, **kwargs: Any) -> Any:
    """The head: deferred in a chunked forward (its input handed on), itself everywhere else."""
    deferred = _DEFERRED.get()
    if deferred is None or deferred.head is not head or deferred.x is not None:
        return original(x, *args, **kwargs)
    deferred.x = x
    return x


def _take(logits: Tensor, what: str) -> Tensor | None:
    """The deferred head input if ``logits`` is it (marking it used); None outside a chunked forward."""
    deferred = _DEFERRED.get()
    if deferred is None or deferred.x is None or deferred.used:
        return None
    if logits is not deferred.x:
        raise ConfigError(
            f"chunked loss: the model changes the logits between its head and its {what} (soft-capping, "
            "scaling), which the chunks would skip; use loss='full'"
        )
    deferred.used = True
    return logits


def _chunked_lm_loss(
    head: nn.Module,
    original: Callable[..., Tensor],
    chunk: int | None,
    head_forward: Callable[[Tensor], Tensor],
    logits: Tensor,
    targets: Tensor,
    **kw: Any,
) -> Tensor:
    """recompute's ``model.loss_fn(logits, targets)``: the mean over non-ignored targets, chunk by chunk."""
    x = _take(logits, "loss_fn")
    if x is None:
        return original(logits, targets, **kw)
    count = (targets != IGNORE_INDEX).sum()  # the mean's denominator, over the whole batch
    part = functools.partial(_head_loss_share, head_forward, original, count)
    return _head_loss(part, head, x, *_pieces(x, targets, _chunk(chunk, head, targets.numel())))


def _head_loss_share(
    head: Callable[[Tensor], Tensor], loss_fn: Callable[..., Tensor], count: Tensor, x: Tensor, targets: Tensor
) -> Tensor:
    return loss_fn(head(x), targets, reduction="sum") / count


def _chunked_hf_loss(
    head: nn.Module,
    original: Callable[..., Tensor],
    chunk: int | None,
    head_forward: Callable[[Tensor], Tensor],
    logits: Tensor,
    labels: Tensor | None = None,
    vocab_size: int | None = None,
    **kwargs: Any,
) -> Tensor:
    """transformers' ``ForCausalLMLoss`` per chunk: labels shifted as it shifts them, one count for the batch."""
    x = _take(logits, "loss_function")
    if x is None:
        return original(logits, labels, vocab_size, **kwargs)
    ignore = kwargs.pop("ignore_index", IGNORE_INDEX)
    shift = kwargs.pop("shift_labels", None)
    if shift is None:
        assert labels is not None
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]  # (b, s): token i predicts label i + 1
    count = kwargs.pop("num_items_in_batch", None)
    if count is None:
        count = (shift != ignore).sum()  # the mean's denominator, over the whole batch
    chunk_tokens = _chunk(chunk, head, shift.numel())
    part = functools.partial(_hf_head_loss, head_forward, original, vocab_size, count, ignore, kwargs)
    return _head_loss(part, head, x, *_pieces(x, shift.to(x.device), chunk_tokens))


def _hf_head_loss(
    head: Callable[[Tensor], Tensor],
    loss_function: Callable[..., Tensor],
    vocab_size: int | None,
    count: Any,
    ignore: int,
    kwargs: dict[str, Any],
    x: Tensor,
    shift: Tensor,
) -> Tensor:
    return loss_function(
        head(x), None, vocab_size, num_items_in_batch=count, ignore_index=ignore, shift_labels=shift, **kwargs
    )


_REPLACEMENTS = (_chunked_forward, _deferring_head, _chunked_lm_loss, _chunked_hf_loss)
"""The functions the replacements are partials of (``_unwrapped`` sees through them)."""


def _head_loss(
    part: Callable[[Tensor, Tensor], Tensor],
    head: nn.Module,
    x: Tensor,
    split: Callable[[Tensor], tuple[Tensor, ...]],
    targets: tuple[Tensor, ...],
) -> Tensor:
    """The sum of ``part(chunk of x, its targets)`` over the chunks, each chunk's gradients made at once.

    Without autograd (or with nothing to differentiate) a plain loop; else ``_GradientsInForward``.
    """
    params = tuple(p for p in head.parameters() if p.requires_grad)
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return functools.reduce(operator.add, map(part, split(x), targets))
    _check_trainable(head, x)
    return _GradientsInForward.apply(_Chunks(part, split, targets, params), x, *params)  # type: ignore[no-any-return]


def _check_trainable(head: nn.Module, x: Tensor) -> None:
    """Refuse what the gradients taken in the forward cannot serve: fp16, a head whose weights are gathered
    only inside its own forward (ZeRO-3's partitioned parameters)."""
    device = x.device.type
    fp16 = x.dtype == torch.float16 or (
        torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
    )
    require(
        not fp16,
        "chunked loss in fp16: it takes its gradients in the forward, before a loss scaler scales them, and in fp16 "
        "they would underflow; train in bf16 (no scaler needed) or use loss='full'",
    )
    empty = [n for n, p in head.named_parameters() if p.numel() == 0]
    require(
        not empty,
        f"chunked loss: the head's {empty[0] if empty else ''} is empty outside its forward (partitioned, as by "
        "ZeRO-3), and the chunks run the head's forward without its hooks; use loss='full'",
    )


@dataclass(frozen=True)
class _Chunks:
    """What ``_GradientsInForward`` runs: the loss of one chunk, how to cut x, the chunks' targets, the head's
    parameters (also the Function's inputs, after x)."""

    part: Callable[[Tensor, Tensor], Tensor]
    split: Callable[[Tensor], tuple[Tensor, ...]]
    targets: tuple[Tensor, ...]
    params: tuple[Tensor, ...]

    def run(self, x: Tensor) -> tuple[Tensor, list[Tensor | None]]:
        """The loss, and the gradients of x and of each parameter, chunk by chunk.

        Each chunk's head and loss run under autograd from a detached leaf of its rows of x, and
        ``torch.autograd.grad`` takes that little graph's gradients right away; the chunk's logits die with it.
        The gradients of x are written into their rows of one buffer; the parameters' are summed in place.
        autocast is off for the gradients, as for any backward: the forward already chose the dtypes.
        """
        wants_x = x.requires_grad
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if wants_x else None
        grads: list[Tensor | None] = [None] * len(self.params)
        into = self.split(grad_x) if grad_x is not None else (None,) * len(self.targets)
        losses = [
            self._chunk(xc, tc, gc, grads, check=i == 0)
            for i, (xc, tc, gc) in enumerate(zip(self.split(x), self.targets, into))
        ]
        return functools.reduce(operator.add, losses), [grad_x, *grads]

    def _chunk(self, xc: Tensor, tc: Tensor, into: Tensor | None, grads: list[Tensor | None], *, check: bool) -> Tensor:
        """One chunk's loss; its gradient of x written into ``into``, its parameters' added to ``grads``.

        A function of its own so that the chunk's gradients die when it returns: a loop variable would hold
        one (v, h) weight gradient into the next chunk.
        """
        leaf = xc.detach().requires_grad_(into is not None)
        with torch.enable_grad():
            loss = self.part(leaf, tc)
        if check:
            _check_reaches_only(loss, leaf, self.params)
        inputs = (leaf, *self.params) if into is not None else self.params
        with torch.autocast(xc.device.type, enabled=False):
            got = list(torch.autograd.grad(loss, inputs, allow_unused=True))
        if into is not None:
            g = got.pop(0)
            if g is None:  # the head did not read its input
                into.zero_()
            else:
                into.copy_(g)
        for j, g in enumerate(got):
            acc = grads[j]
            if g is not None:
                grads[j] = g if acc is None else acc.add_(g)
        return loss.detach()


class _GradientsInForward(torch.autograd.Function):
    """The chunked head and loss, whose gradients the forward computes and the backward only hands out.

    Note: [gradients in the forward] a loss is where the backward starts, so every chunk's gradient of x and
    of the head's parameters can be taken while its logits are alive, instead of replaying the chunk in the
    backward (Liger-Kernel's fused linear cross-entropy does the same with hand-written kernels). The step's
    FLOPs are the plain loss's: no replay. The backward scales the gradients by the loss's incoming gradient
    in place (1 unless the loss was scaled: gradient accumulation, a loss scaler).
    """

    @staticmethod
    def forward(ctx: Any, chunks: _Chunks, x: Tensor, *params: Tensor) -> Tensor:
        loss, grads = chunks.run(x)
        ctx.grads = grads
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grads = ctx.__dict__.pop("grads", None)  # handed over, not kept: autograd can take them as .grad
        if grads is None:
            raise RuntimeError(
                "chunked loss: its backward ran twice (retain_graph=True?); it hands out the gradients it made "
                "in the forward once: run the forward again, or use loss='full'"
            )
        for g in grads:  # by 1.0 unless the loss was scaled: exact, and no host sync to find out
            if g is not None:
                g.mul_(grad)
        return None, *grads


def _check_reaches_only(loss: Tensor, leaf: Tensor, params: tuple[Tensor, ...]) -> None:
    """Refuse a head or loss whose graph reaches parameters other than the head's: their gradient would be lost."""
    known = {id(leaf), *map(id, params)}
    seen: set[int] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None and id(variable) not in known:
            raise ConfigError(
                f"chunked loss: the head or loss uses a tensor of shape {tuple(variable.shape)} that is not a "
                "parameter of the head, whose gradient the chunks would not hand on; use loss='full'"
            )
        todo.extend(next_node for next_node, _ in node.next_functions)


def _chunk(chunk: int | None, head: nn.Module, tokens: int) -> int:
    """Tokens per chunk for a batch of ``tokens``: ``chunk`` (at most ``tokens``), or the default."""
    if chunk is not None and chunk > tokens:
        raise ConfigError(
            f"loss_chunk {chunk} is more than the {tokens} tokens of this batch (b*s); use loss_chunk <= {tokens}",
            fields=("loss_chunk",),
        )
    weight = getattr(head, "weight", None)
    vocab = getattr(head, "out_features", None) or (weight.shape[0] if weight is not None else 1)
    return loss_chunk_tokens(chunk, int(vocab), tokens)


def _pieces(
    x: Tensor, targets: Tensor, chunk: int
) -> tuple[Callable[[Tensor], tuple[Tensor, ...]], tuple[Tensor, ...]]:
    """How to cut the head input (or a tensor of its shape) into chunks of ``chunk`` tokens, and the chunks'
    targets.

    The head input is (b, s, h) or, under sequence parallelism, this rank's (b, s/t, h) shard, which the
    vocabulary-parallel head gathers over the t ranks: then each rank takes chunk/(bt) of its positions (at
    least one), and the chunk's targets are those positions of every rank's shard, in rank order.
    """
    h = x.size(-1)
    if x.dim() == 3 and targets.dim() == 2 and x.size(1) != targets.size(1):
        b, s_local, s = x.size(0), x.size(1), targets.size(1)
        t = s // s_local
        require(t * s_local == s, f"the head's input holds {s_local} positions, not a share of the {s} targets")
        step = max(1, chunk // (b * t))
        by_rank = targets.reshape(b, t, s_local).split(step, dim=2)
        return (lambda y: y.split(step, dim=1)), tuple(tc.reshape(b, -1) for tc in by_rank)
    goal = targets.reshape(-1)
    require(
        x.numel() // h == goal.numel(),
        f"the head's input holds {x.numel() // h} tokens but there are {goal.numel()} targets; use loss='full'",
    )
    return (lambda y: y.reshape(-1, h).split(chunk)), goal.split(chunk)
