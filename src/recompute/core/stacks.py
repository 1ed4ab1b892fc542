"""The training stacks' recomputation settings, as per-layer assignments of recompute's options.

Each stack lists every setting it can say for a model's cost table (its ``settings``), what each amounts to per
layer (in recompute's options, so the plan's table prices it), and writes a setting in its own format. Read
from the stacks' code (the releases named in ``source``; docs/export.md quotes the lines):

- torchtitan v0.2.2 (73a0e69): ``ActivationCheckpoint`` in torchtitan/config/job_config.py (``mode`` none,
  full, selective or memory_budget; ``selective_ac_option`` a string, ``"op"`` or digits; the TOML values are
  passed to the dataclass as they are, ``ConfigManager._dict_to_dataclass``) and
  torchtitan/distributed/activation_checkpoint.py (``_apply_layer_sac``: a counter from 1, so ``"k"`` wraps
  layers k-1, 2k-1, ...; ``apply_ac``).
- Megatron-LM core_v0.19.0 (5be9626): ``recompute_granularity``, ``recompute_method``,
  ``recompute_num_layers``, ``recompute_modules`` in megatron/core/transformer/transformer_config.py, made
  flags by ``ArgumentGroupFactory(TransformerConfig)`` in megatron/training/arguments.py; their semantics in
  megatron/core/recompute.py (``uniform``: chunks of N layers, each replayed whole from its input; ``block``:
  the first N layers of each pipeline stage, one by one) and transformer_layer.py (``mlp``: the dense MLP from
  the pre-MLP norm's output; MoE layers are left alone).
- transformers 5.24.0 (installed): ``TrainingArguments.activation_checkpointing`` and
  ``activation_checkpointing_kwargs`` (``gradient_checkpointing*`` their deprecated aliases), popped by
  ``Trainer`` into ``every_n_layers`` and ``offload``; ``PreTrainedModel._set_gradient_checkpointing``
  checkpoints decoder layer i when ``i % every_n_layers == 0``.
- Lightning 2.6.5 (be98784): ``FSDPStrategy(activation_checkpointing_policy=...)``, a set of module classes
  made a ``ModuleWrapPolicy`` for torch's ``apply_activation_checkpointing`` (src/lightning/fabric/strategies/
  fsdp.py); ``ModelParallelStrategy`` takes none. Torch-free.

Over 400 lines because the four stacks' vocabularies (settings, the file each writes, the notes) are read
together: one stack's words for an option are checked against the others' in docs/export.md.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from recompute.core.costs import CostTable, KindCosts

__all__ = ["STACKS", "Setting", "Stack", "runs"]


@dataclass(frozen=True)
class Setting:
    """One setting of a stack: in its words, and the options it gives the first pipeline stage's layers."""

    label: str
    """The setting as the stack writes it, in short."""
    values: dict[str, Any]
    """The stack's own keys and values (a TOML section's, flags', keyword arguments')."""
    layers: tuple[str, ...]
    """What it amounts to, one recompute option per layer of the stage."""


@dataclass(frozen=True)
class Stack:
    """A training stack's vocabulary for recomputation (subclasses fill the hooks)."""

    name: str
    source: str
    suffix: str
    words: dict[str, str]
    """recompute option -> what the stack calls it, for the options it can say."""
    shapes: str
    """Which layers it can put them on, in words."""
    missing: dict[str, str] = field(default_factory=dict)
    """recompute option -> what the stack has instead (or that it has nothing)."""
    chunked: str = "no counterpart"
    """What the stack has for the chunked loss."""
    loss: str = "full"
    """The loss mode its settings run: none of the stacks has recompute's chunked loss."""

    def settings(self, table: CostTable) -> list[Setting]:
        raise NotImplementedError

    def body(self, setting: Setting, table: CostTable) -> list[str]:
        raise NotImplementedError

    def notes(self, table: CostTable) -> list[str]:
        return []

    def exact(self, plan_file: str, chunked: bool, memory_budget: float | None = None) -> list[str]:
        """The comment lines that run the plan exactly, whatever the stack can say."""
        chunk = ', loss="chunked"' if chunked else ""
        line = f"recompute.apply(model, {json.dumps(plan_file)}{chunk})"
        if memory_budget is not None:
            line += f", then torch.compile (apply sets activation_memory_budget = {memory_budget:g})"
        return [f"exact in any stack, with its own checkpointing off: {line}"]

    def why_not(self, layers: Sequence[str], loss: str, placed: bool) -> list[str]:
        """Why no setting of the stack is the plan: the loss, an option it has no word for, or the layers
        (``placed``: some setting gives the layers the plan's options)."""
        reasons = [f"it has no chunked loss ({self.chunked})"] if loss == "chunked" else []
        unknown = [o for o in dict.fromkeys(layers) if o != "none" and o not in self.words]
        reasons += [f"it has no {o} ({self.missing.get(o, 'no counterpart')})" for o in unknown]
        if not placed and not unknown:
            reasons.append(f"it cannot place {runs(layers)}: it takes {self.shapes}")
        return reasons


