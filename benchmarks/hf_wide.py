"""Every class the ``--classes`` sweep found exact, again near its published width (issue 37, item 3).

``python benchmarks/hf_fidelity.py --classes --wide [--only TYPES] [--seq-len 256]``: the shrunk sweep holds the
trace to real steps at h = 64 only. Here each class its rows in benchmarks/results/hf_classes.json call exact
is built from its config class's defaults (usually a published size: Llama's are Llama-2-7B's) at its own
hidden, MLP and head sizes, with the vocabulary cut to ``WIDE_VOCAB`` and a few layers, bf16, b = 1, s = 256,
SDPA, random weights on this CPU. One real forward, each saved storage counted once by its first saver
(``hf_fidelity.real_kept``), against the trace of the same config on fake tensors, layer by layer.

Note: [the vocabulary does not matter] the bytes a layer keeps are its own: the embedding, the head and the
loss are outside the layers (the trace counts them apart), so a vocabulary of 512 changes no layer's figure
and spares the 131,072 x 4,096 head a real bf16 step would multiply on this CPU.

Note: [layers] two, or as many as it takes to reach every kind of layer the shrunk copy showed (a kind: a
distinct per-layer byte count among its six layers; Gemma 3's sixth layer is global), every one compared. A
published window wider than s leaves a sliding layer attending as a full one does (its mask is then the same).

A class whose real step would not fit this machine is skipped with the figure: more than ``LIMIT_BYTES`` of
bf16 weights and saved activations, or more than ``LIMIT_SECONDS`` by its forward's matmuls at ``BF16_RATE``
(every parameter a multiply-add per token, an expert's at the share of tokens its top-k routing sends it).
Writes benchmarks/results/hf_classes_wide.json (``--only`` replaces those rows).

Note: [fewer experts] a mixture-of-experts class too big at its published expert count is checked with its
routed experts cut to ``fewer_experts`` (max(2k, 8) for top-k routing, a multiple of the expert groups), every
width kept: hidden, heads, expert MLP, top-k, window. What that checks is the class at published width with E
experts, not the published E: the router's logits (s x E) and what is kept per expert change with E, and the
trace is of the same cut config. The row's note says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from hf_fidelity import CLASS_OVERRIDES, RESULTS, _why, check_in_child, real_kept, resized, write
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from recompute import Workload
from recompute.core.errors import ConfigError
from recompute.models.source import ModelSource, build_source
from recompute.trace import trace

WIDE_VOCAB = 512
LIMIT_BYTES = 6 * 2**30
LIMIT_SECONDS = 120.0
LIMITS_BY_CLASS = {
    "cohere": (LIMIT_BYTES, 130.0),
    "cohere2": (LIMIT_BYTES, 130.0),
    "bailing_hybrid": (7 * 2**30, 120.0),
    "cohere2_moe": (10 * 2**30, 240.0),
}
"""Classes allowed a bit more (bytes, seconds): Cohere's 8192-wide layers, 121 s estimated at 2 layers, 3.1 GiB;
Bailing's linear-attention layers, 0.99 GB kept each at s = 256, 6.3 GiB estimated at 6 layers (its first
attention layer is the sixth), 1.7 GiB of it weights; Cohere 2 MoE's 8192-wide layers with 4 experts, 9.3 GiB and
202 s estimated at 2 layers."""
WIDE_EXPERTS = {"llama4_text": 2, "cohere2_moe": 4}
"""Fewest experts chosen by hand: Llama 4 runs every routed expert on every token (``DENSE_EXPERTS``), so its
step's time grows with E, not k: with 8 the check ran past 600 s; 2 keep its top-1 routing a choice. Cohere 2 MoE's
published 8 are max(2k, 8) already, 17.5 GiB at 2 layers: 4 = 2k keep its top-2 routing a choice."""
WIDE_DTYPES = {"llama4_text": "fp32"}
"""Classes checked in fp32 (trace and real step alike): Llama 4's experts multiply by ``torch.bmm``, which runs at
0.2 GFLOP/s in bf16 on this CPU (``F.linear`` at 10) and at 61 in fp32; in bf16 its 2-layer step ran past 600 s
with 8 experts and with 2."""
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DENSE_EXPERTS = {"llama4_text"}
"""Classes whose every expert runs on every token, its input scaled by the router's score (Llama 4): the time
estimate counts all their experts' parameters, not the top-k share."""
BF16_RATE = 7e9
"""FLOP/s of a bf16 ``F.linear`` on this CPU (AVX2, no bf16 units): 7.5 GFLOP/s measured at 256 x 4096 by
11008 x 4096, one thread or two."""

