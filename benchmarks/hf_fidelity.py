"""The analytic model, the trace and recompute's policies against transformers' own classes.

Two sweeps (``python benchmarks/hf_fidelity.py [--classes]``):

1. **Published sizes** (default): for each zoo architecture at its published size, parameters of the class (built
   on the meta device) against the analytic count, and per-layer saved bytes under ``none`` of the real class (its
   trace on fake tensors, the class cut to three layers: per-layer figures do not depend on the layer count)
   against the analytic model and against the profile (``recompute profile``), at s = 1024 and 4096, SDPA
   ("flash") and eager attention, b = 1, bf16. Layer 0 also keeps what the layers share (rotary tables) and is
   reported apart from layers 1-2. Targets (issue 13): analytic within 3 % of the real class for dense
   architectures and 5 % for MoE at expected routing; profile and trace equal. Writes
   benchmarks/results/hf_fidelity.json.

2. **Every class** (``--classes``, issue 28): every ``model_type`` of transformers'
   ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Encoder-only, encoder-decoder and multimodal ones are refused by
   recompute (``--model`` builds decoder-only causal LMs), with the reason. Each other class is built from its
   config class's defaults: its parameters on the meta device against recompute's (a trace of 2 and 3 layers
   scaled to all of them, run by run of alike layers; the analytic count where ``--analytic`` covers the type).
   Then a copy shrunk to a few layers and a small hidden size (``shrunk``), run here on the CPU: per-layer saved
   bytes of the trace against a real step's (the distinct storages its saved tensors keep alive, each once, no
   weights), and the gradients under every policy against the plain model's (``recompute verify``: bit for bit,
   or the policy refused in one line). A class is exact, refused (why), off (by how much) or not checked (the
   shrunk copy cannot be built or run: why). Writes benchmarks/results/hf_classes.json; the table in
   docs/validation.md is ``--table``'s output. ``--only llama,phi3`` checks a few; tests/test_hf_classes.py runs a
   handful in CI.

    python benchmarks/hf_fidelity.py [--no-profile]
    python benchmarks/hf_fidelity.py --classes [--only TYPES] [--table]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import transformers
from published import MODELS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from recompute import Workload
from recompute.check_gradients import verify
from recompute.checkpointing import find_layers
from recompute.core.analytic import layer_activations, n_params
from recompute.core.errors import ConfigError, first_line
from recompute.core.policy import ALL_POLICIES
from recompute.core.spec import spec_from_config
from recompute.models.source import BuiltModel, ModelSource, build_source
from recompute.trace import profile, trace

MOE = {"mixtral", "qwen3_moe"}
SEQS = (1024, 4096)
ATTENTIONS = ("flash", "eager")
CUT = 3
RESULTS = Path(__file__).parent / "results"


def cut(raw: dict[str, Any]) -> dict[str, Any]:
    """The config with three layers (``num_hidden_layers`` or GPT-2's ``n_layer``)."""
    key = "n_layer" if "n_layer" in raw else "num_hidden_layers"
    return {**raw, key: CUT, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def true_parameters(raw: dict[str, Any]) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    return int(model.num_parameters())


def layer_row(name: str, raw: dict[str, Any], wl: Workload, with_profile: bool) -> dict[str, Any]:
    source = ModelSource.from_config(cut(raw), name=name)
    result = trace(source, wl, "none")
    real = [layer.total for layer in result.layers]
    spec = spec_from_config(cut(raw))
    analytic = [layer_activations(spec, wl, i).stored("none") for i in range(CUT)]
    row: dict[str, Any] = {
        "seq_len": wl.seq_len,
        "attention": wl.attention,
        "notes": [n for n in result.notes if "eager" in n],
        "real": real,
        "analytic": analytic,
        "analytic_error": [a / r - 1 for a, r in zip(analytic, real)],
    }
    if with_profile:
        prof = profile(source, wl)
        row["profile"] = [prof.base_kept[0], *(prof.kind_of(i).kept["none"] for i in range(1, CUT))]
        row["profile_minus_real"] = [p - r for p, r in zip(row["profile"], real)]
        row["profile_seconds"] = prof.seconds
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-profile", action="store_true", help="skip the profile column (it takes minutes)")
    parser.add_argument("--classes", action="store_true", help="check every causal-LM class transformers ships")
    parser.add_argument("--only", help="with --classes: these model_types only (comma-separated)")
    parser.add_argument("--table", action="store_true", help="with --classes: print the docs table of the results")
    parser.add_argument("--wide", action="store_true", help="with --classes: the exact ones near published width")
    parser.add_argument("--seq-len", type=int, default=256, help="with --wide: the sequence length")
    parser.add_argument("--check", metavar="TYPE", help=argparse.SUPPRESS)  # one class, in a child process
    parser.add_argument("--check-wide", nargs=2, metavar=("TYPE", "S"), help=argparse.SUPPRESS)  # --wide's child
    args = parser.parse_args()
    import hf_wide  # here: it imports this module's checks

    if args.check:
        check_main(args.check)
    elif args.check_wide:
        torch.set_num_threads(2)
        hf_wide.check_wide_main(args.check_wide[0], int(args.check_wide[1]))
    elif args.classes and args.wide:
        hf_wide.wide_main(args.only.split(",") if args.only else None, args.seq_len, table_only=args.table)
    elif args.classes:
        classes_main(args.only.split(",") if args.only else None, table_only=args.table)
    else:
        published_main(args.no_profile)


def published_main(no_profile: bool) -> None:
    start = time.perf_counter()
    rows = []
    for name, raw in MODELS.items():
        entry: dict[str, Any] = {"model": name, "model_type": raw["model_type"], "moe": raw["model_type"] in MOE}
        try:
            entry["parameters"] = true_parameters(raw)
            entry["analytic_parameters"] = n_params(spec_from_config(raw))
            limit = raw.get("max_position_embeddings") or raw.get("n_positions")
            entry["layers"] = [
                layer_row(name, raw, Workload(seq_len=s, micro_batch=1, dtype="bf16", attention=a, device="cpu"),
                          with_profile=not no_profile and s == SEQS[0] and a == "flash")
                for s in SEQS
                for a in ATTENTIONS
                if limit is None or s <= limit
            ]  # fmt: skip
        except ConfigError as e:
            entry["error"] = str(e)
        rows.append(entry)
        print(summary(entry), flush=True)
    command = "python benchmarks/hf_fidelity.py" + (" --no-profile" if no_profile else "")
    write(RESULTS / "hf_fidelity.json", command, start, rows)


def write(path: Path, command: str, start: float, rows: list[dict[str, Any]]) -> None:
    path.write_text(
        json.dumps(
            {
                "command": command,
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "machine": platform.platform(),
                "seconds": time.perf_counter() - start,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")


def summary(entry: dict[str, Any]) -> str:
    """One line per model: parameters, the worst analytic error on layers 1-2, the profile's difference."""
    if "error" in entry:
        return f"{entry['model']:<15} error: {entry['error']}"
    params = f"{entry['parameters']:>15,} {entry['analytic_parameters'] - entry['parameters']:+d}"
    cells = []
    for row in entry["layers"]:
        worst = max(abs(e) for e in row["analytic_error"][1:])
        cell = f"s={row['seq_len']} {row['attention']}: {100 * worst:.2f}%"
        if "profile_minus_real" in row:
            cell += f" (profile {max(abs(d) for d in row['profile_minus_real'])} B)"
        cells.append(cell)
    return f"{entry['model']:<15} {params}  " + "; ".join(cells)


# --- every causal-LM class transformers ships (--classes) -------------------------------------------------------

CLASS_LAYERS = 6
"""Layers of the shrunk copy: enough for the patterns of the default configs (Gemma 3's sixth layer is global,
Jamba's fifth attends, Qwen3-Next's fourth)."""

CLASS_WIDTHS: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim"), 64),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), 96),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("head_dim", "attention_head_dim", "kv_channels", "d_head", "swa_head_dim"), 16),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group", "first_k_dense_replace"), 1),
    **dict.fromkeys(("kv_lora_rank", "v_head_dim", "qk_head_dim", "index_head_dim", "mamba_d_state"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "index_topk"), 8),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size"), 8),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "ssm_state_size"), 16),
    **dict.fromkeys(("linear_num_key_heads", "index_n_heads", "swa_num_key_value_heads"), 2),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads", "mamba_n_heads", "swa_num_attention_heads"), 4),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input"), 256),  # Gemma 3n's and 4's per-layer tables too
    "q_lora_rank": 32,
    "moe_k": 2,
    "mamba_d_ssm": 128,  # Falcon-H1: heads * head size = expand * hidden
}
"""A few layers of h = 64 with 4 heads of 16, 96-wide MLPs, 4 experts of 32 (top 2): what every default config's
sizes become, key by key, where the config has the key."""

