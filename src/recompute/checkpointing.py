"""``apply(model, policy)``: switch a recomputation policy on for a model, in place, in one line.

Every region a policy recomputes (a whole layer, its attention or MLP sub-block, its core attention, or the
experts of a mixture-of-experts MLP) gets
an instance-level replacement of the method that runs it (``forward``, or the attention's ``core``) that
calls the original through non-reentrant ``torch.utils.checkpoint``, with a selective-checkpointing context
when the policy lists ops to save and ``save_on_cpu`` when it offloads. Parameters and module names are left
alone, so ``state_dict()`` keys do not change; module hooks stay outside the checkpoint (as in transformers
5), and applying again (``none`` included) first restores every original method.

Note: [experts, not the router] ``experts`` wraps the MLP's child named ``experts`` (transformers 5 calls it as
``experts(hidden_states, top_k_index, top_k_weights)``; a list of expert modules gets each one wrapped). The
router runs outside the checkpoint, so its output is a kept input of the replay: routing cannot change on
replay, and the router is not run a second time. ``mlp`` wraps the whole MoE block, router included (issue 13).

Hugging Face attention modules have no ``core``: for ``core_attn`` the selected modules get a private copy of
their config whose ``_attn_implementation`` names a function registered with transformers'
``AttentionInterface``; it checkpoints the implementation the model was using (eager, sdpa, ...). A class that
does not look its function up there, or tests the name itself (Falcon runs its own eager code unless the name is
``"sdpa"``), would compute something else under the new name: ``core_attn`` is refused for it
(``recompute.models.hf_attention``).

Offloading (``Policy(offload=True)``) moves what each checkpoint keeps (its inputs) to CPU memory with
``save_on_cpu``; with a save-list, the op outputs that selective checkpointing keeps stay where they are (its
cache bypasses saved-tensor hooks). The ``offload`` policy is different: the layer recomputes nothing and keeps
everything it saves, in host memory, copied out during the forward and back one layer ahead in the backward
(``recompute.offload``); its layers' ``forward`` runs under the model's ``Offloader``.

``loss="chunked"`` also makes a forward given targets run the output layer and the loss over chunks of tokens,
each chunk's gradients taken in the forward (``recompute.chunked_loss``), with the same save-and-restore of
instance attributes: the model's ``forward`` (its signature kept), the head's, and the model's loss.

A plan (a ``Plan``, or a file written by ``recompute plan -o``) is made for one model: ``apply`` checks the
model's identity against the plan's (``recompute.models.identity``: the hash of its spec, its transformers
config or its parameters' shapes and classes; so however the model was built) and takes its loss mode and
chunk. Transformers' own gradient checkpointing would replay whole layers on top of the plan: it is refused
when ``apply`` runs, and a forward pre-hook refuses it when it is switched on later (``TrainingArguments(
gradient_checkpointing=True)``, ``gradient_checkpointing_enable()``), at the first training forward after.

Order with other transforms (torchtitan): ``apply``, then ``torch.compile``, then FSDP.

Over 400 lines because ``apply`` is one public step whose parts only it uses: finding the layers, each policy's
regions, the wrappers, transformers' own checkpointing refused, offload and the chunked loss switched with it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.hooks import RemovableHandle

from recompute.chunked_loss import check_loss, chunked_replacements, loss_parts
from recompute.core.errors import ConfigError, require
from recompute.core.identity import require_same_model
from recompute.core.plan_file import Plan, check_plan_dict, plan_loss, read_plan
from recompute.core.policy import ALL_POLICIES, Policy
from recompute.models.hf_attention import swap_changes
from recompute.models.identity import model_identity
from recompute.offload import Offloader

__all__ = ["HF_CHECKPOINTING", "REGIONS", "applied_policy", "apply", "find_layers"]

REGIONS: dict[str, tuple[str, ...]] = {
    "none": (),
    "core_attn": ("core",),
    "attn": ("attn",),
    "mlp": ("mlp",),
    "attn+mlp": ("attn", "mlp"),
    "block": ("block",),
    "experts": ("experts",),
    "offload": ("offload",),
}
"""What each policy wraps in one layer: ``block`` (the layer), ``attn``/``mlp`` (sub-blocks), ``core``,
``experts`` (the MLP's experts child), and ``offload`` (the layer's forward, under saved-tensor hooks)."""

_SAVED = "_recompute_saved"  # per module: {attribute: the instance value it had, or None for the class's}
_OPTIONS = "_recompute_options"  # per module: the _Options its wrapped methods use
_POLICY = "_recompute_policy"  # on the root module: the Policy applied
_INDEX = "_recompute_layer_index"  # per offloaded layer: its index in the layer list
_HOOKS = "_recompute_hooks"  # on the root module: handles of the offloader's and the guard's forward hooks
_HF_IMPL = "recompute_core_attn"  # our name in transformers' AttentionInterface
_ATTN = re.compile(r"attn|attention", re.IGNORECASE)
_MLP = re.compile(r"mlp|ffn|feed_?forward|moe|experts", re.IGNORECASE)


def apply(
    model: nn.Module,
    policy: str | Policy | Plan | Mapping[str, Any] | os.PathLike[str],
    *,
    layers: str | None = None,
    attn: str | None = None,
    mlp: str | None = None,
    loss: str | None = None,
    loss_chunk: int | None = None,
) -> None:
    """Make ``model`` recompute what ``policy`` says, in place; ``none`` restores the plain model.

    Order with other transforms (torchtitan's): ``apply``, then ``torch.compile``, then FSDP2 (``fully_shard``);
    recompute's own tensor parallelism (``recompute.parallel.parallelize``) comes before ``apply``.

    Args:
        model: recompute's ``GPT``/``Llama``, a Hugging Face decoder-only model, or any model with an
            ``nn.ModuleList`` of identical layers (attention and MLP sub-modules needed for all but ``block``).
        policy: a policy name, a ``Policy``, a ``Plan``, or the path of a policy/plan JSON file (or its
            content, as a dict). A plan is checked against the model (the hash of its architecture, however the
            model was built) and brings its loss mode and chunk.
        layers: dotted path of the layer list, when it cannot be found (e.g. ``"transformer.h"``).
        attn, mlp: child names of the attention and MLP sub-modules in a layer, when they cannot be found.
        loss: ``full``, or ``chunked``: a forward given targets (labels) runs the output layer and the loss
            over chunks of tokens, each chunk's gradients taken in the forward, and returns no logits
            (``(None, loss)``; transformers' output with ``logits=None``). See ``recompute.chunked_loss``.
            Default: the plan's loss mode, else ``full``; one that contradicts the plan is refused.
        loss_chunk: tokens per chunk (default: the plan's, else ``recompute.core.workload.default_loss_chunk``,
            the most whose fp32 logits fit 256 MiB, at most the batch's b*s; a larger one is refused at the first
            forward).

    A plan weighed under ``torch.compile`` with a memory budget (``recompute plan --memory-budget``) also sets
    ``torch._functorch.config.activation_memory_budget`` (``set_memory_budget``): compile the model after.

    Raises:
        ConfigError: a plan made for another model or another layer count, a ``loss`` or ``loss_chunk`` the plan
            contradicts, layers or sub-modules that cannot be found, unknown ops to save, Hugging Face's own
            checkpointing switched on (now, or later: at the first training forward); with chunked loss, a
            chunk that is not a positive integer, or a model without a head or loss it can find.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"apply takes the model (a torch.nn.Module) and a policy, got a {type(model).__name__} as the model; "
            "call recompute.apply(model, 'block')"
        )
    pol, planned = _as_plan(policy)
    _check_plan_model(pol, model)
    loss, loss_chunk = _plan_loss(planned, loss, loss_chunk)
    stack = find_layers(model, path=layers)
    names = pol.per_layer(len(stack))
    recomputes = any(n != "none" for n in names)
    if recomputes:
        _refuse_hf_checkpointing(model)
    offloaded = [i for i, n in enumerate(names) if n == "offload"]
    offloader = Offloader(model, offloaded) if offloaded else None
    options = _Options(save=_save_list(pol.save_ops), offload=pol.offload, offloader=offloader)
    targets = [_region_targets(block, name, attn, mlp) for block, name in zip(stack, names)]  # check all first
    chunk = check_loss(loss, loss_chunk)
    parts = loss_parts(model) if loss == "chunked" else None
    _restore(model)
    for index, layer_targets in enumerate(targets):
        for module, method in layer_targets:
            _wrap(module, method, options, index)
    hooks = offloader.watch(stack) if offloader is not None else []
    switches = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    if recomputes and switches:
        hooks.append(_guard_hf_checkpointing(model, switches))
    if hooks:
        model.__dict__[_HOOKS] = hooks
    if parts is not None:
        for module, attribute, value in chunked_replacements(model, parts, chunk):
            _replace(module, attribute, value)
    if pol.memory_budget is not None:
        set_memory_budget(pol.memory_budget)
    setattr(model, _POLICY, pol)


def set_memory_budget(budget: float) -> None:
    """Set ``torch._functorch.config.activation_memory_budget`` for the steps compiled from now on, as
    torchtitan's ``memory_budget`` mode does (a process-wide setting: every model compiled after takes it).

    Raises:
        ConfigError: this PyTorch has no such setting.
    """
    import torch._functorch.config as config

    require(
        hasattr(config, "activation_memory_budget"),
        f"the plan runs under torch.compile's activation_memory_budget {budget:g}, which this PyTorch "
        f"({torch.__version__}) lacks; upgrade to 2.6 or newer, or plan without --memory-budget",
    )
    config.activation_memory_budget = float(budget)


def applied_policy(model: nn.Module) -> Policy | None:
    """The policy ``apply`` last put on ``model``, or ``None``."""
    return getattr(model, _POLICY, None)


# --- finding the layers -----------------------------------------------------------------------------------


def find_layers(model: nn.Module, *, path: str | None = None) -> nn.ModuleList:
    """The model's transformer layers: the ``nn.ModuleList`` of identical blocks holding the most parameters.

    Found by structure, so any decoder-only model with a layer list works (``layers`` in recompute's models,
    ``transformer.h`` in GPT-2, ``model.layers`` in Llama, ...). ``path`` names it explicitly.

    Raises:
        ConfigError: no such list (the message lists the candidates and how to name the right one).
    """
    if path is not None:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(
                f"{path!r} is not an nn.ModuleList in {type(model).__name__}; candidates: {_candidates(model)}"
            )
        return found
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and _is_layer_stack(m)]
    if not stacks:
        raise ConfigError(
            f"found no transformer layers in {type(model).__name__} (an nn.ModuleList of identical blocks with "
            f"parameters); candidates: {_candidates(model)}; name the list with apply(model, policy, layers='<path>')"
        )
    return max(stacks, key=lambda m: sum(p.numel() for p in m.parameters()))