WIDE_SIZES = {"vocab_size": WIDE_VOCAB, "vocab_size_per_layer_input": WIDE_VOCAB, "first_k_dense_replace": 1}
"""What changes beside the layer count: the vocabularies, and DeepSeek-style dense first layers cut to one (the
shrunk copy's pattern: layer 0 dense, the others mixture-of-experts)."""
WIDE_LAYERS = {"dory": 8}
"""Layer counts chosen by hand: Dory's config counts the attention and the MLP of a layer as two (it halves
them), and its fourth layer is the first global one."""

WIDE_OVERRIDES: dict[str, dict[str, Any]] = {
    "dory": {"n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 4},  # layers 0, 1 (looped), 2-3
    "gemma3n_text": CLASS_OVERRIDES["gemma3n_text"],
}
"""What a config class validates beyond its defaults at a few layers."""
TIMEOUT = 600.0


def wide_workload(seq_len: int, model_type: str = "") -> Workload:
    """b = 1, ``seq_len``, SDPA on this CPU, bf16 (fp32 for the classes of ``WIDE_DTYPES``)."""
    dtype = WIDE_DTYPES.get(model_type, "bf16")
    return Workload(seq_len=seq_len, micro_batch=1, dtype=dtype, attention="flash", device="cpu")


def layer_count(shrunk_bytes: list[int]) -> int:
    """Two, or enough layers to reach every kind the shrunk copy's per-layer bytes show (``[layers]``)."""
    first = {b: i for i, b in reversed(list(enumerate(shrunk_bytes))) if i > 0}
    return max(2, 1 + max(first.values(), default=1))


def wide_config(model_type: str, raw: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """``raw`` at its own widths with ``n_layers`` layers and the vocabulary cut to ``WIDE_VOCAB``."""
    return {**resized(raw, n_layers, WIDE_SIZES), **WIDE_OVERRIDES.get(model_type, {})}


def estimate(model: torch.nn.Module, activations: int, seq_len: int, *, weight_bytes: int = 2) -> dict[str, float]:
    """GiB (bf16 weights and the saved activations) and seconds (the forward's matmuls: a multiply-add per
    parameter and token, an expert's parameters at the share of tokens top-k routing sends it) of the real step."""
    params = int(model.num_parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    cfg = model.config.to_dict()
    key, k = _routing(cfg)
    e = cfg[key] if key else None
    share = 1.0 if cfg.get("model_type") in DENSE_EXPERTS else k / e if k and e else 1.0
    active = params - experts + experts * share
    return {
        "parameters": params,
        "GiB": (weight_bytes * params + activations) / 2**30,
        "seconds": 2 * active * seq_len / BF16_RATE,
    }


_TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k_experts")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_GROUPS = ("n_group", "num_expert_group")


def fewer_experts(cfg: dict[str, Any], fewest: int | None = None) -> dict[str, Any] | None:
    """``cfg`` with its routed experts cut to ``fewest``, by default max(2k, 8) rounded up to a multiple of its
    expert groups, or None where it routes to no experts or has no more than that (``[fewer experts]``)."""
    key, k = _routing(cfg)
    if key is None or k is None:
        return None
    groups = next((cfg[g] for g in _GROUPS if isinstance(cfg.get(g), int) and cfg[g] > 0), 1)
    e = fewest or -(-max(2 * k, 8) // groups) * groups
    return {**cfg, key: e} if e < cfg[key] else None


def too_big(
    est: dict[str, float], n_layers: int, limits: tuple[float, float] = (LIMIT_BYTES, LIMIT_SECONDS)
) -> str | None:
    """Why the real step would not fit this machine (``limits``: bytes, seconds), or None."""
    if est["GiB"] <= limits[0] / 2**30 and est["seconds"] <= limits[1]:
        return None
    size = f"{est['GiB']:.1f} GiB, {est['seconds']:.0f} s"
    return f"{size} estimated at {n_layers} layers ({est['parameters']:,} parameters)"


@contextmanager
def dtype_default(dtype: torch.dtype) -> Iterator[None]:
    """Weights made in ``dtype`` from the start: in bf16, no fp32 copy of them at twice the bytes."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_wide(model_type: str, shrunk_bytes: list[int], seq_len: int) -> dict[str, Any]:
    """One class near its published width: exact, off (which layers, by how many bytes), skipped (why) or
    refused (recompute's one line)."""
    row: dict[str, Any] = {"model_type": model_type, "class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]}
    raw = transformers.AutoConfig.for_model(model_type).to_dict()
    every = WIDE_LAYERS.get(model_type) or layer_count(shrunk_bytes)
    notes = []
    for n in dict.fromkeys((every, 2)):  # every kind of layer, else the first two
        try:
            cfg, source, meta, why = fitting(model_type, raw, n, seq_len)
        except ConfigError as e:
            return {**row, "status": "refused", "why": str(e)}
        row["config"] = {k: cfg[k] for k in _WIDTH_KEYS if isinstance(cfg.get(k), int)}
        if why is None:
            break
        if n != 2:
            notes = [f"at 2 layers only: every kind of layer, at {n} layers, {why}"]
    else:
        return {**row, "status": "skipped", "why": why}
    if cut := experts_cut(raw, cfg):
        notes.insert(0, cut)
    if model_type in WIDE_DTYPES:
        notes.append(f"in {WIDE_DTYPES[model_type]}, trace and real step alike")
    if notes:
        row["note"] = "; ".join(notes)
    wl = wide_workload(seq_len, model_type)
    try:
        result = trace(source, wl, "none")
    except ConfigError as e:
        return {**row, "status": "refused", "why": f"trace: {e}"}
    except Exception as e:  # at 2 layers a hybrid may have no attention layer, which its class needs
        if "note" not in row:
            raise
        return {**row, "status": "skipped", "why": f"{row.pop('note')}; at 2 layers the class fails: {_why(e)}"}
    row["layers"] = {"trace": [p.total for p in result.layers]}
    row["estimate"] = estimate(meta, result.activations, seq_len, weight_bytes=wl.element_bytes)
    if why := too_big(row["estimate"], n, LIMITS_BY_CLASS.get(model_type, (LIMIT_BYTES, LIMIT_SECONDS))):
        return {**row, "status": "skipped", "why": why}
    torch.manual_seed(0)
    dtype = TORCH_DTYPES[wl.dtype]
    with dtype_default(dtype):
        built = build_source(source, dtype=dtype)
    idx, targets = torch.randint(built.vocab, (2, wl.micro_batch, seq_len))
    try:
        real = real_kept(built, idx, targets, backward=False)
    except Exception as e:
        return {**row, "status": "not checked", "why": f"the class's own step fails: {_why(e)}"}
    row["layers"]["real"] = real
    off = [
        f"layer {i}: trace {t - r:+,} B of {r:,}"
        for i, (t, r) in enumerate(zip(row["layers"]["trace"], real))
        if t != r
    ]
    return {**row, "status": "off" if off else "exact", "off": off}


def fitting(
    model_type: str, raw: dict[str, Any], n_layers: int, seq_len: int
) -> tuple[dict[str, Any], ModelSource, torch.nn.Module, str | None]:
    """The config at ``n_layers`` whose real step fits this machine, published or with ``fewer_experts``, with
    its source and meta-device model; else the smallest tried and why it does not fit."""
    limits = LIMITS_BY_CLASS.get(model_type, (LIMIT_BYTES, LIMIT_SECONDS))
    published = wide_config(model_type, raw, n_layers)
    fewer = fewer_experts(published, WIDE_EXPERTS.get(model_type))
    whys = []
    for cfg in filter(None, (published, fewer)):
        source = ModelSource.from_config(cfg, name=model_type)
        meta = build_source(source, device="meta").model
        est = estimate(meta, 0, seq_len, weight_bytes=wide_workload(seq_len, model_type).element_bytes)
        if not (why := too_big(est, n_layers, limits)):  # the weights alone: no trace
            return cfg, source, meta, None
        whys.append(why if cfg is published else f"with {experts_cut(published, cfg, short=True)}: {why}")
    key, k = _routing(published)
    if key and k and not fewer:
        whys.append(f"its {published[key]} routed experts (top-{k}) are already the fewest the check takes")
    return cfg, source, meta, "; ".join(whys)


def _routing(cfg: dict[str, Any]) -> tuple[str | None, int | None]:
    """The key of a mixture-of-experts config's routed expert count and its top-k (None, None for a dense one)."""
    key = next((key for key in _EXPERTS if isinstance(cfg.get(key), int)), None)
    k = next((cfg[key] for key in _TOP_K if isinstance(cfg.get(key), int)), None)
    return key, k


def experts_cut(raw: dict[str, Any], cfg: dict[str, Any], *, short: bool = False) -> str | None:
    """What ``fewer_experts`` cut, in words (None where nothing was)."""
    key = next((key for key in _EXPERTS if isinstance(cfg.get(key), int) and cfg[key] != raw.get(key)), None)
    if key is None:
        return None
    e, published = cfg[key], raw[key]
    if short:
        return f"{e} routed experts"
    return (
        f"{e} routed experts, not the published {published} ({key}): the class at published width with {e} experts"
        f" (the router's logits, s x {e}, change with E)"
    )


_WIDTH_KEYS = (
    "hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "num_attention_heads", "n_head",
    "num_key_value_heads", "head_dim", "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
    "moe_intermediate_size", "num_hidden_layers", "n_layer", "sliding_window",
)  # fmt: skip


def exact_classes() -> dict[str, list[int]]:
    """The classes the shrunk sweep found exact, with its per-layer bytes."""
    rows = json.loads((RESULTS / "hf_classes.json").read_text())["rows"]
    return {r["model_type"]: r["layers"]["trace"] for r in rows if r["status"] == "exact"}


def wide_main(only: list[str] | None, seq_len: int, *, table_only: bool = False) -> None:
    path = RESULTS / "hf_classes_wide.json"
    if table_only:
        print(render_wide(json.loads(path.read_text())))
        return
    start = time.perf_counter()
    exact = exact_classes()
    command = f"python benchmarks/hf_fidelity.py --classes --wide --seq-len {seq_len}"
    command += f" --only {','.join(only)}" if only else ""
    old = json.loads(path.read_text()) if path.exists() else {"rows": []}
    commands = [old["command"], command] if "command" in old else [command]  # the commands add up
    rows = {row["model_type"]: row for row in old["rows"]}  # earlier rows stay unless checked again
    for model_type in only or list(exact):
        if model_type not in exact:
            row = {"model_type": model_type, "status": "not checked", "why": "not exact in hf_classes.json"}
        else:
            row = check_in_child(model_type, TIMEOUT, "--check-wide", str(seq_len))
        rows[model_type] = row
        print(f"{model_type:<26} {row['status']:<12} {'; '.join(row.get('off', [])) or row.get('why', '')}"[:200],
              f"({row.get('seconds', 0):.0f} s)", flush=True)  # fmt: skip
        write(path, "; ".join(commands), start, list(rows.values()))  # after each class: a stopped sweep keeps its rows


def check_wide_main(model_type: str, seq_len: int) -> None:
    """``--check-wide TYPE S``: one class's row, as one JSON line (what ``check_in_child`` runs)."""
    print(json.dumps(check_wide(model_type, exact_classes()[model_type], seq_len)))


def render_wide(data: dict[str, Any]) -> str:
    """The docs table: one row per class, its widths, layer 1's bytes, its verdict and seconds."""
    lines = ["| model_type | h | d_ff | heads | layers | layer 1 (B) | verdict | seconds |"]
    lines.append("|---|---:|---:|---:|---:|---:|---|---:|")
    for row in data["rows"]:
        cfg = row.get("config", {})
        h = cfg.get("hidden_size", cfg.get("n_embd", cfg.get("d_model", "")))
        ff = cfg.get("intermediate_size", cfg.get("n_inner", cfg.get("moe_intermediate_size", "")))
        heads = cfg.get("num_attention_heads", cfg.get("n_head", ""))
        traced = row.get("layers", {}).get("trace", [])
        detail = "; ".join(row.get("off", [])) or row.get("why", "") or row.get("note", "")
        verdict = f"**{row['status']}**" + (f": {detail}" if detail else "")
        cells = [row["model_type"], h, ff, heads, len(traced) or "", f"{traced[1]:,}" if traced[1:] else ""]
        lines.append("| " + " | ".join(str(c) for c in [*cells, verdict, row.get("seconds", "")]) + " |")
    return "\n".join(lines)
