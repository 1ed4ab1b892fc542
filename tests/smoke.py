"""The smoke of every ``recompute`` command at a tiny size: one argv each, shared by ``tests/test_smoke.py`` (in
process, under the torch of the test run) and ``scripts/torch-matrix`` (as subprocesses, under each torch given).

``{dir}`` in an argv is the run's scratch folder, where ``write_files`` puts a transformers Llama config.json
(GQA: 4 query heads, 2 key/value heads, so attention FLOPs take the grouped-query formula) before the commands
run. The commands run in order: ``plan`` and ``report`` read files that ``profile`` and ``bench`` wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["COMMANDS", "LLAMA", "TRACES", "argv", "write_files"]

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
"""A tiny transformers Llama (vocabulary 256: the byte tokenizer's, so ``train`` can run it too)."""

_CONFIG = "{dir}/llama.json"
_SMALL = ["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64"]
_BENCH = ["--steps", "1", "--warmup", "1", "--seq-len", "32", "--micro-batch", "2", "--device", "cpu"]
_TRAIN = ["--model", "gpt2", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--micro-batch", "2"]
_TRAIN += ["--steps", "3", "--warmup", "1", "--sample-tokens", "4", "--device", "cpu", "--checkpoint-every", "0"]

TRACES: dict[str, list[str]] = {
    "trace gpt2": ["trace", "--model", "gpt2", "--seq-len", "128", "--policy", "core_attn", "--json"],
    "trace llama3.1-8b": ["trace", "--model", "llama3.1-8b", "--seq-len", "256", "--scale-from", "1", "--json"],
    "trace llama config": ["trace", "--model", _CONFIG, "--seq-len", "64", "--policy", "block", "--json"],
    "trace llama config, cuda rules": ["trace", "--model", _CONFIG, "--seq-len", "64", "--device", "cuda", "--json"],
    "trace --tp 2 --sp": [
        "trace",
        "--model",
        "gpt2",
        "--seq-len",
        "128",
        "--tp",
        "2",
        "--sp",
        "--scale-from",
        "1",
        "--json",
    ],
    "trace offload": [
        "trace",
        "--model",
        "gpt2",
        "--seq-len",
        "128",
        "--scale-from",
        "2",
        "--policy",
        "offload",
        "--json",
    ],
}
"""Traces whose JSON (timings left out) must be the same, byte for byte, under every supported torch."""

COMMANDS: dict[str, list[str]] = {
    "estimate": ["estimate", "--model", "gpt2", "--seq-len", "128"],
    **TRACES,
    "profile config": ["profile", "--model", _CONFIG, "--seq-len", "32", "-o", "{dir}/profile.json", "--json"],
    "plan config": ["plan", "--model", _CONFIG, "--seq-len", "32", "--budget", "1GiB", "-o", "{dir}/plan.json"],
    "bench config": ["bench", "--model", _CONFIG, *_BENCH, "--policies", "none,block", "--no-time", "--json"],
    "bench preset": ["bench", *_SMALL, *_BENCH, "--no-time", "--json"],
    "verify": ["verify", *_SMALL, "--seq-len", "16", "--policy", "block", "--json"],
    "verify config": ["verify", "--model", _CONFIG, "--seq-len", "16", "--policy", "attn", "--json"],
    "validate": ["validate", "--models", "gpt2", "--policies", "none,block", "--seq-lens", "256"],
    "train": ["train", *_TRAIN, "--policy", "block", "--out", "{dir}/train"],
    "compare-train": ["compare-train", *_TRAIN, "--policies", "none,block", "--out", "{dir}/compare", "--json"],
    "report": ["report", "--model", "gpt2", "--seq-len", "1024", "--no-time", "-o", "{dir}/report.html"],
    "calibrate --quick": ["calibrate", "--device", "cpu", "--threads", "1", "--quick", "-o", "{dir}/device.json"],
}
"""Every command of ``recompute --help`` at least once, by a readable name."""


def write_files(folder: Path) -> None:
    """Write the files the commands read into ``folder`` (the ``{dir}`` of their argv)."""
    (folder / "llama.json").write_text(json.dumps(LLAMA))


def argv(name: str, folder: Path) -> list[str]:
    """The argv of command ``name`` with ``{dir}`` set to ``folder``."""
    return [a.format(dir=folder) for a in COMMANDS[name]]
