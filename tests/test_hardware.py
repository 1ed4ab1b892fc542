"""The GPU table: rows with sources, the usable-memory rule pinned, one-line errors for unknown names."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from recompute.core.errors import ConfigError
from recompute.core.hardware import CONTEXT_RESERVE, FRAGMENTATION, GPU, GPUS, gpu_by_name, usable_bytes

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize("name", list(GPUS))
def test_rows_are_complete(name: str) -> None:
    gpu = GPUS[name]
    assert gpu.name == name and re.fullmatch(r"[a-z0-9]+(-[a-z]+)?-\d+gb", name)
    assert 16 * GiB < gpu.memory < 200 * GiB
    assert 1e14 < gpu.peak_bf16 < 1e16
    smi = {"cuda": "nvidia-smi", "rocm": "rocm-smi"}[gpu.kind]  # the memory as the device reports it
    assert gpu.label and ("datasheet" in gpu.source or "whitepaper" in gpu.source) and smi in gpu.source


def test_the_named_gpus_exist() -> None:
    assert {"h100-80gb", "a100-80gb", "a100-40gb", "h200-141gb", "l40s-48gb", "rtx4090-24gb"} <= set(GPUS)


def test_usable_bytes_h100_pinned() -> None:
    # 81559 MiB reported; minus 1 GiB of context and 5 % for fragmentation.
    assert usable_bytes("h100-80gb") == 81559 * MiB * (1 - 0.05) - 1 * GiB
    assert (GiB, 0.05) == (CONTEXT_RESERVE, FRAGMENTATION)


def test_usable_bytes_custom_reserve() -> None:
    assert usable_bytes("a100-40gb", context=0, fragmentation=0) == 40960 * MiB
    assert usable_bytes(GPUS["a100-40gb"], context=2 * GiB, fragmentation=0.1) == 40960 * MiB * 0.9 - 2 * GiB


def test_lookup_is_case_insensitive_and_passes_rows_through() -> None:
    assert gpu_by_name(" H100-80GB ") is GPUS["h100-80gb"]
    row = GPU("custom-1gb", 10 * GiB, 1e14, "custom", "test")
    assert gpu_by_name(row) is row


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"'tpu-v9' is not a known GPU; known GPUs: h100-80gb, .*rtx4090-24gb"):
        gpu_by_name("tpu-v9")


def test_reserve_that_leaves_nothing() -> None:
    with pytest.raises(ConfigError, match="leaves no memory on rtx4090-24gb"):
        usable_bytes("rtx4090-24gb", context=30 * GiB)


def test_imports_no_torch() -> None:
    code = "import sys, recompute.core.hardware; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
