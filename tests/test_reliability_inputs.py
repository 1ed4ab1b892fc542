"""Issue 27: the newer commands' inputs. Every path is checked before any work (a target that takes no file, an
input that is no regular file or too large or not finite JSON), factories that raise or exit, damaged profiles,
config sizes beyond sane limits, runs that cannot fit in memory and lists of 10,000 copies: each ends in one
line and exit 2, before the work (the work is stubbed to fail the test if reached), with nothing written.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import tiny
from recompute.cli import main
from recompute.core.errors import ConfigError
from recompute.core.files import atomic_write, check_writable, read_json_file
from recompute.core.profile import Profile
from recompute.core.workload import LIMITS
from recompute.runtime import HEADROOM
from recompute.train.config import TrainConfig
from recompute.train.preflight import preset_need

SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2"]
TRAIN = ["--steps", "1", "--seq-len", "16", "--micro-batch", "1", "--sample-tokens", "1", *SMALL]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI; assert a one-line refusal (exit 2, nothing on stdout, no traceback) and return that line."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def _no_work(*args: object, **kwargs: object) -> None:
    pytest.fail("the work started before the check refused")


WORK = {
    "plan": "recompute.cli.plan.plan",
    "profile": "recompute.cli.profile.progress_bar",
    "calibrate": "recompute.cli.calibrate.calibrate",
    "compare-train": "recompute.cli.train.compare_train",
    "train": "recompute.cli.train.train",
    "report": "recompute.cli.report.build_report",
}


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    for target in WORK.values():
        monkeypatch.setattr(target, _no_work)


@pytest.fixture
def odd(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """Paths of every kind a user may pass by mistake; a FIFO guard opens the FIFO's other end after 20 s, so a
    reader that blocked fails the test instead of hanging it."""
    loop = tmp_path / "loop"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2**30)  # sparse: 1 GiB that takes no disk
    (tmp_path / "folder").mkdir()
    files = {
        "/dev/zero": Path("/dev/zero"),
        "a FIFO": fifo,
        "a symlink loop": loop,
        "1 GiB": big,
        "a folder": tmp_path / "folder",
        "NaN": tmp_path / "nan.json",
        "Infinity": tmp_path / "inf.json",
        "1e999": tmp_path / "huge.json",
    }
    files["NaN"].write_text('{"format": "recompute.policy/1", "name": "block", "x": NaN}')
    files["Infinity"].write_text('{"model_type": "gpt2", "n_embd": Infinity}')
    files["1e999"].write_text('{"rows": [{"peak": 1e999}]}')
    stop, opened = threading.Event(), []

    def guard() -> None:
        if not stop.wait(20):
            opened.append(True)
            os.close(os.open(fifo, os.O_WRONLY))  # unblocks a reader stuck in open()

    thread = threading.Thread(target=guard, daemon=True)
    thread.start()
    yield files
    stop.set()
    assert not opened, "a command opened the FIFO and blocked"
    with pytest.raises(OSError):  # ENXIO: nobody has it open for reading
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


UNWRITABLE = {
    "empty": ("", "is empty"),
    "/proc": ("/proc/recompute-out.json", "cannot write in the folder '/proc'"),
    "/sys": ("/sys/recompute-out.json", "cannot write in the folder '/sys'"),
    "/dev/full": ("/dev/full", "is a character device, not a file"),
    "symlink loop": ("{tmp}/loop", "Too many levels of symbolic links"),
    "a folder": ("{tmp}", "is a folder"),
    "missing folder": ("{tmp}/no/x.json", "does not exist; create it first"),
}
OUTPUTS = {
    "plan -o": ["plan", "--budget", "80GiB", "--cost", "flops", "-o"],
    "profile -o": ["profile", "--model", "gpt2", "--seq-len", "32", "--no-time", "-o"],
    "calibrate -o": ["calibrate", "--quick", "--device", "cpu", "-o"],
    "compare-train --png": ["compare-train", "--out", "{tmp}/runs", *TRAIN, "--png"],
    "report -o": ["report", "--no-time", "-o"],
}


@pytest.mark.parametrize("target", list(UNWRITABLE))
@pytest.mark.parametrize("command", list(OUTPUTS))
def test_an_output_that_cannot_be_written_is_refused_before_the_work(
    command: str, target: str, tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    os.symlink(tmp_path / "loop2", tmp_path / "loop")
    os.symlink(tmp_path / "loop", tmp_path / "loop2")
    path, says = (s.format(tmp=tmp_path) for s in UNWRITABLE[target])
    argv = [a.format(tmp=tmp_path) for a in OUTPUTS[command]]
    line = refused(capsys, *argv, path)
    assert says in line and argv[-1] in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "loop2"]  # nothing written, no probe left


def test_plan_export_beside_that_cannot_be_written_is_refused_before_the_work(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plan.torchtitan.toml").mkdir()
    argv = ["plan", "--budget", "80GiB", "--cost", "flops", "-o", str(tmp_path / "plan.json"), "--export", "torchtitan"]
    line = refused(capsys, *argv)
    assert "--export" in line and "plan.torchtitan.toml' is a folder" in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["plan.torchtitan.toml"]  # the plan file not written either


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "--budget", "80GiB", "--cost", "flops", "--gpus-per-node", "0"], "must be a positive integer, got 0"),
        (["estimate", "--no-time", "--gpus-per-node", "100000"], "--gpus-per-node must be at most 65,536, got 100,000"),
        (["plan", "--budget", "80GiB", "--tp", "2", "--gpus-per-node", "3"], "tp group of 2 ranks does not divide"),
        (["calibrate", "--device", "cpu", "-o", "{tmp}/d.json", "--threads", "100000"], "--threads must be at most"),
    ],
    ids=["gpus-per-node 0 unpriced", "gpus-per-node 100000", "gpus-per-node off the layout", "threads 100000"],
)
def test_node_and_thread_counts_are_checked_before_the_work(
    argv: list[str],
    says: str,
    tmp_path: Path,
    no_work: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("recompute.planning.model_works", _no_work)  # the layout refused before the step is traced
    assert says in refused(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert list(tmp_path.iterdir()) == []


def test_calibrate_collectives_names_output_when_the_profile_there_is_damaged(
    tmp_path: Path, no_work: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from recompute.core.hardware import datasheet_device

    monkeypatch.setattr("recompute.cli.calibrate.under_torchrun", lambda: True)
    monkeypatch.setattr("recompute.cli.calibrate.dist.init_process_group", lambda *args: None)
    monkeypatch.setattr("recompute.cli.calibrate.dist.get_rank", lambda: 0)
    path = tmp_path / "device.json"
    path.write_text(json.dumps({**datasheet_device("h100-80gb").to_dict(), "network": "x"}))
    line = refused(capsys, "calibrate", "--collectives", "--device", "cpu", "-o", str(path))
    assert f"--output {str(path)!r}: 'network' must be an object, got 'x'" in line, line


@pytest.mark.parametrize("target", ["/proc/run", "/sys/run", "/dev/full", "{tmp}/loop/run", "{tmp}/afile/run", ""])
def test_train_out_that_cannot_be_written_is_refused_before_the_work(
    target: str, tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    (tmp_path / "afile").write_text("")
    for command in ("train", "compare-train"):
        assert "--out" in refused(capsys, command, *TRAIN, "--out", target.format(tmp=tmp_path))


def test_a_read_only_folder_is_refused(tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    try:
        (folder / "probe").touch()
        pytest.skip("this user writes into a read-only folder (root: run under `setpriv --bounding-set -dac_override`)")
    except PermissionError:
        pass
    line = refused(capsys, "plan", "--budget", "80GiB", "--cost", "flops", "-o", str(folder / "plan.json"))
    assert "Permission denied" in line
    assert "--out" in refused(capsys, "train", *TRAIN, "--out", str(folder / "run"))


def test_compare_train_png_must_be_a_png(tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(capsys, "compare-train", "--out", str(tmp_path / "runs"), *TRAIN, "--png", str(tmp_path / "a.json"))
    assert "is not a .png path" in line


def test_atomic_write_leaves_the_old_file_when_the_disk_is_full(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old")
    check_writable(path, "-o")

    def full(f: object) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(ConfigError, match=r"No space left on device; .* is left as it was"):
        atomic_write(path, full)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    atomic_write(path, "new")
    assert path.read_text() == "new"


READERS = {
    "--model": ["estimate", "--model"],
    "--policy": ["estimate", "--policy"],
    "--bench": ["plan", "--budget", "80GiB", "--cost", "measured", "--bench"],
    "--profile": ["plan", "--budget", "80GiB", "--profile"],
    "--device-profile": ["estimate", "--device-profile"],
    "report --plan": ["report", "--no-time", "-o", "{tmp}/r.html", "--plan"],
    "--data": ["train", *TRAIN, "--out", "{tmp}/run", "--data"],
    "verify --model": ["verify", "--model"],
}
SAYS = {
    "/dev/zero": "is a character device, not a regular file",
    "a FIFO": "is a FIFO (named pipe), not a regular file",
    "a symlink loop": "Too many levels of symbolic links",
    "1 GiB": "holds 1 GiB, more than the",
    "NaN": "NaN is not a number JSON allows",
    "Infinity": "Infinity is not a number JSON allows",
    "1e999": "the number 1e999 is out of range",
}


NOT_JSON = ("/dev/zero", "a FIFO", "a symlink loop", "1 GiB")
CASES = [(r, k) for r in READERS for k in SAYS if k in NOT_JSON or r != "--data"]
"""Every reader with every kind of file (``--data`` is text: a NaN in it is a word)."""


@pytest.mark.parametrize(("reader", "kind"), CASES, ids=[f"{r} {k}" for r, k in CASES])
def test_an_input_that_is_not_a_sane_regular_file_is_refused_unread(
    reader: str,
    kind: str,
    odd: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("recompute.train.loop.build_source", _no_work)
    argv = [a.format(tmp=tmp_path) for a in READERS[reader]]
    line = refused(capsys, *argv, str(odd[kind]))
    assert SAYS[kind] in line, line


def test_the_data_cap_is_stated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from recompute.train.data import MAX_DATA_BYTES

    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):  # each under the cap, together over it
        with open(folder / name, "wb") as f:
            f.truncate(MAX_DATA_BYTES // 2 + 1)
    line = refused(capsys, "train", *TRAIN, "--out", str(tmp_path / "run"), "--data", str(folder))
    assert "holds 128 MiB of .txt files; pass a text file or a folder of .txt files, at most 128 MiB" in line
    assert "--data is empty" in refused(capsys, "train", *TRAIN, "--out", str(tmp_path / "run"), "--data", "")


def test_json_reader_takes_what_json_writes(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"a": [1, 2.5, -3e300, None, True], "b": {"c": "\u00e9"}}))
    assert read_json_file(path, "--x", fix="")["a"] == [1, 2.5, -3e300, None, True]


DAMAGED = {
    "no kinds": (lambda d: d.update(kinds=[]), "kinds must be a non-empty list of layer kinds"),
    "unknown workload key": (lambda d: d["workload"].update(bogus=1), "workload has an unknown key 'bogus'"),
    "kind index": (lambda d: d.update(layer_kind=[0, 5]), "layer_kind must be kind indices below 1"),
    "empty kind": (lambda d: d["kinds"][0].update(kept={}), "kinds[0].kept must be an object with a figure"),
    "negative bytes": (lambda d: d.update(parameters=-5), "parameters must be a non-negative integer, got -5"),
    "fractional FLOPs": (lambda d: d.update(step_flops=1.5), "step_flops must be a JSON int, got 1.5"),
    "string FLOPs": (lambda d: d["kinds"][0].update(forward_flops="1e6"), "forward_flops must be a JSON int"),
    "no link": (lambda d: d.update(links={}), "links['0>0'] must be an object per policy"),
    "short per-layer list": (lambda d: d.update(base_forward=[1]), "base_forward must be a list of 2 figures"),
    "unknown key": (lambda d: d.update(peak=1), "has an unknown key 'peak'"),
    "missing key": (lambda d: d.pop("last"), "lacks 'last'"),
    "bad work": (lambda d: d["outer_work"].update(x=[["mm", 1]]), "outer_work['x'] must be a list of [op"),
    "parallel workload": (lambda d: d["workload"].update(tp=2), "workload['tp'] must be 1 (a profile measures one"),
    "workload key missing": (lambda d: d["workload"].pop("seq_len"), "the profile's workload lacks 'seq_len'"),
    "workload value": (
        lambda d: d["workload"].update(seq_len=-5),
        "workload is not one recompute takes (seq_len must be a positive integer, got -5)",
    ),
    "zero FLOPs": (lambda d: d.update(step_flops=0), "step_flops must be a positive integer, got 0"),
    "negative fixed bytes": (  # was "the profile's ['fixed']['optimizer step']": an empty field name
        lambda d: d["fixed"].update({"optimizer step": -5}),
        "the profile's fixed['optimizer step'] must be a non-negative integer, got -5",
    ),
    "negative forward op count": (
        lambda d: d["kinds"][0]["forward_ops"].update(mm=-1),
        "the profile's kinds[0].forward_ops['mm'] must be a non-negative integer, got -1",
    ),
    "a kind's layers": (lambda d: d["kinds"][0].update(layers=[0]), "kinds[0].layers must be the layers whose"),
    "20,000 layers": (
        lambda d: d.update(layer_kind=[0] * 20_000),
        "layer_kind must be a list of 1 to 16,384 kind indices",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_profile_is_refused_in_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(tiny.profile_dict()))
    assert main(["plan", "--profile", str(good), "--budget", "1GiB", "--cost", "flops"]) == 0
    capsys.readouterr()
    data = tiny.profile_dict()
    change, says = DAMAGED[damage]
    change(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for argv in (["plan", "--budget", "1GiB", "--cost", "flops"], ["estimate", "--no-time"]):
        line = refused(capsys, *argv, "--profile", str(bad))
        assert says in line and f"--profile {str(bad)!r}" in line, line
    with pytest.raises(ConfigError, match="make it again with recompute profile"):
        Profile.from_dict(data)


def test_a_profile_is_not_planned_with_what_it_cannot_take(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from recompute import ModelSpec, Workload

    good = tmp_path / "good.json"
    good.write_text(json.dumps(tiny.profile_dict()))
    bench = tiny.write_bench(tmp_path / "b.json", ModelSpec.from_name("gpt2"), Workload(seq_len=512), {"none": 1.0})
    plan = ["plan", "--profile", str(good), "--budget", "1GiB"]
    line = refused(capsys, *plan, "--cost", "measured", "--bench", str(bench))  # was planned in FLOPs, exit 0
    assert "--cost measured prices a preset by its bench results" in line, line
    line = refused(capsys, *plan, "--trace")  # traced the default gpt2 against the profile's plan
    assert "--trace traces the model's real step, which a --profile file does not hold: add --model" in line, line


def test_a_policy_file_that_is_refused_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(tiny.profile_dict()))  # a profile passed as a plan
    line = refused(capsys, "estimate", "--no-time", "--policy", str(path))
    assert f"policy file {str(path)!r}: unknown policy format 'recompute.profile/2'" in line, line
    path.write_text(json.dumps({"format": "recompute.policy/1", "name": "block", "every": 0}))
    line = refused(capsys, "estimate", "--no-time", "--policy", str(path))  # the file's key, not --every
    assert f"policy file {str(path)!r}: every must be a positive integer, got 0" in line, line


_FORWARD = (
    "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.emb = torch.nn.Embedding(256, 8)\n"
    "        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])\n"
    "    def forward(self, idx, targets=None):\n        {body}\n"
    "def make():\n    return M()\n"
)
"""A factory whose model's forward runs ``body``."""
FACTORIES = {
    "syntax error": ("def make(:\n", "importing {m} raised SyntaxError: invalid syntax ({m}.py, line 1)"),
    "runtime error at import": ("raise RuntimeError('boom')\n", "importing {m} raised RuntimeError: boom"),
    "sys.exit(0) at import": ("import sys\nsys.exit(0)\n", "importing {m} called sys.exit(0)"),
    "factory raises": ("def make():\n    raise KeyError('w')\n", "{m}:make() raised KeyError: 'w'"),
    "factory exits": ("def make():\n    raise SystemExit(0)\n", "{m}:make() called sys.exit(0)"),
    "forward returns logits": (
        "import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(256, 8)\n"
        "        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8)])\n"
        "    def forward(self, idx, targets=None):\n        return self.layers[0](self.emb(idx))\n"
        "def make():\n    return M()\n",
        "M(idx, targets) returned a tensor of shape (1, 8, 8), expected (logits, loss)",
    ),
    "forward raises": (_FORWARD.format(body="raise ValueError('broke')"), "M.forward raised ValueError: broke"),
    "forward exits": (_FORWARD.format(body="raise SystemExit(0)"), "M.forward called sys.exit(0)"),
    "forward without targets": (
        _FORWARD.format(body="pass").replace("idx, targets=None", "idx"),
        "M.forward raised TypeError: M.forward() takes 2 positional arguments but 3 were given",
    ),
}
FACTORY_COMMANDS = {
    "trace": ["trace", "--seq-len", "8", "--micro-batch", "1"],
    "profile": ["profile", "--seq-len", "8", "--micro-batch", "1", "--device", "cpu", "--no-time"],
    "estimate": ["estimate", "--seq-len", "8", "--micro-batch", "1", "--device", "cpu", "--no-time"],
    "bench": ["bench", "--seq-len", "8", "--micro-batch", "1", "--no-time", "--steps", "1", "--warmup", "0"],
    "train": ["train", "--seq-len", "8", "--micro-batch", "1", "--steps", "1", "--sample-tokens", "1"],
    "verify": ["verify", "--seq-len", "8", "--micro-batch", "1"],
}


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_a_factory_that_raises_or_exits_is_one_line_naming_it(
    factory: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RECOMPUTE_CACHE", str(tmp_path / "cache"))
    source, says = FACTORIES[factory]
    for i, (command, argv) in enumerate(FACTORY_COMMANDS.items()):
        module = f"factory_{abs(hash(factory)) % 10**8}_{i}"  # a new module each time: imports are cached
        (tmp_path / f"{module}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        extra = ["--out", str(tmp_path / f"run{i}")] if command == "train" else []
        if command == "train":
            extra += ["--layers", "4", "--hidden", "256", "--heads", "4"]  # TrainConfig's defaults: not resizing
        line = refused(capsys, *argv, *extra, "--model", f"{module}:make")
        assert says.format(m=module) in line, (command, line)
        assert f"{module}:make" in line, (command, line)


CONFIGS = {
    "10^6 layers": ({"n_layer": 10**6}, "n_layer must be a whole number from 1 to 16,384, got 1000000"),
    "string hidden": ({"n_embd": "64"}, "n_embd must be a whole number from 1 to 1,048,576, got '64'"),
    "float hidden": ({"n_embd": 64.5}, "got 64.5"),
    "bool layers": ({"n_layer": True}, "n_layer must be a whole number from 1 to 16,384, got True"),
    "huge vocabulary": ({"vocab_size": 10**9}, "vocab_size must be a whole number from 1 to 16,777,216"),
    "heads that do not divide": ({"n_head": 3}, "n_head (3) does not divide its n_embd (64)"),
    "a bad MLP width per layer": ({"n_inner": [256, "x"]}, "n_inner must be a whole number from 1 to 16,777,216 (or"),
    "a list hidden size": ({"n_embd": [64, 64]}, "n_embd must be a whole number from 1 to 1,048,576, got [64, 64]"),
    "kv heads that do not divide": ({"num_key_value_heads": 3}, "num_key_value_heads (3) does not divide its n_head"),
    "top-k above the experts": (
        {"num_local_experts": 4, "num_experts_per_tok": 8},
        "num_experts_per_tok must be a whole number from 1 to its 4 experts, got 8",
    ),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_config_beyond_sane_sizes_is_refused_before_building(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """10^6 layers kept building for minutes. Refused before transformers is handed the config: held by making
    its config and model constructors fail, not by a wall-clock limit, which a loaded machine breaks (issue 38)."""
    changes, says = CONFIGS[config]
    path = tmp_path / "config.json"
    body = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64}
    path.write_text(json.dumps({**body, **changes}))
    monkeypatch.setattr("transformers.AutoConfig.for_model", _never_built)
    monkeypatch.setattr("recompute.models.source._build_config", _never_built)
    for argv in (["trace", "--seq-len", "8"], ["estimate", "--seq-len", "8", "--device", "cpu", "--no-time"]):
        assert says in refused(capsys, *argv, "--model", str(path))


def _never_built(*args: object, **kwargs: object) -> None:
    raise AssertionError("the input was handed on to the work before it was checked")


def test_a_run_that_cannot_fit_is_refused_with_the_largest_that_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    have = 4 * 2**30
    monkeypatch.setattr("recompute.train.preflight.available_memory", lambda device: have)
    monkeypatch.setattr("recompute.train.loop.build_source", _no_work)
    argv = ["train", "--steps", "1", "--out", str(tmp_path / "run"), "--micro-batch", "4096", "--seq-len", "1024"]
    argv += ["--device", "cpu"]
    line = refused(capsys, *argv)
    assert "train needs about " in line and "but 4.00 GiB is available on cpu" in line, line
    fits = int(line.split("--micro-batch ")[1].split()[0])
    config = TrainConfig.of(micro_batch=4096, seq_len=1024, device="cpu")
    spec = _train_spec(config)
    need = lambda b: preset_need(spec, config, "cpu", micro_batch=b, seq_len=1024)  # noqa: E731
    assert need(fits) <= HEADROOM * have < need(fits + 1)  # the largest micro-batch that fits, exactly
    assert "needs about" in refused(capsys, "compare-train", *argv[1:], "--policies", "none,block")


def _train_spec(config: TrainConfig) -> object:
    from recompute.train.loop import build_spec

    return build_spec(config, vocab=256)


def test_a_model_larger_than_memory_is_refused_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("recompute.train.loop.build_source", _no_work)
    argv = ["--layers", "0", "--hidden", "0", "--heads", "0", "--steps", "1", "--seq-len", "64", "--micro-batch", "1"]
    monkeypatch.setattr("recompute.train.preflight.available_memory", lambda device: 24 * 2**30)
    line = refused(capsys, "train", "--model", "llama3.1-8b", *argv, "--out", str(tmp_path / "run"))
    assert "even one short sequence does not fit: use a smaller model" in line
    line = refused(capsys, "train", *TRAIN[:-6], "--out", str(tmp_path / "r"), "--micro-batch", str(10**11))
    assert f"--micro-batch must be at most {LIMITS['micro_batch']:,}, got 100,000,000,000" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", *SMALL, "--no-time", "--policies"],
        ["validate", "--policies"],
        ["validate", "--models"],
        ["compare-train", "--out", "runs", "--policies"],
    ],
    ids=["bench policies", "validate policies", "validate models", "compare-train policies"],
)
def test_a_list_of_10000_copies_is_refused_at_once(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    item = "gpt2" if argv[-1] == "--models" else "none"
    if argv[-1] == "--models":
        assert "--models names 'gpt2' more than once" in refused(capsys, *argv, ",".join([item] * 10_000))
        return
    # refused before any work: held by making the work fail, not by a wall-clock limit (a loaded machine breaks it)
    for work in ("bench.bench", "validate.validate", "train.compare_train"):
        monkeypatch.setattr(f"recompute.cli.{work}", _never_built)
    assert f"--policies names {item!r} more than once" in refused(capsys, *argv, ",".join([item] * 10_000))
    assert list(tmp_path.iterdir()) == []


BENCH_ROWS = {
    "string time": ({"step_s": "fast"}, "none: step_s must be a number above 0, got 'fast'"),
    "negative time": ({"step_s": -1.0}, "none: step_s must be a number above 0, got -1.0"),
    "zero time": ({"step_s": 0}, "none: step_s must be a number above 0, got 0"),
    "negative peak": ({"peak": -5}, "none: peak must be a number at least 0, got -5"),
    "bool peak": ({"peak": True}, "none: peak must be a number at least 0, got True"),
    "no peak": ({"peak": None}, "none: peak must be a number at least 0, got None"),
    "times not a list": ({"step_times": "1,2"}, "none: step_times must be a list of seconds"),
    "policy not a string": ({"policy": 3}, "a row's policy must be a string, got 3"),
}


@pytest.mark.parametrize("damage", list(BENCH_ROWS))
def test_a_damaged_bench_result_is_refused_in_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from recompute import ModelSpec, Workload

    wl = Workload(seq_len=512)
    path = tiny.write_bench(tmp_path / "b.json", ModelSpec.from_name("gpt2"), wl, {"none": 1.0, "block": 1.2})
    data = json.loads(path.read_text())
    change, says = BENCH_ROWS[damage]
    data["rows"][0].update(change)
    path.write_text(json.dumps(data))
    for argv in (["plan", "--budget", "80GiB", "--cost", "measured"], ["report", "-o", str(tmp_path / "r.html")]):
        line = refused(capsys, *argv, "--bench", str(path))
        assert says in line and str(path) in line, line
    assert not (tmp_path / "r.html").exists()


def test_an_output_that_is_an_input_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-o`` naming the file the command reads (the config, the profile, the plan) would replace it: refused,
    the file left byte for byte."""
    config = tmp_path / "config.json"
    body = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}
    config.write_text(json.dumps({**body, "bos_token_id": 0, "eos_token_id": 0}))
    before = config.read_bytes()
    plan = ["plan", "--model", str(config), "--seq-len", "8", "--budget", "1GiB", "--device", "cpu"]
    for argv in (
        [*plan, "-o", str(config)],
        ["profile", "--model", str(config), "--seq-len", "8", "-o", str(config)],
        ["plan", "--profile", str(config), "--budget", "1GiB", "-o", str(tmp_path / "." / "config.json")],
    ):
        line = refused(capsys, *argv)
        assert "is the file --" in line and "writing it would replace that input" in line, line
    assert config.read_bytes() == before
