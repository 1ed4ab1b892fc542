"""Training text, tokenizers and a batch sampler whose order depends only on (seed, step).

Text comes from a file or a directory of ``.txt`` files, from Hugging Face ``datasets`` by name or local
path, or from the built-in story generator. Tokenizers need no download: bytes by default, or a byte-level
BPE trained on the corpus with the ``tokenizers`` package. Because batch ``k`` is drawn from a generator
seeded by (seed, k), a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from recompute.core.errors import ConfigError, require
from recompute.core.files import check_input_file, is_path, read_capped
from recompute.core.table import MiB, size
from recompute.train.corpus import generate_stories

__all__ = ["BPETokenizer", "ByteTokenizer", "TokenStream", "Tokenizer", "load_text", "make_tokenizer"]


def load_text(data: str | None = None, dataset: str | None = None, *, seed: int = 0) -> str:
    """The training text: ``data`` (file or directory), ``dataset`` (HF name or path), else built-in stories.

    Raises:
        ConfigError: a missing path, a directory without text files, or an empty corpus.
    """
    require(data is None or dataset is None, "give --data or --dataset, not both")
    if dataset is not None:
        text = _load_hf_dataset(dataset)
    elif data is not None:
        require(data != "", "--data is empty; pass a text file or a folder of .txt files")
        text = _load_path(Path(data))
    else:
        text = generate_stories(seed=seed)
    require(bool(text.strip()), f"the corpus from {data or dataset} is empty; give it some text")
    return text


MAX_DATA_BYTES = 128 * MiB
"""The most text ``--data`` reads: the trainer holds the corpus in memory as text, as a list of token ids and as
an int64 tensor (about 17 bytes per byte-token); a larger corpus belongs in a ``--dataset``."""


def _load_path(path: Path) -> str:
    """The text of ``--data``: a regular file, or the ``.txt`` files under a folder (each checked before it is
    opened: no FIFO, device or symlink loop), at most ``MAX_DATA_BYTES`` in all."""
    fix = "pass a text file or a folder of .txt files"
    if not is_path(path):
        raise ConfigError(f"--data {str(path)!r} does not exist; {fix}")
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    require(bool(files), f"--data {str(path)!r} holds no .txt files")
    fix = f"{fix}, at most {size(MAX_DATA_BYTES)} (a larger corpus: --dataset)"
    total = sum(check_input_file(f, "--data", max_bytes=MAX_DATA_BYTES, fix=fix).stat().st_size for f in files)
    if total > MAX_DATA_BYTES:
        raise ConfigError(f"--data {str(path)!r} holds {size(total)} of .txt files; {fix}")
    return "\n\n".join(
        read_capped(f, "--data", max_bytes=MAX_DATA_BYTES, fix=fix).decode("utf-8", errors="replace") for f in files
    )


def _load_hf_dataset(name: str) -> str:
    """Concatenate the text column of a Hugging Face dataset (``name`` or ``name:split``; default ``train``)."""
    try:
        import datasets
    except ImportError as e:
        raise ConfigError("--dataset needs the datasets package: pip install 'recompute[data]'") from e
    path, _, split = name.partition(":")
    try:
        if (Path(path) / "dataset_info.json").exists():  # a dataset saved with save_to_disk
            loaded = datasets.load_from_disk(path)
            ds = loaded[split or "train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            ds = datasets.load_dataset(path, split=split or "train")
    except Exception as e:  # datasets raises many types (network, missing files, bad splits)
        raise ConfigError(f"cannot load dataset {name!r}: {str(e).splitlines()[0]}") from e
    column = (
        "text"
        if "text" in ds.column_names
        else next((c for c, f in ds.features.items() if getattr(f, "dtype", None) == "string"), None)
    )
    require(column is not None, f"dataset {name!r} has no text column; columns: {ds.column_names}")
    return "\n\n".join(str(t) for t in ds[column])


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE trained on the corpus with the ``tokenizers`` package."""

    def __init__(self, text: str, vocab_size: int = 2048) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import decoders, models, pre_tokenizers, trainers
        except ImportError as e:
            raise ConfigError("--tokenizer bpe needs the tokenizers package: pip install 'recompute[data]'") from e
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
        self._tok, self.vocab_size = tok, tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def make_tokenizer(kind: str, text: str, *, vocab_size: int = 2048) -> Tokenizer:
    """``byte`` or ``bpe`` (trained on ``text``)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(text, vocab_size)
    raise ConfigError(f"--tokenizer must be byte or bpe, got {kind!r}")


@dataclass(frozen=True)
class TokenStream:
    """A token sequence and a sampler of (input, target) windows that is a pure function of (seed, step)."""

    tokens: Tensor
    """1-D int64 token ids."""

    def batch(self, *, step: int, micro: int, micro_batch: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
        """``micro_batch`` random windows of ``seq_len`` + 1 tokens: inputs and next-token targets."""
        n = self.tokens.numel() - seq_len - 1
        require(n > 0, f"the corpus has {self.tokens.numel()} tokens, fewer than --seq-len + 1 = {seq_len + 1}")
        g = torch.Generator().manual_seed(hash((seed, step, micro)) & 0x7FFF_FFFF_FFFF)
        starts = torch.randint(0, n, (micro_batch,), generator=g)
        windows = torch.stack([self.tokens[i : i + seq_len + 1] for i in starts.tolist()])  # (b, s + 1)
        return windows[:, :-1], windows[:, 1:]