CLASS_OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"head_dim": 32},  # num_heads * head_dim = expand * hidden
    "dory": {"n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2},
    "zaya": {"num_experts_per_tok": 1},  # the class takes top-1 only
    "gemma3n_text": {"num_kv_shared_layers": 1},  # a layer of each attention type left to make the shared cache
}
"""Shapes a config class validates beyond the generic sizes."""

CLASS_WL = Workload(seq_len=16, micro_batch=2, dtype="fp32", attention="flash", device="cpu")
"""The shrunk copy's step: trace and real step alike, fp32 on this CPU (SDPA where the class takes it)."""

DEFAULT_WL = Workload(seq_len=8, micro_batch=1, dtype="bf16", attention="flash", device="cpu")
"""The default-sized class's scaled trace (parameters): fake tensors, a short sequence."""


def _layer_count(raw: dict[str, Any]) -> int | None:
    return next(
        (raw[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if isinstance(raw.get(k), int)),
        None,
    )


def shrunk(model_type: str, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a default config) with ``CLASS_LAYERS`` layers and the small sizes of ``CLASS_WIDTHS``: per-layer
    lists and layer-indexed tables cut to the new depth, token ids kept inside the vocabulary."""
    out = resized(raw, CLASS_LAYERS, CLASS_WIDTHS)
    heads = out.get("num_attention_heads")
    if isinstance(raw.get("num_key_value_heads"), int) and isinstance(heads, int):
        out["num_key_value_heads"] = heads if raw["num_key_value_heads"] >= raw["num_attention_heads"] else 2
    if "qk_rope_head_dim" in raw and "head_dim" in raw:
        out["head_dim"] = out["qk_rope_head_dim"]  # latent attention: the rotary part's head size
    if "mamba_d_head" in raw:
        out["mamba_d_head"] = int(out.get("mamba_expand", 2)) * out["hidden_size"] // out.get("mamba_n_heads", 4)
    return {**out, **CLASS_OVERRIDES.get(model_type, {})}


def resized(raw: dict[str, Any], n_layers: int, sizes: dict[str, int]) -> dict[str, Any]:
    """``raw`` with ``n_layers`` layers and the sizes of ``sizes`` where it has the key (``vocab_size`` among
    them): per-layer lists and layer-indexed tables cut to the new depth, token ids kept inside the vocabulary."""
    out = dict(raw)
    n = _layer_count(raw)
    top = sizes["vocab_size"] - 1
    for key, value in raw.items():
        if isinstance(value, bool):
            continue
        if key.endswith(("token_id", "token_ids")):  # inside the small vocabulary
            out[key] = [min(v, top) for v in value] if isinstance(value, list) else _clamp(value, top)
        elif key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") and isinstance(value, int):
            out[key] = n_layers
        elif key in sizes and isinstance(value, int):
            out[key] = sizes[key]
        elif isinstance(value, list) and n and len(value) == n:
            out[key] = value[:n_layers]
        elif _indices(value, n):  # layer indices (Bamba's attention layers): those left, or the last one
            out[key] = [i for i in value if i < n_layers] or [n_layers - 1]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < n_layers}
    return out


def _clamp(value: Any, top: int) -> Any:
    return min(value, top) if isinstance(value, int) else value


def _indices(value: Any, n: int | None) -> bool:
    """A non-empty list of distinct layer indices (``attn_layer_indices``), not a per-layer list."""
    ints = isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    return bool(ints and n and len(set(value)) == len(value) < n and max(value) < n and min(value) >= 0)


def real_kept(built: BuiltModel, idx: torch.Tensor, targets: torch.Tensor, *, backward: bool = True) -> list[int]:
    """Bytes each layer keeps for the backward in a real step: the distinct storages that the tensors autograd
    saved still keep alive when the backward starts (a view keeps its whole storage; what a dropped branch saved,
    such as a router's unused scores, is freed by then), each by its first saver, as the trace counts them (a
    storage the embedding saves before layer 0 does, such as Gemma 4's embedded tokens, is not layer 0's); no
    weights. ``backward=False``: the forward only (the counts are taken before the backward)."""
    model = built.model
    layers = find_layers(model)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current: list[int | None] = [None]
    saved: list[tuple[int | None, weakref.ref[torch.Tensor]]] = []  # (layer, or None outside the layers)
    handles = [
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)) for i, layer in enumerate(layers)
    ]
    handles += [layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)) for layer in layers]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((current[0], weakref.ref(t)))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _, loss = built.loss_fn(model, idx, targets)
        first: dict[int, tuple[int | None, int]] = {}  # storage -> (first saver, bytes), of the tensors alive
        for layer, ref in saved:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in weights:
                first.setdefault(t.untyped_storage().data_ptr(), (layer, t.untyped_storage().nbytes()))
        if backward:
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    out = [0] * len(layers)
    for layer, nbytes in first.values():
        if layer is not None:
            out[layer] += nbytes
    return out


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}"[:300]


def check_class(
    model_type: str, *, policies: tuple[str, ...] = tuple(ALL_POLICIES), default_size: bool = True
) -> dict[str, Any]:
    """One class: refused (recompute's one-line reason), not checked (its default or shrunk config does not build
    or run: why), or the checks of the module docstring, with ``status`` exact or off and what is off."""
    row: dict[str, Any] = {"model_type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    try:
        raw = transformers.AutoConfig.for_model(model_type).to_dict()
    except Exception as e:
        return {**row, "status": "not checked", "why": f"its config class fails: {_why(e)}"}
    try:
        source = ModelSource.from_config(raw, name=model_type)
    except ConfigError as e:
        return {**row, "status": "refused", "why": str(e)}
    try:
        row["parameters"] = {"class": int(build_source(source, device="meta").model.num_parameters())}
    except Exception as e:
        return {**row, "status": "not checked", "why": f"its default config does not build: {_why(e)}"}
    off: list[str] = []
    if default_size:
        off += _default_parameters(source, raw, row["parameters"])
    try:
        small = ModelSource.from_config(shrunk(model_type, raw), name=model_type)
        torch.manual_seed(0)
        built = build_source(small)
    except Exception as e:
        return {**row, "status": "not checked", "why": f"the shrunk config does not build: {_why(e)}"}
    idx, targets = torch.randint(built.vocab, (2, CLASS_WL.micro_batch, CLASS_WL.seq_len))
    try:
        real = real_kept(built, idx, targets)
    except ConfigError as e:  # recompute's own refusal (no layer list it can find)
        return {**row, "status": "refused", "why": str(e)}
    except Exception as e:
        return {**row, "status": "not checked", "why": f"the shrunk copy's own training step fails: {_why(e)}"}
    try:
        result = trace(small, CLASS_WL, "none")
    except ConfigError as e:
        return {**row, "status": "refused", "why": f"trace: {e}"}
    except Exception as e:  # the class runs, recompute's trace of it does not: a defect, reported as such
        return {**row, "status": "off", "off": [f"trace fails: {_why(e)}"], "layers": {"real": real}}
    row["layers"] = {"trace": [p.total for p in result.layers], "real": real}
    row["small_parameters"] = {"class": int(built.model.num_parameters()), "trace": result.parameter_count}
    if row["layers"]["trace"] != row["layers"]["real"]:
        worst = max(abs(t / r - 1) for t, r in zip(row["layers"]["trace"], row["layers"]["real"]) if r)
        off.append(f"layer bytes {100 * worst:.2f} % off")
    if result.parameter_count != row["small_parameters"]["class"]:
        off.append("shrunk parameters off")
    row["policies"] = {name: _policy(built, name) for name in policies}
    bad = [name for name, verdict in row["policies"].items() if not verdict.startswith(("bit-exact", "refused"))]
    off += [f"{name}: {row['policies'][name]}" for name in bad]
    return {**row, "status": "off" if off else "exact", "off": off}


def _default_parameters(source: ModelSource, raw: dict[str, Any], params: dict[str, Any]) -> list[str]:
    """recompute's parameter counts of the default-sized class: a scaled trace, the analytic count."""
    off = []
    try:
        params["trace"] = trace(source, DEFAULT_WL, "none", layers=2).parameter_count
        if params["trace"] != params["class"]:
            off.append(f"scaled trace parameters {params['trace'] / params['class'] - 1:+.2%}")
    except ConfigError as e:
        params["trace"] = f"refused: {e}"
    except Exception as e:
        params["trace"] = f"fails: {_why(e)}"
        off.append("scaled trace fails")
    try:
        params["analytic"] = n_params(spec_from_config(raw))
        if params["analytic"] != params["class"]:
            off.append(f"analytic parameters {params['analytic'] / params['class'] - 1:+.2%}")
    except ConfigError as e:
        params["analytic"] = f"refused: {e}"
    return off


def _policy(built: BuiltModel, name: str) -> str:
    """``bit-exact``, ``passed (max |dgrad| ...)``, ``failed ...`` or ``refused: why`` for ``verify`` under a policy."""
    model = copy.deepcopy(built.model)
    try:
        result = verify(model, name, micro_batch=CLASS_WL.micro_batch, seq_len=CLASS_WL.seq_len)
    except ConfigError as e:
        return f"refused: {e}"
    except Exception as e:
        return f"fails: {_why(e)}"
    if result.bit_exact:
        return "bit-exact"
    verdict = "passed" if result.passed else "failed"
    return f"{verdict} (loss {result.loss_diff:.1e} off, max |dgrad| {result.max_grad_diff:.1e})"


def classes_main(only: list[str] | None, *, table_only: bool) -> None:
    path = RESULTS / "hf_classes.json"
    if table_only:
        print(render_classes(json.loads(path.read_text())))
        return
    start = time.perf_counter()
    rows = []
    for model_type in only or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        row = check_in_child(model_type)
        rows.append(row)
        print(
            f"{model_type:<26} {row['status']:<12} {'; '.join(row.get('off', [])) or row.get('why', '')}"[:200],
            flush=True,
        )
    command = "python benchmarks/hf_fidelity.py --classes" + (f" --only {','.join(only)}" if only else "")
    if only and path.exists():  # re-check some classes: their rows replace the old ones, the commands add up
        old = json.loads(path.read_text())
        fresh = {row["model_type"]: row for row in rows}
        rows = [fresh.pop(row["model_type"], row) for row in old["rows"]] + list(fresh.values())
        command = "; ".join([*old.get("commands", [old["command"]]), command])
    write(path, command, start, rows)


def check_in_child(model_type: str, timeout: float = 900.0, flag: str = "--check", *more: str) -> dict[str, Any]:
    """``check_class`` (or the check ``flag`` names) in a process of its own: a class whose step crashes the
    interpreter (a ``topk`` past its dimension corrupts the heap) or hangs costs its own row only."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, flag, model_type, *more], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        done = None
    seconds = round(time.perf_counter() - start, 1)
    lines = done.stdout.strip().splitlines() if done is not None else []
    if done is not None and done.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "seconds": seconds}
    row = {"model_type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], "status": "not checked"}
    if done is None:
        return {**row, "why": f"the check ran past {timeout:.0f} s", "seconds": seconds}
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    if done.returncode == -9:
        last = "killed by SIGKILL (the kernel's out-of-memory killer, on this 24 GiB machine, is the likely sender)"
    return {**row, "why": f"the check crashed (exit {done.returncode}): {last[:200]}", "seconds": seconds}


def check_main(model_type: str) -> None:
    """``--check TYPE``: one class's row, as one JSON line (what ``check_in_child`` runs)."""
    torch.set_num_threads(1)  # tiny models: one thread is several times faster than two on a loaded machine
    print(json.dumps(check_class(model_type)))


def render_classes(data: dict[str, Any]) -> str:
    """The docs table: one row per class, its verdict and what decides it."""
    lines = ["| model_type | class | verdict | parameters (default size) | layer bytes (shrunk) | policies |"]
    lines.append("|---|---|---|---:|---|---|")
    for row in data["rows"]:
        verdict = row["status"]
        detail = "; ".join(row.get("off", [])) if verdict == "off" else row.get("why", "")
        params = row.get("parameters", {}).get("class")
        layers = row.get("layers", {})
        same = layers.get("trace") == layers.get("real")
        policies = row.get("policies", {})
        exact = sum(v == "bit-exact" for v in policies.values())
        refused = [k for k, v in policies.items() if v.startswith("refused")]
        cells = [
            row["model_type"],
            row["class"],
            f"**{verdict}**" + (f": {_short(detail)}" if detail else ""),
            f"{params:,}" if isinstance(params, int) else "",
            ("exact" if same else "off") if layers.get("trace") else "",
            (f"{exact} bit-exact" + (f", {', '.join(refused)} refused" if refused else "")) if policies else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(text: str, limit: int = 160) -> str:
    text = text.replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    main()