def runs(layers: Sequence[str]) -> str:
    """``block x16 (every 2nd layer, 0-30), none x16 (every 2nd layer, 1-31)``: an assignment by option."""
    out = []
    for name in dict.fromkeys(layers):
        at = [i for i, o in enumerate(layers) if o == name]
        out.append(f"{name} x{len(at)} ({_where(at, len(layers))})")
    return ", ".join(out)


def _where(at: list[int], n: int) -> str:
    if len(at) == n:
        return "every layer"
    if len(at) == 1:
        return f"layer {at[0]}"
    steps = {b - a for a, b in itertools.pairwise(at)}
    if steps == {1}:
        return f"layers {at[0]}-{at[-1]}"
    if len(steps) == 1:
        k = steps.pop()
        return f"every {_nth(k)} layer, {at[0]}-{at[-1]}"
    spans: list[list[int]] = []
    for i in at:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return "layers " + ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _all(table: CostTable, option: str) -> tuple[str, ...]:
    return (option,) * table.n


def _is_moe(kind: KindCosts) -> bool:
    """A mixture-of-experts layer: the analytic table's ``MoE layer``, or a profiled kind that takes ``experts``."""
    return kind.name == "MoE layer" or "experts" in kind.options


def _chunks(table: CostTable) -> int:
    """Layers of one model chunk of the stage (the stage's, unless interleaved into equal chunks)."""
    m = int(table.workload.get("interleave", 1) or 1)
    return table.n // m if m > 1 and table.n % m == 0 else table.n


@dataclass(frozen=True)
class TorchTitan(Stack):
    def settings(self, table: CostTable) -> list[Setting]:
        n = table.n
        out = [
            Setting('mode = "none"', {"mode": "none"}, _all(table, "none")),
            Setting('mode = "full"', {"mode": "full"}, _all(table, "block")),
        ]
        for k in range(2, n + 1):  # torchtitan's counter starts at 1: layer i is wrapped when (i + 1) % k == 0
            layers = tuple("block" if (i + 1) % k == 0 else "none" for i in range(n))
            values = {"mode": "selective", "selective_ac_option": str(k)}
            out.append(Setting(f'mode = "selective", selective_ac_option = "{k}"', values, layers))
        return out

    def body(self, setting: Setting, table: CostTable) -> list[str]:
        return ["[activation_checkpoint]", *(f'{key} = "{value}"' for key, value in setting.values.items())]

    def notes(self, table: CostTable) -> list[str]:
        return [
            'torchtitan counts layers from 1: selective_ac_option = "k" recomputes layers k-1, 2k-1, ... of each '
            'stage (recompute\'s block:every=k: layers 0, k, 2k, ...); leaving mode out means selective "2"',
            'not priced (no cost in recompute\'s tables): selective_ac_option = "op" (per-op SAC: saves matmul '
            "outputs but every second one, attention's output and collectives; replays the rest of every layer) "
            'and mode = "memory_budget" (torch.compile\'s partitioner)',
            "offload: no counterpart (training.enable_cpu_offload moves FSDP's parameters, gradients and optimizer "
            "state, not activations); chunked loss: no counterpart",
        ]


