"""Training data: synthetic tokens, a byte-level text corpus, and a synthetic regression task.

Every source builds micro-batch number ``index`` of a rank from a generator seeded by
``(seed, rank, index)``, so a batch depends on nothing but its position: resuming at position
``p`` gives exactly the batches an uninterrupted run would have drawn, with no loader state to
save beyond ``p``. Each source also owns its loss, because it decides what the targets are.

A source provides ``batch(index, rank=, batch_size=) -> (inputs, targets)``, ``loss(output,
targets)``, ``items_per_sample`` (tokens per sequence, or 1) and ``unit`` (``"tok"`` or
``"samples"``). ``BatchStream`` walks a source and is what the checkpoint saves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from overlapkit.validation import check_int

logger = logging.getLogger(__name__)

SHIPPED_CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.txt"


def batch_generator(seed: int, rank: int, index: int) -> torch.Generator:
    """A generator whose stream depends only on ``(seed, rank, index)``."""
    # Spread the three integers apart so that no two triples share a seed in practice.
    mixed = (seed * 1_000_003 + rank) * 1_000_000_007 + index
    return torch.Generator().manual_seed(mixed % (2**63 - 1))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats); ``logits`` (B, T, V), ``targets`` (B, T) long."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class DataSource(Protocol):
    unit: str
    items_per_sample: int

    def batch(
        self, index: int, *, rank: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


class SyntheticTokens:
    """Sequences from a fixed random process: each token has ``successors`` possible next tokens.

    The successor table is drawn once from ``seed``; a sequence starts at a uniform token and
    each next token is one of its successors, uniformly. A model that learns the table reaches
    ``ln(successors)`` nats per token (the first token of each sequence is not a target).

    Args:
        seq_len (int): tokens per input sequence (the targets are shifted by one).
        vocab_size (int): tokens 0 .. vocab_size - 1.
        successors (int): possible next tokens per token, 1 .. vocab_size. Defaults to 4.
        seed (int): seeds the table and the batches. Defaults to 0.
    """

    unit = "tok"

    def __init__(self, *, seq_len: int, vocab_size: int, successors: int = 4, seed: int = 0):
        self.seq_len = check_int("data.seq_len", seq_len, 1)
        self.vocab_size = check_int("data.vocab_size", vocab_size, 2)
        self.successors = check_int("data.successors", successors, 1)
        if successors > vocab_size:
            raise ValueError(
                f"data.successors ({successors}) must be <= data.vocab_size ({vocab_size})"
            )
        self.seed = seed
        table_rng = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, vocab_size, (vocab_size, successors), generator=table_rng)
        self.items_per_sample = seq_len

    def batch(self, index: int, *, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both (batch_size, seq_len) long."""
        rng = batch_generator(self.seed, rank, index)
        choices = torch.randint(0, self.successors, (batch_size, self.seq_len), generator=rng)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (batch_size,), generator=rng)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.table[tokens[:, t], choices[:, t]]
        return tokens[:, :-1], tokens[:, 1:]

    loss = staticmethod(token_loss)


class TextCorpus:
    """Byte-level language modelling: random windows of ``seq_len + 1`` bytes of a text file.

    Args:
        path (str | Path | None): a text file; None means the corpus shipped with overlapkit
            (``overlapkit/data/corpus.txt``, public domain). Relative paths are relative to the
            directory ``overlapkit-train`` was started in.
        seq_len (int): bytes per input sequence.
        seed (int): seeds the window offsets. Defaults to 0.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is shorter than ``seq_len + 1`` bytes.
    """

    unit = "tok"
    vocab_size = 256

    def __init__(self, *, path: str | Path | None = None, seq_len: int, seed: int = 0):
        self.path = Path(path) if path is not None else SHIPPED_CORPUS
        self.seq_len = check_int("data.seq_len", seq_len, 1)
        self.seed = seed
        if not self.path.is_file():
            raise FileNotFoundError(f"data.path: text corpus {str(self.path)!r} does not exist")
        raw = self.path.read_bytes()
        if len(raw) < seq_len + 1:
            raise ValueError(
                f"data.path: {str(self.path)!r} has {len(raw)} bytes, fewer than data.seq_len + 1 "
                f"({seq_len + 1})"
            )
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.items_per_sample = seq_len
        logger.info("text corpus %s: %d bytes", self.path, len(raw))

    def batch(self, index: int, *, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both (batch_size, seq_len) long byte values."""
        rng = batch_generator(self.seed, rank, index)
        starts = torch.randint(0, len(self.data) - self.seq_len, (batch_size,), generator=rng)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.data[offsets].long()
        return window[:, :-1], window[:, 1:]

    loss = staticmethod(token_loss)


class SyntheticRegression:
    """Inputs ``x ~ N(0, 1)`` of ``width`` features; targets ``tanh(x @ W)``, ``W`` fixed by seed.

    Args:
        width (int): features of inputs and targets.
        seed (int): seeds the teacher ``W`` and the batches. Defaults to 0.
    """

    unit = "samples"
    items_per_sample = 1

    def __init__(self, *, width: int, seed: int = 0):
        self.width = check_int("data.width", width, 1)
        self.seed = seed
        teacher_rng = torch.Generator().manual_seed(seed)
        # Scaled so that x @ W has unit variance and tanh is neither linear nor saturated.
        self.teacher = torch.randn(width, width, generator=teacher_rng) / width**0.5

    def batch(self, index: int, *, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both (batch_size, width) float32."""
        x = torch.randn(batch_size, self.width, generator=batch_generator(self.seed, rank, index))
        return x, torch.tanh(x @ self.teacher)

    @staticmethod
    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean squared error."""
        return F.mse_loss(output.float(), targets)


def check_compatible(source: DataSource, model_config: Any) -> None:
    """Check that ``source``'s batches fit the model described by ``model_config``.

    Raises:
        ValueError: sequences longer than the model's ``block_size``, token ids beyond its
            ``vocab_size``, or token data for a model of float features (and the reverse); the
            message names the config keys.
    """
    takes_tokens = hasattr(model_config, "vocab_size")
    gives_tokens = source.unit == "tok"
    if takes_tokens != gives_tokens:
        kind = "token sequences" if gives_tokens else "float features"
        wanted = (
            "token sequences (data=synthetic or data=text)"
            if takes_tokens
            else ("float features (data=regression)")
        )
        raise ValueError(
            f"data ({type(source).__name__}) yields {kind}, but the model "
            f"({type(model_config).__name__}) takes {wanted}"
        )
    if takes_tokens:
        if source.seq_len > model_config.block_size:
            raise ValueError(
                f"data.seq_len ({source.seq_len}) exceeds model.config.block_size "
                f"({model_config.block_size})"
            )
        if source.vocab_size > model_config.vocab_size:
            raise ValueError(
                f"the data has {source.vocab_size} token ids but model.config.vocab_size is "
                f"{model_config.vocab_size}"
            )
    elif source.width != model_config.width:
        raise ValueError(
            f"data.width ({source.width}) must equal model.config.width ({model_config.width})"
        )


class BatchStream:
    """A rank's walk through a source, one micro-batch at a time; ``position`` is what resumes.

    Args:
        source (DataSource): where batches come from.
        rank (int): this rank (each rank draws its own batches).
        batch_size (int): samples per micro-batch.
    """

    def __init__(self, source: DataSource, *, rank: int, batch_size: int):
        self.source = source
        self.rank = rank
        self.batch_size = batch_size
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch at ``position``; advances by one."""
        batch = self.source.batch(self.position, rank=self.rank, batch_size=self.batch_size)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        position = state["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"data position must be an int >= 0, got {position!r}")
        self.position = position