def _is_layer_stack(m: nn.ModuleList) -> bool:
    blocks = list(m.children())
    return bool(blocks) and len({type(b) for b in blocks}) == 1 and all(_has_params(b) for b in blocks)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _candidates(model: nn.Module, limit: int = 8) -> str:
    """Module lists and containers a user might mean, e.g. ``transformer.h (ModuleList of 12 GPT2Block)``."""
    rows = [
        f"{name} ({type(m).__name__} of {len(m)} {type(next(iter(m.children()))).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0
    ]
    rows = rows or [f"{name} ({type(m).__name__})" for name, m in model.named_children()]
    return ", ".join(rows[:limit]) + (f", ... ({len(rows) - limit} more)" if len(rows) > limit else "") or "none"


def _region_targets(block: nn.Module, policy: str, attn: str | None, mlp: str | None) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` pairs to wrap in one layer for ``policy`` (``forward``, ``core`` or ``config``)."""
    targets = []
    for region in REGIONS[policy]:
        if region == "block":
            targets.append((block, "forward"))
        elif region == "offload":
            targets.append((block, "offload"))
        elif region == "mlp":
            targets.append((_sub_block(block, "mlp", attn, mlp), "forward"))
        elif region == "experts":
            targets.extend((e, "forward") for e in _experts(block, attn, mlp))
        else:
            attn_module = _sub_block(block, "attn", attn, mlp)
            if region == "attn":
                targets.append((attn_module, "forward"))
            else:
                has_core = callable(getattr(attn_module, "core", None))
                targets.append((attn_module, "core" if has_core else _hf_core_target(attn_module)))
    return targets


def _sub_block(block: nn.Module, which: str, attn: str | None, mlp: str | None) -> nn.Module:
    """The attention (``which="attn"``) or MLP child of a layer: by name pattern, the MLP also by elimination."""
    children = {n: c for n, c in block.named_children() if _has_params(c)}
    layers = [n for n, c in children.items() if not all(p.dim() == 1 for p in c.parameters())]  # not norms
    attn = attn or _only([n for n in layers if _ATTN.search(n) and "cross" not in n.lower()])
    if which == "mlp":
        rest = [n for n in layers if n != attn]
        mlp = mlp or _only([n for n in rest if _MLP.search(n)]) or (_only(rest) if attn else None)
    name = attn if which == "attn" else mlp
    if name not in children:
        what = "attention" if which == "attn" else "MLP"
        raise ConfigError(
            f"cannot find the {what} sub-module of {type(block).__name__} (one child module); its children are "
            f"{', '.join(dict(block.named_children())) or 'none'}; name it with apply(model, policy, {which}='<child>')"
        )
    return children[name]


def _experts(block: nn.Module, attn: str | None, mlp: str | None) -> list[nn.Module]:
    """The modules that run the experts of a layer's mixture-of-experts MLP (called with the router's output).

    The MLP's ``experts`` child, or each module of a list or dict of experts.
    """
    moe = _sub_block(block, "mlp", attn, mlp)
    experts = getattr(moe, "experts", None)
    if not isinstance(experts, nn.Module):
        raise ConfigError(
            f"the 'experts' policy recomputes the experts of a mixture-of-experts MLP, but {type(moe).__name__} "
            f"in {type(block).__name__} has no 'experts' child (a dense MLP); use 'mlp' for this layer"
        )
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict)):
        return list(experts.children())
    return [experts]


def _only(names: list[str]) -> str | None:
    return names[0] if len(names) == 1 else None


# --- wrapping ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    """How a wrapped region is checkpointed."""

    save: tuple[Any, ...] | None
    """Ops whose outputs selective checkpointing keeps (every overload spelled out), or None for plain AC."""
    offload: bool
    offloader: Offloader | None = None
    """The model's offloader, when some layer takes the ``offload`` policy."""


def _save_list(names: tuple[str, ...] | None) -> tuple[Any, ...] | None:
    """``aten.mm``, ``aten::mm``, ``torch.ops.aten.mm`` or ``aten.mm.default`` -> op overloads to save."""
    if not names:
        return None
    return tuple(op for name in names for op in _resolve_op(name))


def _resolve_op(name: str) -> list[Any]:
    parts = name.removeprefix("torch.ops.").replace("::", ".").split(".")
    try:
        if len(parts) not in (2, 3):
            raise AttributeError(name)
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        overloads = [parts[2]] if len(parts) == 3 else packet.overloads()
        return [getattr(packet, o) for o in overloads]
    except (AttributeError, RuntimeError) as e:
        raise ConfigError(f"{name!r} is not an operator; name ops to save like 'aten.mm' or 'aten.mm.default'") from e


def _wrap(module: nn.Module, method: str, options: _Options, index: int) -> None:
    wrapper = _eager_offloaded_forward() if method == "offload" else _WRAPPERS.get(method)  # none for "config"
    if method == "offload":  # the layer's own forward, run by the offloader
        module.__dict__[_INDEX] = index
        method = "forward"
    module.__dict__[_OPTIONS] = options
    if method == "config":
        _replace(module, method, _hf_local_config(module.config))
    else:
        _replace(module, method, types.MethodType(wrapper, module))  # type: ignore[arg-type]


def _replace(module: nn.Module, attribute: str, value: Any) -> None:
    """Set ``module.attribute``, keeping the value it had for ``_restore`` (its first one, if set twice)."""
    saved = module.__dict__.setdefault(_SAVED, {})
    saved.setdefault(attribute, module.__dict__.get(attribute))
    setattr(module, attribute, value)


def _restore(model: nn.Module) -> None:
    for m in model.modules():
        for name, original in m.__dict__.pop(_SAVED, {}).items():
            if original is None:
                delattr(m, name)
            else:
                setattr(m, name, original)
        m.__dict__.pop(_OPTIONS, None)
        m.__dict__.pop(_INDEX, None)
    for handle in model.__dict__.pop(_HOOKS, ()):
        handle.remove()
    model.__dict__.pop(_POLICY, None)


def _original(module: nn.Module, method: str) -> Callable[..., Any]:
    instance = getattr(module, _SAVED)[method]
    return instance if instance is not None else getattr(type(module), method).__get__(module, type(module))


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run(self, _original(self, "forward"), args, kwargs)


def _checkpointed_core(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _run(self, _original(self, "core"), args, kwargs)


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer's forward with what it saves for the backward in host memory (``recompute.offload``).

    Note: [eager under torch.compile] the layer runs eagerly, a graph break in a compiled model: dynamo traced
    the saved-tensor hooks' Python state into a recursion, and resolved the original forward to this wrapper.
    """
    fn = _original(self, "forward")
    offloader = getattr(self, _OPTIONS).offloader
    if not torch.is_grad_enabled() or offloader is None:
        return fn(*args, **kwargs)
    return offloader.run(self.__dict__[_INDEX], fn, args, kwargs)


_WRAPPERS = {"forward": _checkpointed_forward, "core": _checkpointed_core}


@functools.cache
def _eager_offloaded_forward() -> Callable[..., Any]:
    """``_offloaded_forward`` under ``torch.compiler.disable`` (Note: [eager under torch.compile]), made at the
    first offloaded layer: the decorator imports ``torch._dynamo`` (seconds), which importing this module, or a
    run without offload, need not pay."""
    return torch.compiler.disable(_offloaded_forward)


def _run(module: nn.Module, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``fn`` through non-reentrant checkpoint when autograd records (plain call otherwise)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    options: _Options = getattr(module, _OPTIONS)
    args, kwargs = _without_caches(args, kwargs)
    # Keyword arguments are bound, not passed through: checkpoint reserves some names for itself.
    call = functools.partial(fn, **kwargs) if kwargs else fn
    with _offload(options.offload):
        if options.save is None:
            return checkpoint(call, *args, use_reentrant=False)
        # Built here, not stored: torch.compile accepts a context_fn only as a function or a partial it sees made.
        sac = functools.partial(create_selective_checkpoint_contexts, list(options.save))
        return checkpoint(call, *args, use_reentrant=False, context_fn=sac)


def _without_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Drop key/value caches: replaying a layer would append its keys and values to the cache a second time."""
    args = tuple(None if _is_cache(a) else a for a in args)
    kwargs = {k: None if _is_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _is_cache(x: Any) -> bool:
    return callable(getattr(x, "get_seq_length", None)) and callable(getattr(x, "update", None))


def _offload(on: bool) -> contextlib.AbstractContextManager[Any]:
    """Keep the checkpoint's saved inputs in (pinned, when there is a GPU) CPU memory until the backward."""
    if not on:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


# --- policies, plans and Hugging Face specifics -----------------------------------------------------------


PlanLoss = tuple[str, int | None]
"""A plan's loss mode and chunk."""


def _as_plan(policy: str | Policy | Plan | Mapping[str, Any] | os.PathLike[str]) -> tuple[Policy, PlanLoss | None]:
    """The policy, and the loss mode and chunk when it comes from a plan (a ``Plan``, a plan file or its content)."""
    if isinstance(policy, Plan):
        return policy.policy, (policy.loss, policy.loss_chunk)
    if isinstance(policy, Policy):
        return policy, None
    if isinstance(policy, Mapping):
        check_plan_dict(policy)
        return Policy.from_dict(dict(policy)), plan_loss(policy)
    if isinstance(policy, str) and policy in ALL_POLICIES:
        return Policy(policy), None
    if isinstance(policy, (str, os.PathLike)):
        text = os.fspath(policy)
        if text.endswith(".json") or os.path.isfile(text):
            return read_plan(text)
        return Policy.parse(text), None  # says which names exist
    raise ConfigError(f"expected a policy name, a Policy, a Plan or a plan file path; got {type(policy).__name__}")


def _plan_loss(planned: PlanLoss | None, loss: str | None, chunk: int | None) -> tuple[str, int | None]:
    """The loss mode and chunk to apply: the plan's, which ``loss``/``loss_chunk`` may repeat but not contradict."""
    if planned is None:
        return loss or "full", chunk
    mode, planned_chunk = planned
    if loss is not None and loss != mode:
        raise ConfigError(
            f"the plan was made with loss={mode!r} but apply was given loss={loss!r}; drop loss= (apply takes the "
            f"plan's), or make a plan with --loss {loss}",
            fields=("loss",),
        )
    if chunk is not None and planned_chunk is not None and chunk != planned_chunk:
        raise ConfigError(
            f"the plan was made with loss_chunk={planned_chunk} but apply was given loss_chunk={chunk}; drop "
            f"loss_chunk= (apply takes the plan's), or make a plan with --loss-chunk {chunk}",
            fields=("loss_chunk",),
        )
    return mode, chunk if chunk is not None else planned_chunk


def _check_plan_model(pol: Policy, model: nn.Module) -> None:
    """Refuse a plan made for another model: the hashes of both architectures compared (``ModelId``); names
    compared loosely for a plan without a hash (``meta-llama/Llama-3.1-8B`` = ``llama3.1-8b``; a transformers
    model without a hub name by its ``model_type``)."""
    want = pol.model
    if want is None:
        return
    if want.hash:
        require_same_model(want, model_identity(model))
        return
    spec = getattr(model, "spec", None)
    config = getattr(model, "config", None)
    name = str(getattr(spec, "name", "")) if spec is not None else str(getattr(config, "name_or_path", "") or "")
    family = "" if spec is not None else str(getattr(config, "model_type", "") or "")
    squashed = _squash(want.name)
    if (name and squashed != _squash(name)) or (not name and family and not squashed.startswith(_squash(family))):
        raise ConfigError(
            f"the plan was made for {want.name!r} but this model is {name or family!r}; "
            "make a plan for this model, or drop the plan's 'model' field"
        )


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.rsplit("/", 1)[-1].lower())


HF_CHECKPOINTING = (
    "transformers' activation (gradient) checkpointing is on together with a recompute plan, and would replay whole "
    "layers on top of it; turn it off (TrainingArguments(activation_checkpointing=False), gradient_checkpointing="
    "False in older transformers; model.activation_checkpointing_disable() or gradient_checkpointing_disable()): "
    "the plan decides what is recomputed"
)
"""The refusal of transformers' own checkpointing together with a plan."""


def _hf_checkpointing_on(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _refuse_hf_checkpointing(model: nn.Module) -> None:
    if _hf_checkpointing_on(model):
        raise ConfigError(HF_CHECKPOINTING)


def _guard_hf_checkpointing(model: nn.Module, switches: list[nn.Module]) -> RemovableHandle:
    """A forward pre-hook that refuses transformers' checkpointing switched on after ``apply``, at the first
    training forward (``switches``: the modules that carry its ``gradient_checkpointing`` flag)."""

    def guard(module: nn.Module, args: Any) -> None:
        if module.training and any(m.gradient_checkpointing for m in switches):
            raise ConfigError(HF_CHECKPOINTING)

    return model.register_forward_pre_hook(guard)


def _hf_core_target(attn: nn.Module) -> str:
    """Check that ``attn`` dispatches through transformers' AttentionInterface; the attribute to wrap."""
    config = _hf_config(attn)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError(
            f"core_attn needs the attention module to have a core(q, k, v) method or a Hugging Face config; "
            f"{type(attn).__name__} has neither; use the 'attn' policy instead"
        )
    why = swap_changes(attn, config._attn_implementation, _HF_IMPL)
    if why is not None:
        raise ConfigError(f"core_attn cannot apply to {type(attn).__name__}: {why}; use the 'attn' policy instead")
    _hf_attention_function(attn, config._attn_implementation)  # fails now, not in the forward
    from transformers import AttentionInterface

    AttentionInterface.register(_HF_IMPL, _hf_core_attention)
    return "config"


def _hf_local_config(config: Any) -> Any:
    local = copy.deepcopy(config)  # deep: the setter also rewrites sub-configs, which a shallow copy shares
    local._attn_implementation = _HF_IMPL
    return local


def _hf_config(attn: nn.Module) -> Any:
    """The attention module's own config (not the copy ``apply`` may have given it)."""
    return attn.__dict__.get(_SAVED, {}).get("config") or getattr(attn, "config", None)


def _hf_core_attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The AttentionInterface entry: run the model's own attention function under checkpoint."""
    impl = getattr(module, _SAVED)["config"]._attn_implementation
    return _run(module, _hf_attention_function(module, impl), (module, *args), kwargs)


def _hf_attention_function(module: nn.Module, impl: str | None) -> Callable[..., Any]:
    if impl in (None, "eager"):
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ConfigError(
                f"{type(module).__name__} uses eager attention but its module has no eager_attention_forward; "
                "use the 'attn' policy instead"
            )
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _iter_wrapped(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(module, attribute) pairs ``apply`` has replaced; for tests and debugging."""
    for m in model.modules():
        for name in m.__dict__.get(_SAVED, {}):
            yield m, name