@dataclass(frozen=True)
class Megatron(Stack):
    def settings(self, table: CostTable) -> list[Setting]:
        n, chunk = table.n, _chunks(table)
        moe = [_is_moe(table.kind_of(i)) for i in range(n)]
        out = [
            Setting("(no --recompute-* flags)", {}, _all(table, "none")),
            Setting(
                "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
                _all(table, "block"),
            ),
        ]
        for count in range(1, chunk):  # block: the first N layers of each pipeline stage (model chunk)
            values = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": count}
            layers = tuple("block" if i % chunk < count else "none" for i in range(n))
            out.append(Setting(" ".join(_flags(values)), values, layers))
        modules: list[tuple[list[str], tuple[str, ...]]] = [
            (["core_attn"], _all(table, "core_attn")),
            (["mlp"], tuple("none" if m else "mlp" for m in moe)),
        ]
        if any(moe):  # "moe" recomputes an MoE layer's MLP part whole, as recompute's mlp does there
            modules += [(["moe"], tuple("mlp" if m else "none" for m in moe)), (["mlp", "moe"], _all(table, "mlp"))]
        for names, layers in modules:
            if set(layers) != {"none"}:
                values = {"recompute_granularity": "selective", "recompute_modules": names}
                out.append(Setting(" ".join(_flags(values)), values, layers))
        return out

    def body(self, setting: Setting, table: CostTable) -> list[str]:
        return [" ".join(_flags(setting.values))] if setting.values else ["# (none: recompute nothing)"]

    def notes(self, table: CostTable) -> list[str]:
        chunk = _chunks(table)
        per = f" ({chunk} per model chunk)" if chunk != table.n else ""
        return [
            f"block's N counts the layers of each pipeline stage{per} from its first; selective recomputes its "
            "modules in every layer (recompute_method and recompute_num_layers must stay unset)",
            "not priced (no cost in recompute's tables): --recompute-method uniform with N > 1 (N layers replayed "
            "as one, only every N-th input kept), several --recompute-modules at once (but mlp moe), and the "
            "modules layernorm, moe_act, mla_up_proj, shared_experts, gdn_norm_out",
            "offload: no per-layer counterpart (--fine-grained-activation-offloading --offload-modules moves module "
            "inputs; cpu_offloading is no flag in this release, and refuses recomputation and pipelining); "
            "chunked loss: no counterpart (--cross-entropy-loss-fusion fuses the loss but keeps the logits)",
        ]


def _flags(values: dict[str, Any]) -> list[str]:
    out = []
    for key, value in values.items():
        words = value if isinstance(value, list) else [value]
        out.append(" ".join(["--" + key.replace("_", "-"), *(str(w) for w in words)]))
    return out


