"""Chunked cross-entropy: the output layer and the loss over chunks of tokens, never all the logits at once.

``recompute.apply(model, policy, loss="chunked", loss_chunk=N)`` makes a forward given targets (recompute's
models: ``model(idx, targets)``) or labels (transformers': ``model(input_ids=..., labels=...)``) run the
output layer (the head) and the cross-entropy N tokens at a time, each chunk under non-reentrant
``torch.utils.checkpoint``. A chunk's logits exist while its loss is computed and again while its backward
replays it, so the (b, s, v) logits, their fp32 log-probabilities and their gradients are never alive at
once: one chunk's are. The cost is the head's matmul once more in the backward (2bshv FLOPs) and the
log-softmax replayed. Such a forward returns no logits: ``(None, loss)``, or transformers' output with
``logits=None``; without targets or labels the model runs as it always did.

How: three instance-level replacements, which the next ``apply`` restores (``apply(model, "none")`` too):

- the model's ``forward``: given targets or labels, it runs the original forward with the head deferred,
  then drops the logits from what it returns;
- the head (``lm_head``, or ``get_output_embeddings()``): deferred, it hands its input back unchanged;
- the loss (``model.loss_fn`` of recompute's models, which ``recompute.parallel.parallelize`` makes
  vocabulary-parallel; ``model.loss_function`` of transformers'): handed the head's input, it runs
  head + loss chunk by chunk. A model that changes the logits between its head and its loss (Gemma's
  soft-capping, Cohere's logit scale) is refused at its first forward: the loss would not see the head's
  output.

The loss is the model's own: the mean over the targets that are not ``-100`` (``ignore_index``) of the whole
micro-batch, as ``F.cross_entropy``'s mean. Each chunk gives the sum over its tokens and the sum is divided by
the batch's count once (recompute's models); transformers' loss function is called per chunk with the
chunk's shifted labels (``shift_labels``, labels shifted as it shifts them) and the batch's count
(``num_items_in_batch``, the caller's when given), so its chunks add up to its mean.

Note: [what is bit-exact] the gradient of every logit is the same float as without chunks: softmax minus
the one-hot target times 1/n, with the same 1/n (``F.cross_entropy``'s mean divides by the count as our sum's
division does). The loss value, the head's weight gradient and the hidden states' gradient are sums taken in
another order (chunk by chunk; the weight gradient accumulated over the chunks), equal up to float rounding.
Under tensor parallelism the chunk is gathered over the ranks' sequence shards (N tokens per chunk in all).

Order with other transforms: ``parallelize``, then ``apply``, then ``torch.compile`` (not covered for the
chunked loss) and the optimizer.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

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
    loss = functools.partial(chunked, parts.head, original, chunk)
    forward = functools.partial(_chunked_forward, parts, model.forward)
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
    if targets is None:
        return original(*args, **kwargs)
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
    head: nn.Module, original: Callable[..., Tensor], chunk: int | None, logits: Tensor, targets: Tensor, **kw: Any
) -> Tensor:
    """recompute's ``model.loss_fn(logits, targets)``: the mean over non-ignored targets, chunk by chunk."""
    x = _take(logits, "loss_fn")
    if x is None:
        return original(logits, targets, **kw)
    pieces = _pieces(x, targets, _chunk(chunk, head, targets.numel()))
    part = functools.partial(_head_loss_sum, head, original)
    total = functools.reduce(operator.add, (_checkpointed(part, xc, tc) for xc, tc in pieces))
    return total / (targets != IGNORE_INDEX).sum()


def _head_loss_sum(head: nn.Module, loss_fn: Callable[..., Tensor], x: Tensor, targets: Tensor) -> Tensor:
    return loss_fn(head(x), targets, reduction="sum")


def _chunked_hf_loss(
    head: nn.Module,
    original: Callable[..., Tensor],
    chunk: int | None,
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
    part = functools.partial(_hf_head_loss, head, original, vocab_size, count, ignore, kwargs)
    pieces = _pieces(x, shift.to(x.device), chunk_tokens)
    return functools.reduce(operator.add, (_checkpointed(part, xc, tc) for xc, tc in pieces))


def _hf_head_loss(
    head: nn.Module,
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


def _checkpointed(fn: Callable[..., Tensor], x: Tensor, targets: Tensor) -> Tensor:
    """``fn(x, targets)``, its intermediates replayed in the backward (a plain call when autograd is off).

    No RNG state is kept: a head and a cross-entropy draw no random numbers.
    """
    if not torch.is_grad_enabled():
        return fn(x, targets)
    return checkpoint(fn, x, targets, use_reentrant=False, preserve_rng_state=False)  # type: ignore[no-any-return]


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


def _pieces(x: Tensor, targets: Tensor, chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """(head input, targets) of each chunk of ``chunk`` tokens.

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
        # One split, not slices: its backward joins the chunks' gradients once (a slice's makes a whole zero
        # gradient per chunk).
        yield from ((xc, tc.reshape(b, -1)) for xc, tc in zip(x.split(step, dim=1), by_rank))
        return
    flat, goal = x.reshape(-1, h), targets.reshape(-1)
    require(
        flat.size(0) == goal.numel(),
        f"the head's input holds {flat.size(0)} tokens but there are {goal.numel()} targets; use loss='full'",
    )
    yield from zip(flat.split(chunk), goal.split(chunk))
