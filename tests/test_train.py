"""Training: recomputation changes no loss, resume continues exactly, data sources, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import recompute
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.train import TrainConfig, compare_train, read_metrics, train
from recompute.train.checkpoint import _check_same_run, checkpoints
from recompute.train.corpus import generate_stories
from recompute.train.data import BPETokenizer, load_text
from tiny import TRAIN

TINY = TRAIN


def tiny(tmp_path: Path, **changes: object) -> TrainConfig:
    return TrainConfig.of(**{**TINY, "out": str(tmp_path / "run"), **changes})  # type: ignore[arg-type]


def test_policies_give_identical_losses_with_dropout_on(tmp_path: Path) -> None:
    rows, runs = compare_train(tiny(tmp_path, grad_accum=2), ["none", "block", "attn+mlp"])
    reference = runs[0].losses
    assert len(reference) == 6 and reference[-1] < reference[0]
    assert runs[0].spec.dropout == 0.1
    for row, run in zip(rows, runs):
        assert run.losses == pytest.approx(reference, abs=1e-6), row.policy
        assert row.max_loss_diff <= 1e-6


class Killed(Exception):
    pass


def test_resume_after_a_kill_continues_exactly(tmp_path: Path) -> None:
    whole = train(tiny(tmp_path / "a", steps=8, checkpoint_every=4))

    def kill_after_step_5(step: int) -> None:
        if step == 5:  # after the checkpoint at step 4 and one more step that the resume must redo
            raise Killed

    config = tiny(tmp_path / "b", steps=8, checkpoint_every=4)
    with pytest.raises(Killed):
        train(config, on_step=kill_after_step_5)
    metrics = Path(config.out) / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 6, "lo')  # torn by the kill, mid-append
    assert [m["step"] for m in read_metrics(metrics)] == list(range(6))  # the torn line is dropped
    resumed = train(config.replace(resume=True))
    assert resumed.resumed_from == 4
    assert resumed.losses == whole.losses  # bit-exact: same data order, same RNG state, same weights
    lines = metrics.read_text().splitlines()  # rewritten from the checkpoint's metrics, then appended to
    assert [json.loads(line)["step"] for line in lines] == list(range(8))


def test_metrics_reader_drops_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"st')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"st\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_metrics(path)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny(tmp_path, steps=4, checkpoint_every=2)
    save = torch.save

    def crash_writing_step_4(obj: dict[str, object], f: object) -> None:
        if obj["step"] == 4:
            f.write(b"PK\x03\x04 half a zip")  # type: ignore[attr-defined]
            raise Killed
        save(obj, f)

    monkeypatch.setattr(torch, "save", crash_writing_step_4)
    with pytest.raises(Killed):
        train(config)
    folder = Path(config.out) / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_0000002.pt"]  # the half-written file removed
    (folder / "step_0000004.pt.tmp").write_bytes(b"PK\x03\x04 half a zip")  # what a kill -9 mid-write leaves
    monkeypatch.undo()
    assert train(config.replace(resume=True)).resumed_from == 2
    assert sorted(p.name for p in folder.iterdir()) == ["step_0000002.pt", "step_0000004.pt"]


def flip_bit(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of ``tensor``'s bytes where they lie in the file ``path`` (found by content)."""
    raw, data = bytearray(path.read_bytes()), tensor.contiguous().numpy().tobytes()
    at = raw.find(data)
    assert at >= 0 and raw.find(data, at + 1) == -1, "the tensor's bytes are not in the file exactly once"
    raw[at + len(data) // 2] ^= 0x04
    path.write_bytes(raw)


def test_resume_passes_over_a_checkpoint_with_a_flipped_bit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny(tmp_path, steps=6, checkpoint_every=3)
    whole = train(config)
    newest = checkpoints(Path(config.out))[-1]
    flip_bit(newest, torch.load(newest, weights_only=True)["model"]["layers.0.mlp.c_fc.weight"])
    capsys.readouterr()
    resumed = train(config.replace(resume=True))
    assert resumed.resumed_from == 3 and resumed.losses == whole.losses  # from the older checkpoint, exactly
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "step_0000006.pt' is damaged: tensor 'model.layers.0.mlp.c_fc.weight' does not match" in err[0]
    assert "resuming from the older " in err[0] and err[0].endswith("step_0000003.pt' instead")


def test_resume_refuses_a_flipped_bit_when_no_checkpoint_verifies(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=2)
    train(config)
    path = checkpoints(Path(config.out))[-1]
    state = torch.load(path, weights_only=True)
    state["model"]["layers.1.attn.c_attn.weight"].view(torch.int32)[3, 5] ^= 1 << 20  # one bit of one weight
    torch.save(state, path)  # the stored checksums stay those of the tensors as trained
    message = (
        r"step_0000002.pt' is damaged: tensor 'model.layers.1.attn.c_attn.weight' does not match its stored "
        r"CRC-32, and it is the only checkpoint; start over with --overwrite instead of --resume$"
    )
    with pytest.raises(ConfigError, match=message):
        train(config.replace(resume=True))


def test_training_outlives_a_closed_pipe(tmp_path: Path) -> None:
    """``recompute train ... 2>&1 | head -1``: the progress lines that find the pipe closed are dropped."""
    config = tiny(tmp_path, steps=12)
    src = str(Path(recompute.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "recompute", *config.command_line()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    assert proc.wait(timeout=300) == 0, first
    out = Path(config.out)
    assert [p.name for p in checkpoints(out)] == ["step_0000012.pt"]
    assert len(read_metrics(out / "metrics.jsonl")) == 12 and (out / "sample.txt").exists()


def test_resume_refuses_missing_corrupt_and_foreign_checkpoints(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=2)
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(config.replace(resume=True))
    train(config)
    with pytest.raises(ConfigError, match=r"different run .*seed"):
        train(config.replace(resume=True, seed=7))
    newest = checkpoints(Path(config.out))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a crash mid-copy
    with pytest.raises(ConfigError, match="unreadable"):
        train(config.replace(resume=True))


def test_a_second_run_into_a_run_is_refused_until_resume_or_overwrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import recompute.train.loop as loop

    first = tiny(tmp_path, steps=3)
    assert main(first.command_line()) == 0
    out = Path(first.out)
    before = (out / "metrics.jsonl").read_text()
    load_text = loop.load_text
    monkeypatch.setattr(loop, "load_text", lambda *a, **k: pytest.fail("the refused run started"))
    again = first.command_line()
    refused = {
        "already holds a run (metrics.jsonl, sample.txt, 1 checkpoint); add --resume to continue it, "
        "or --overwrite to delete it and start over": again,
        "--resume continues the run in --out and --overwrite deletes it": [*again, "--resume", "--overwrite"],
    }
    for message, argv in refused.items():
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert (out / "metrics.jsonl").read_text() == before
    monkeypatch.setattr(loop, "load_text", load_text)
    assert main([*tiny(tmp_path, steps=2).command_line(), "--overwrite"]) == 0
    assert [p.name for p in checkpoints(out)] == ["step_0000002.pt"]  # step 3's went with the old run
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]


def test_checkpoints_are_kept_to_the_newest_few(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=6, checkpoint_every=2, keep=2)
    train(config)
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
    assert main(argv) == 2  # the out holds the runs: refused before any training
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty (block, loss.png, none)" in err[0] and "--overwrite" in err[0], err
    assert main([*argv, "--policies", "none", "--overwrite"]) == 0
    assert not (tmp_path / "block" / "metrics.jsonl").exists()  # the earlier comparison's runs are gone


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

    spec = build_spec(TrainConfig.of(model="llama3.1-8b", n_layers=2, hidden=256, n_heads=8), vocab=256)
    assert (spec.n_kv_heads, spec.d_ff, spec.mlp) == (8, 768, "swiglu")  # 8 KV heads kept; 8h/3 rounded to 256
    spec = build_spec(TrainConfig.of(model="llama3.1-8b", n_layers=2, hidden=256, n_heads=4), vocab=256)
    assert spec.n_kv_heads == 4  # 8 KV heads cannot serve 4 query heads: plain multi-head attention


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_deletes_nothing_until_the_new_run_has_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --policy, a plan for another model, a model that breaks its convention, a crash in the first steps:
    the earlier run (metrics, sample, both checkpoints) stays byte for byte, and nothing is left beside it."""
    config = tiny(tmp_path, steps=4, checkpoint_every=2)
    train(config)
    out = Path(config.out)
    before = _snapshot(out)
    assert len(checkpoints(out)) == 2 and set(before) >= {"metrics.jsonl", "sample.txt"}
    plan = tmp_path / "plan.json"
    recompute.Policy(layers=("block",) * 12, model="gpt2-medium").save(plan)
    again = [*config.command_line(), "--overwrite"]
    for bad in (["--policy", "nope"], ["--policy", str(plan)], ["--policy", str(tmp_path / "missing.json")]):
        assert main([*again, *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
        assert _snapshot(out) == before, bad

    def crash_after_step_0(step: int) -> None:
        if step == 0:  # before the first checkpoint (after step 1 of 2)
            raise Killed

    with pytest.raises(Killed):
        train(config.replace(overwrite=True, seed=7), on_step=crash_after_step_0)
    assert _snapshot(out) == before
    train(config.replace(overwrite=True, steps=2, seed=7))  # a new run that gets its checkpoint replaces it
    assert [p.name for p in checkpoints(out)] == ["step_0000002.pt"] and not (out / ".overwritten").exists()
    assert [m["step"] for m in read_metrics(out / "metrics.jsonl")] == [0, 1]


def test_an_overwrite_killed_before_its_checkpoint_keeps_the_earlier_run_aside(tmp_path: Path) -> None:
    config = tiny(tmp_path, steps=2)
    train(config)
    out = Path(config.out)
    before = _snapshot(out)
    from recompute.train.run_files import set_aside

    set_aside(out)  # what a killed --overwrite leaves: the earlier run in .overwritten
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # and the killed run's first step
    with pytest.raises(ConfigError, match=r"an earlier run set aside by an --overwrite that did not finish"):
        train(config)

    def crash(step: int) -> None:
        raise Killed

    with pytest.raises(Killed):  # the next --overwrite fails too: the killed attempt's files go, the run comes back
        train(config.replace(overwrite=True), on_step=crash)
    assert _snapshot(out) == before


def test_a_damaged_metrics_line_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tiny(tmp_path, steps=4, checkpoint_every=2)
    train(config)
    metrics = Path(config.out) / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    row = json.loads(lines[1])
    assert set(row) == {"step", "loss", "lr", "step_time_s", "tokens_per_s", "peak_bytes", "crc32"}
    lines[1] = lines[1].replace(f'"loss": {row["loss"]}', f'"loss": {row["loss"] + 1e-3}')  # one figure changed
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"line 2 does not match its CRC-32; the file is damaged"):
        read_metrics(metrics)
    capsys.readouterr()
    train(config.replace(resume=True, steps=5))
    err = capsys.readouterr().err.strip().splitlines()
    assert any("metrics.jsonl' line 2 does not match its CRC-32; rewritten from" in e for e in err), err
    assert [m["step"] for m in read_metrics(metrics)] == list(range(5))  # whole again


def test_a_checkpoint_whose_stored_metrics_changed_is_passed_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tiny(tmp_path, steps=4, checkpoint_every=2)
    whole = train(config)
    newest = checkpoints(Path(config.out))[-1]
    state = torch.load(newest, weights_only=True)
    state["metrics"][1]["loss"] += 1.0  # a flipped byte in a stored loss: torch.load reads it silently
    torch.save(state, newest)
    capsys.readouterr()
    resumed = train(config.replace(resume=True))
    assert resumed.resumed_from == 2 and resumed.losses == whole.losses  # from the older checkpoint
    err = capsys.readouterr().err
    assert "step_0000004.pt' is damaged: its metrics do not match their stored CRC-32" in err


def test_a_checkpoint_from_before_the_workload_resumes_at_its_per_rank_micro_batch(tmp_path: Path) -> None:
    """Runs checkpointed while ``--micro-batch`` counted every data-parallel rank (their configs have no dtype)
    resume at B/D sequences per rank; the old B per rank would train on other rows, and is refused."""
    config = tiny(tmp_path, dp=2, micro_batch=2)
    old = {k: v for k, v in config.to_dict().items() if k not in ("dtype", "precision")} | {"micro_batch": 4}
    _check_same_run(old, config, tmp_path)
    with pytest.raises(ConfigError, match=r"micro_batch: 2 -> 4"):
        _check_same_run(old, config.replace(micro_batch=4), tmp_path)
    with pytest.raises(ConfigError, match=r"micro_batch: 4 -> 2"):  # a checkpoint of this meaning compares as it is
        _check_same_run(config.replace(micro_batch=4).to_dict(), config, tmp_path)