@dataclass(frozen=True)
class HF(Stack):
    """``TrainingArguments``; under FSDP (``--fsdp``) FSDP's own checkpointing, ``fsdp_config``'s: the argument
    ``activation_checkpointing`` there adds an all-gather to the backward, and transformers warns against it."""

    def settings(self, table: CostTable) -> list[Setting]:
        if _fsdp(table):  # accelerate wraps every decoder layer (transformer_layer_cls_to_wrap): all or none
            return [
                Setting(f"fsdp_config={{'activation_checkpointing': {on}}}", _fsdp_values(on), _all(table, option))
                for on, option in ((False, "none"), (True, "block"))
            ]
        out = [Setting("activation_checkpointing=False", {"activation_checkpointing": False}, _all(table, "none"))]
        for k in range(1, table.n + 1):  # _set_gradient_checkpointing: layer i when i % every_n_layers == 0
            kwargs: dict[str, Any] = {"use_reentrant": False} | ({"every_n_layers": k} if k > 1 else {})
            layers = tuple("block" if i % k == 0 else "none" for i in range(table.n))
            label = "activation_checkpointing=True" + (f", every_n_layers={k}" if k > 1 else "")
            out.append(
                Setting(label, {"activation_checkpointing": True, "activation_checkpointing_kwargs": kwargs}, layers)
            )
        return out

    def body(self, setting: Setting, table: CostTable) -> list[str]:
        args = [f"    {key}={value!r}," for key, value in setting.values.items()]
        lines = [
            "from transformers import TrainingArguments",
            "",
            "args = TrainingArguments(",
            '    output_dir="out",  # and the rest of your arguments',
            *args,
            ")",
        ]
        if _fsdp(table):
            return lines
        old = ", ".join(f"{key.replace('activation', 'gradient')}={value!r}" for key, value in setting.values.items())
        return [*lines, f"# transformers before the rename to activation_checkpointing (aliases until v6): {old}"]

    def exact(self, plan_file: str, chunked: bool, memory_budget: float | None = None) -> list[str]:
        loss = ", the plan's chunked loss included" if chunked else ""
        budget = (
            [f"  (the callback sets torch.compile's activation_memory_budget = {memory_budget:g}: torch_compile=True)"]
            if memory_budget is not None
            else []
        )
        return [
            f"exact{loss}, with transformers' and FSDP's checkpointing off: the plan's callback",
            "  from recompute.integrations.hf import RecomputeCallback",
            f"  trainer = Trainer(model=model, args=args, train_dataset=train_dataset, "
            f"callbacks=[RecomputeCallback({json.dumps(plan_file)})])",
            *budget,
        ]

    def notes(self, table: CostTable) -> list[str]:
        if _fsdp(table):
            return [
                "under FSDP, FSDP's own checkpointing (fsdp_config) wraps every decoder layer or none; the "
                "activation_checkpointing argument would add an all-gather to each layer's backward (transformers "
                "issue 30404)",
                "chunked loss: no counterpart in TrainingArguments; use_liger_kernel=True is close, not priced here",
            ]
        return [
            "every_n_layers (transformers PR #48200) counts the decoder layers from 0, as recompute's "
            "block:every=k; without it (older releases) only every layer or none",
            "not priced: activation_checkpointing_kwargs offload=True (the checkpointed layers' inputs in pinned "
            "host memory, PR #48444; recompute's offload keeps a whole layer's saved tensors there instead)",
            "chunked loss: no counterpart in TrainingArguments; use_liger_kernel=True (Liger's fused linear "
            "cross-entropy, the liger-kernel package, for the architectures it patches) avoids the logits too, "
            "not priced here",
            "under FSDP (TrainingArguments fsdp=True) plan with --fsdp: checkpointing then goes in fsdp_config",
        ]


def _fsdp(table: CostTable) -> bool:
    return bool(table.workload.get("fsdp", False))


def _fsdp_values(on: bool) -> dict[str, Any]:
    return {"fsdp": True, "fsdp_config": {"activation_checkpointing": on}}


@dataclass(frozen=True)
class Lightning(Stack):
    def settings(self, table: CostTable) -> list[Setting]:
        layer, attn, mlp = _classes(table)
        out = [Setting("FSDPStrategy()", {}, _all(table, "none"))]
        for option, names in (("block", layer), ("attn", attn), ("mlp", mlp), ("attn+mlp", [*attn, *mlp])):
            label = f"activation_checkpointing_policy={{{', '.join(names)}}}"
            out.append(Setting(label, {"activation_checkpointing_policy": names}, _all(table, option)))
        return out

    def body(self, setting: Setting, table: CostTable) -> list[str]:
        names = setting.values.get("activation_checkpointing_policy")
        if not names:
            return ["from lightning.pytorch.strategies import FSDPStrategy", "", "strategy = FSDPStrategy()"]
        wanted = "{" + ", ".join(json.dumps(n) for n in names) + "}"
        return [
            "from lightning.pytorch.strategies import FSDPStrategy",
            "",
            f"# {_where_classes(table)}",
            "# the classes taken by name from your model (model: the module you train, a LightningModule or the",
            "# network inside it), so that no import of your model's module is needed",
            f"names = {wanted}",
            "policy = {type(m) for m in model.modules() if type(m).__name__ in names}",
            "missing = names - {c.__name__ for c in policy}",
            "if missing:",
            '    raise ValueError(f"the model has no module of class {sorted(missing)}: name its classes in names")',
            "strategy = FSDPStrategy(activation_checkpointing_policy=policy)",
        ]

    def notes(self, table: CostTable) -> list[str]:
        return [
            "a set of classes checkpoints every module of each class, so only the same option on every layer; "
            "a callable activation_checkpointing_policy (torch's auto-wrap policy) can pick modules one by one",
            "ModelParallelStrategy takes no policy: apply the plan in configure_model, before fully_shard",
            "core_attn: no module to name (attention's core is a function call inside the attention module); "
            "offload: no counterpart (FSDPStrategy(cpu_offload=True) moves parameters); chunked loss: no counterpart",
        ]


