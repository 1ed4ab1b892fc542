"""``core_attn`` on transformers' classes swaps the attention function and nothing else, or is refused.

``apply`` gives each attention module a config naming recompute's registered function; a class that never looks
its function up (Falcon runs ``F.scaled_dot_product_attention`` when the name is ``"sdpa"``, its own eager code
otherwise) or tests the name itself (DeepSeek-V3.2's sparse mask) would compute something else: refused in one
line. A profile that measures a policy replaying nothing records it as refused rather than pricing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from recompute import Workload
from recompute.check_gradients import verify
from recompute.checkpointing import apply
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.models.source import build_source, resolve_source
from recompute.trace import profile

transformers = pytest.importorskip("transformers")

SIZE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FALCON = {"model_type": "falcon", **SIZE}
GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=None, eos_token_id=None)


def config(raw: dict[str, Any], folder: Path, name: str) -> str:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_falcon_core_attn_is_refused(attention: str, tmp_path: Path) -> None:
    model = build_source(resolve_source(config(FALCON, tmp_path, "falcon")), attention=attention, device="meta").model
    with pytest.raises(ConfigError) as e:
        apply(model, "core_attn")
    message = str(e.value)
    assert "\n" not in message and message.startswith("core_attn cannot apply to FalconAttention: it does not look")
    assert "use the 'attn' policy instead" in message
    apply(model, "attn")  # the sub-block policies still apply


def test_cli_verify_refuses_falcon_core_attn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: verify failed (loss 6.2737827 vs 6.2760296); now it refuses, exit 2, one line."""
    path = config(FALCON, tmp_path, "falcon_tiny")
    assert main(["verify", "--model", path, "--policy", "core_attn", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "core_attn cannot apply to FalconAttention" in err
    assert main(["verify", "--model", path, "--policy", "attn", "--seq-len", "16"]) == 0


def test_a_test_of_the_name_that_changes_the_computation_is_refused(tmp_path: Path) -> None:
    """DeepSeek-V3.2 masks the indexer's keys only for ``eager`` and ``sdpa``: under another name it would not."""
    raw = {
        "model_type": "deepseek_v32", **SIZE, "num_key_value_heads": 4, "intermediate_size": 96, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "index_head_dim": 16,
        "index_n_heads": 2, "index_topk": 8, "first_k_dense_replace": 1,
    }  # fmt: skip
    model = build_source(resolve_source(config(raw, tmp_path, "dsv32")), device="meta").model
    with pytest.raises(ConfigError, match=r"it tests its attention implementation itself \(`self.config._attn_impl"):
        apply(model, "core_attn")


@pytest.mark.parametrize("reorder", [False, True])
def test_a_test_decided_by_the_module_flags_is_followed(reorder: bool, tmp_path: Path) -> None:
    """GPT-2's eager attention takes its own reordered path only with ``reorder_and_upcast_attn``: without it the
    name's test decides nothing and core_attn applies (gradients bit-equal); with it, core_attn is refused."""
    raw = {"model_type": "gpt2", **GPT2, "reorder_and_upcast_attn": reorder}
    torch.manual_seed(0)
    model = build_source(resolve_source(config(raw, tmp_path, "gpt2")), attention="eager").model
    if reorder:
        with pytest.raises(ConfigError, match=r"`using_eager and self\.reorder_and_upcast_attn`"):
            apply(model, "core_attn")
    else:
        assert verify(model, "core_attn", seq_len=16).bit_exact


def test_a_profile_refuses_a_policy_that_replays_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Were ``apply`` to let Falcon's core_attn through, the profile would see a layer that replays nothing (no
    recompute FLOPs: the issue's -33 % step time): it records the policy as refused instead of pricing it."""
    monkeypatch.setattr("recompute.checkpointing.swap_changes", lambda *args: None)
    source = resolve_source(config(FALCON, tmp_path, "falcon"))
    prof = profile(source, Workload(seq_len=16, micro_batch=1, dtype="fp32", device="cpu"))
    (kind,) = prof.kinds
    assert "core_attn" not in kind.kept and kind.refused["core_attn"].startswith("measured replaying nothing")
    assert "attn" in kind.kept and kind.recompute_flops("attn") > 0
    assert any(n.startswith("core_attn does not apply to FalconDecoderLayer") for n in prof.notes)
