"""Training: recomputation changes no loss, resume continues exactly, data sources, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.train import TrainConfig, compare_train, train
from recompute.train.checkpoint import checkpoints
from recompute.train.corpus import generate_stories
from recompute.train.data import BPETokenizer, load_text
from tiny import TRAIN

TINY = TRAIN


def tiny(tmp_path: Path, **changes: object) -> TrainConfig:
    return TrainConfig(**{**TINY, "out": str(tmp_path / "run"), **changes})  # type: ignore[arg-type]


def test_policies_give_identical_losses_with_dropout_on(tmp_path: Path) -> None:
    rows, runs = compare_train(tiny(tmp_path, grad_accum=2), ["none", "block", "attn+mlp"], quiet=True)
    reference = runs[0].losses
    assert len(reference) == 6 and reference[-1] < reference[0]
    assert runs[0].spec.dropout == 0.1
    for row, run in zip(rows, runs):
        assert run.losses == pytest.approx(reference, abs=1e-6), row.policy
        assert row.max_loss_diff <= 1e-6


class Killed(Exception):
    pass


def test_resume_after_a_kill_continues_exactly(tmp_path: Path) -> None:
    whole = train(tiny(tmp_path / "a", steps=8, checkpoint_every=4), quiet=True)

    def kill_after_step_5(step: int) -> None:
        if step == 5:  # after the checkpoint at step 4 and one more step that the resume must redo
            raise Killed

    config = tiny(tmp_path / "b", steps=8, checkpoint_every=4)
    with pytest.raises(Killed):
        train(config, on_step=kill_after_step_5, quiet=True)
    resumed = train(config.replace(resume=True), quiet=True)
    assert resumed.resumed_from == 4
    assert resumed.losses == whole.losses  # bit-exact: same data order, same RNG state, same weights
    metrics = (Path(config.out) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == list(range(8))


def test_resume_refuses_missing_corrupt_and_foreign_checkpoints(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=2)
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(config.replace(resume=True), quiet=True)
    train(config, quiet=True)
    with pytest.raises(ConfigError, match=r"different run .*seed"):
        train(config.replace(resume=True, seed=7), quiet=True)
    newest = checkpoints(Path(config.out))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash mid-copy
    with pytest.raises(ConfigError, match="unreadable"):
        train(config.replace(resume=True), quiet=True)


def test_checkpoints_are_kept_to_the_newest_few(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=6, checkpoint_every=2, keep=2)
    train(config, quiet=True)
    assert [p.name for p in checkpoints(Path(config.out))] == ["step_0000004.pt", "step_0000006.pt"]
    assert (Path(config.out) / "sample.txt").read_text().startswith("Once upon a time")


def test_story_corpus_is_deterministic() -> None:
    assert generate_stories(50, seed=3) == generate_stories(50, seed=3) != generate_stories(50, seed=4)
    assert generate_stories(50).count("\n\n") == 49


def test_text_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha story")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta story")
    assert load_text(str(tmp_path / "a.txt")) == "alpha story"
    assert load_text(str(tmp_path)) == "alpha story\n\nbeta story"


def test_hf_dataset_loader_on_a_local_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "stories"
    folder.mkdir()
    rows = [{"text": s, "id": i} for i, s in enumerate(generate_stories(20).split("\n\n"))]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_text(dataset=str(folder)).startswith(rows[0]["text"])
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    assert load_text(dataset=str(saved)) == load_text(dataset=str(folder))
    with pytest.raises(ConfigError, match="cannot load dataset"):
        load_text(dataset=str(tmp_path / "nowhere"))


def test_bpe_tokenizer_round_trips() -> None:
    text = generate_stories(200)
    tok = BPETokenizer(text, vocab_size=600)
    ids = tok.encode("Once upon a time, there was a happy child named Lily.")
    assert tok.decode(ids) == "Once upon a time, there was a happy child named Lily."
    assert len(ids) < 20 and tok.vocab_size <= 600


def test_compare_train_cli_writes_table_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "compare-train",
        "--policies",
        "none,block",
        "--steps",
        "3",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--micro-batch",
        "2",
        "--sample-tokens",
        "4",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "max |loss diff|" in out and "block" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000


BAD = {
    "missing data path": ["--data", "/no/such/file.txt"],
    "empty corpus": ["--data", "EMPTY"],
    "sequence beyond positions": ["--seq-len", "4096"],
    "zero steps": ["--steps", "0"],
    "negative steps": ["--steps", "-3"],
    "unknown policy": ["--policy", "sometimes"],
    "cuda without cuda": ["--device", "cuda"],
    "data and dataset": ["--data", "EMPTY", "--dataset", "x"],
}


@pytest.mark.parametrize("argv", list(BAD.values()), ids=list(BAD))
def test_train_bad_input(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    if "--device" in argv and __import__("torch").cuda.is_available():
        pytest.skip("CUDA is available here")
    try:
        code = main(["train", "--steps", "2", "--out", str(tmp_path / "run"), *argv])
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def test_size_overrides_keep_gqa_and_derive_the_mlp_width() -> None:
    from recompute.train.loop import build_spec

    spec = build_spec(TrainConfig(model="llama3.1-8b", n_layers=2, hidden=256, n_heads=8), vocab=256)
    assert (spec.n_kv_heads, spec.d_ff, spec.mlp) == (8, 768, "swiglu")  # 8 KV heads kept; 8h/3 rounded to 256
    spec = build_spec(TrainConfig(model="llama3.1-8b", n_layers=2, hidden=256, n_heads=4), vocab=256)
    assert spec.n_kv_heads == 4  # 8 KV heads cannot serve 4 query heads: plain multi-head attention