_CLASS = re.compile(r"[A-Z][A-Za-z0-9_]*")


def _classes(table: CostTable) -> tuple[list[str], list[str], list[str]]:
    """The layer, attention and MLP classes of a profiled model (``LlamaDecoderLayer, LlamaMLP`` names its kind;
    the attention class by transformers' naming), else placeholders."""
    layer: dict[str, None] = {}
    attn: dict[str, None] = {}
    mlp: dict[str, None] = {}
    for kind in table.kinds:
        parts = [p.strip() for p in kind.name.split(",")]
        if not _CLASS.fullmatch(parts[0]):
            return ["DecoderLayer"], ["Attention"], ["MLP"]
        layer[parts[0]] = None
        mlp_class = parts[-1] if len(parts) > 1 and _CLASS.fullmatch(parts[-1]) else "MLP"
        if "DecoderLayer" in parts[0]:
            attn[parts[0].replace("DecoderLayer", "Attention")] = None
        else:
            attn[_OWN_ATTENTION.get(mlp_class, "Attention") if parts[0] == "Block" else "Attention"] = None
        mlp[mlp_class] = None
    return list(layer), list(attn), list(mlp)


_OWN_ATTENTION = {"SwiGLU": "GroupedQueryAttention", "GeluMLP": "CausalSelfAttention"}
"""recompute's own models (``recompute.models``): a ``Block``'s attention class by its MLP's."""


def _where_classes(table: CostTable) -> str:
    layer, attn, _ = _classes(table)
    if layer == ["DecoderLayer"]:
        return "DecoderLayer, Attention, MLP: your model's layer class and its attention and MLP sub-module classes"
    if layer == ["Block"]:
        return f"Block, {', '.join(attn)}: recompute.models' classes, as profiled"
    return f"{', '.join(layer)} from the profile; {', '.join(attn)} by transformers' naming: check the attention class"


STACKS: dict[str, Stack] = {
    "torchtitan": TorchTitan(
        name="torchtitan",
        source="v0.2.2, torchtitan/config/job_config.py [activation_checkpoint]",
        suffix="toml",
        words={"block": 'mode = "full"'},
        shapes='every layer (mode = "full") or layers k-1, 2k-1, ... (selective_ac_option = "k")',
        missing={"offload": "no activation offload", "core_attn": 'selective_ac_option = "op" is per-op, not this'},
    ),
    "megatron": Megatron(
        name="megatron",
        source="Megatron-LM core_v0.19.0, --recompute-* of TransformerConfig",
        suffix="args",
        words={"block": "full", "core_attn": "selective core_attn", "mlp": "selective mlp"},
        shapes="whole layers on the first N of each stage or on all, or one module on every layer",
        missing={
            "attn": "core_attn leaves the projections' inputs saved",
            "attn+mlp": "core_attn mlp leaves the projections' inputs saved",
            "offload": "no per-layer activation offload flag",
        },
    ),
    "hf": HF(
        name="hf",
        source="transformers 5.24 TrainingArguments",
        suffix="py",
        words={"block": "activation_checkpointing"},
        shapes="whole layers, on every layer or layers 0, k, 2k, ... (every_n_layers); under FSDP every layer or none",
        missing={"offload": "offload=True keeps the checkpointed layers' inputs on the host, not this"},
        chunked="use_liger_kernel=True is close, not priced",
    ),
    "lightning": Lightning(
        name="lightning",
        source="Lightning 2.6.5 FSDPStrategy",
        suffix="py",
        words={"block": "layer class", "attn": "attention class", "mlp": "MLP class", "attn+mlp": "both classes"},
        shapes="one option on every layer (a set of module classes)",
        missing={"core_attn": "no module to name", "offload": "no activation offload"},
    ),
}
"""The stacks ``export`` writes for, by the name ``--export`` takes."""
