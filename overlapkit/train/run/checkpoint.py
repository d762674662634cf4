"""Checkpoints with ``torch.distributed.checkpoint``: written atomically, resumed from the latest.

A checkpoint of step ``s`` is the directory ``<root>/step_<s:08d>``. It is written as
``step_<s:08d>.tmp`` by every rank (``dcp.save``, which returns only after rank 0 has written the
metadata, and rank 0 writes it only after every rank's data is written) and then renamed by rank
0. A rename is atomic, so a directory without ``.tmp`` is always complete: a job killed while
saving leaves only a ``.tmp`` directory, which is never loaded and is removed by the next run.

The saved state: the model and optimizer (``get_state_dict``, so DDP, the bucketer's plain
module and FSDP2's sharded parameters all save the same fully qualified names and reshard on
load), the LR scheduler, the step and data position, each ``GradBucketer``'s bucket layout
(``bucketers.<i>``: its all-reduces sum in an order that follows it), and each rank's RNG state
(under its own key, ``rng_rank<R>``; a resumed job with other ranks keeps its fresh RNG for
those): the CPU generator, and the CUDA generator of the model's device when the model is on a
GPU. A GPU checkpoint resumes on a GPU run and a CPU one on a CPU run; across the two, loading
refuses.

Pipeline stages (``parallel.plan.pp > 1``) hold different parameters on different ranks, so their
optimizer state is saved per parameter name (``flatten_optimizer_state_dict``, as torchtitan
does) and their bucket layouts under ``bucketers.stage<s>``: DCP keeps one value per key, and a
parameter group's list of names would be one rank's. Model tensors keep the unsplit model's
names in both forms; a checkpoint resumes into a run of the same optimizer form only.

A checkpoint directory is untrusted input (it may come from someone else's run), and DCP
unpickles it: its ``.metadata`` with plain ``pickle`` and every non-tensor value with
``torch.load(weights_only=False)``, either of which runs whatever code the file names. Loading
here therefore reads the metadata with an unpickler that accepts only DCP's own metadata types
and loads the non-tensor values with ``weights_only=True``. A checkpoint that some rank refuses,
or cannot read, is refused on every rank alike (``CheckpointRefused``: the ranks agree before
and after DCP's own load), so that they can move on to another one together
(``overlapkit.train.run.resume``).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from overlapkit.train.run.data import BatchStream

if TYPE_CHECKING:
    from overlapkit.ddp import GradBucketer

logger = logging.getLogger(__name__)

_COMMITTED = re.compile(r"^step_(\d{8})$")
# A parameter group's list of parameter names: saved unless the optimizer state is flattened.
_GROUP_PARAMS = re.compile(r"^optim\.param_groups\.\d+\.params$")
_OPTIMIZER_FORMS = {
    True: "per parameter name (a pipeline-parallel run's)",
    False: "per parameter group (a run without pipeline parallelism)",
}
_PENDING_SUFFIX = ".tmp"


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once committed."""
    return Path(root) / f"step_{step:08d}"


def committed_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _COMMITTED.match(path.name)
        if match and path.is_dir() and (path / ".metadata").is_file():
            found.append((int(match[1]), path))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = committed_checkpoints(root)
    return found[-1] if found else None


def remove_pending(root: str | Path) -> list[Path]:
    """Delete the ``.tmp`` directories that interrupted saves (or deletions) left under ``root``."""
    root = Path(root)
    removed = (
        [p for p in root.glob(f"step_*{_PENDING_SUFFIX}") if p.is_dir()] if root.is_dir() else []
    )
    for path in removed:
        shutil.rmtree(path)
        logger.warning("removed the incomplete checkpoint %s (a save was interrupted)", path)
    return removed


def _discard(path: Path) -> None:
    # Renamed out of the committed names first: a kill in the middle of rmtree must not leave
    # a committed-looking directory with some of its files gone.
    doomed = path.with_name(f"{path.name}.old{_PENDING_SUFFIX}")
    shutil.rmtree(doomed, ignore_errors=True)  # left by an earlier kill
    os.replace(path, doomed)
    shutil.rmtree(doomed)


# Every global a DCP ``.metadata`` pickle refers to (torch 2.6 - 2.13); anything else is refused.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
} | {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which DCP metadata never holds; "
            "refusing to unpickle it (it could run code)"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` that unpickles ``.metadata`` with DCP's metadata types only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise ValueError(f"{path}: not a readable DCP checkpoint metadata file: {err}") from err
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _weights_only_refusal(error: pickle.UnpicklingError) -> str:
    """What ``weights_only=True`` refused, without torch's advice on how to load it anyway."""
    for line in str(error).splitlines():
        _, found, rest = line.partition("WeightsUnpickler error: ")
        if found:
            return rest.split(". ")[0]
    return _first_line(error)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"checkpoint value {fqn!r} is not plain data; weights_only=True refused it "
                f"({_weights_only_refusal(err)}), so nothing in it ran"
            ) from err
        # As DefaultLoadPlanner.load_bytes, which differs only in weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class CheckpointRefused(ValueError):
    """A committed checkpoint that some rank cannot load, raised on every rank alike.

    Unsafe (a pickled callable), unreadable (truncated, corrupted, missing files) or of another
    kind of run (RNG state, bucket layout).

    Attributes:
        path (Path): the checkpoint directory.
        reasons (dict[int, str]): global rank -> why that rank cannot use it, one line each.
    """

    def __init__(self, path: Path, reasons: dict[int, str]):
        self.path = path
        self.reasons = dict(sorted(reasons.items()))
        distinct = set(self.reasons.values())
        message = (
            distinct.pop()
            if len(distinct) == 1
            else "; ".join(f"rank {r}: {reason}" for r, reason in self.reasons.items())
        )
        super().__init__(message)

    def line_for(self, rank: int) -> str:
        """One line for ``rank``'s log: its own reason, or which ranks refused and why."""
        if rank in self.reasons:
            return self.reasons[rank]
        first = next(iter(self.reasons.values()))
        return f"{self.path}: refused on rank(s) {list(self.reasons)}: {first}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _reason(path: Path, error: BaseException) -> str:
    """Why ``path`` cannot be used, in one line that names it.

    Our refusals (``ValueError``) are kept whole; of torch's errors (a corrupted file) the
    first sentence, which says what failed; the rest is advice about other causes.
    """
    text = _first_line(error)
    if not str(error).strip():  # EOFError(), from a file that ends early
        text = f"{text} while reading it"
    elif not isinstance(error, ValueError):
        text = f"{type(error).__name__}: {text.split('. ')[0]}"
    text = text.rstrip(".")
    return text if str(path) in text else f"{path}: {text}"


def _agree(path: Path, reason: str | None) -> None:
    """Every rank's verdict on ``path``; raises ``CheckpointRefused`` everywhere if any refused.

    A collective of all ranks (one ``all_gather_object``) when the default group is initialised.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, reason)
    else:
        verdicts = [reason]
    refused = {rank: r for rank, r in enumerate(verdicts) if r is not None}
    if refused:
        raise CheckpointRefused(path, refused)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def _cuda_device(model: torch.nn.Module) -> torch.device | None:
    """The CUDA device the model lives on, or None for a CPU model."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_cuda:
            return tensor.device
    return None


def _rng_state(device: torch.device | None) -> dict[str, torch.Tensor]:
    """This rank's generators: the CPU one, and the CUDA one of ``device`` for a GPU model.

    Whether CUDA's is included depends on the model's device only, never on whether CUDA
    happens to be initialised in this process (on a GPU host, DCP's writer or a device query
    initialises it), so a checkpoint and the state expected at load agree.
    """
    state = {"cpu": torch.get_rng_state()}
    if device is not None:
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _check_rng_kinds(path: Path, rank: int, saved: set[str], expected: set[str]) -> None:
    """A clear error when a checkpoint's RNG state is of another kind of run than this one."""
    if saved == expected:
        return

    def kind(generators: set[str]) -> str:
        return "a GPU run (CPU and CUDA RNG)" if "cuda" in generators else "a CPU run (CPU RNG)"

    raise ValueError(
        f"{path}: rank {rank}'s RNG state was saved by {kind(saved)}, but this run is "
        f"{kind(expected)}: its model is on "
        f"{'a CUDA device' if 'cuda' in expected else 'the CPU'}. Resume a checkpoint on the "
        f"kind of device it was written on, or start a new run (another checkpoint directory)."
    )


@dataclass(slots=True)
class TrainingState:
    """Everything a checkpoint holds, bound to the live objects it is saved from and loaded into."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: BatchStream
    rank: int
    bucketers: Sequence[GradBucketer] = ()
    """The run's bucketers (``Parallelized.bucketers``), whose layouts are saved and restored."""
    bucketer_keys: Sequence[str] = ()
    """The bucketers' keys under ``bucketers.``; empty: their index."""
    flatten_optimizer: bool = False
    """Save the optimizer's state and hyperparameters per parameter name
    (``flatten_optimizer_state_dict``, as torchtitan does): needed when ranks hold different
    parameters (pipeline stages), since DCP keeps one value per key and ``param_groups`` would
    otherwise be one rank's list of names."""

    @property
    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=self.flatten_optimizer)

    def _keyed_bucketers(self) -> dict[str, GradBucketer]:
        keys = self.bucketer_keys or [str(i) for i in range(len(self.bucketers))]
        return dict(zip(keys, self.bucketers, strict=True))

    def state_dict(self, step: int) -> dict[str, Any]:
        """The state at ``step`` in DCP's form (nested dicts of tensors and plain values)."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._options)
        state = {
            "model": model_state,
            "optim": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "progress": {"step": step, "data": self.stream.state_dict()},
            _rng_key(self.rank): _rng_state(_cuda_device(self.model)),
        }
        if self.bucketers:
            state["bucketers"] = {k: b.state_dict() for k, b in self._keyed_bucketers().items()}
        return state

    def save(self, root: str | Path, step: int, *, keep: int) -> Path:
        """Save the state at ``step`` under ``root`` atomically; a collective of all ranks.

        Args:
            root (str | Path): the checkpoint directory (shared by all ranks of all nodes).
            step (int): the optimizer steps taken so far.
            keep (int): how many of the newest checkpoints to keep; 0 keeps all.

        Returns:
            Path: the committed checkpoint directory.
        """
        root = Path(root)
        final = step_dir(root, step)
        pending = final.with_name(final.name + _PENDING_SUFFIX)
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(pending, ignore_errors=True)
        dist.barrier()
        dcp.save(self.state_dict(step), checkpoint_id=pending)
        if self.rank == 0:
            if final.exists():  # the same step saved again, e.g. by a rerun after a crash
                _discard(final)
            os.replace(pending, final)
            _fsync_dir(root)
            if keep > 0:
                for _, old in committed_checkpoints(root)[:-keep]:
                    _discard(old)
            logger.info("checkpoint saved: %s", final)
        # Nobody goes on (or reads it) before the rename.
        dist.barrier()
        return final

    def load(self, path: str | Path) -> int:
        """Load a committed checkpoint into the live objects; a collective of all ranks.

        Returns:
            int: the step the checkpoint was saved at.

        Raises:
            CheckpointRefused: on every rank, when some rank found the checkpoint unsafe or
                unreadable, or its RNG state of a CPU run and this run's model on a GPU (or the
                other way round), or its optimizer state of a pipeline-parallel run and this run
                not (or the other way round), or its bucket layout of another model. The live
                objects may then hold part of it: load another checkpoint, or stop.
        """
        path = Path(path)
        state, reason = None, None
        try:
            state = self._expected_state(path)
        except (ValueError, OSError) as error:
            reason = _reason(path, error)
        _agree(path, reason)
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
        except CheckpointException as err:  # a BaseException, raised on every rank alike
            raise CheckpointRefused(
                path, {rank: _reason(path, exc) for rank, (exc, _) in err.failures.items()}
            ) from err
        try:
            self._apply(state)
        except ValueError as error:
            reason = _reason(path, error)
        _agree(path, reason)
        return int(state["progress"]["step"])

    def _expected_state(self, path: Path) -> dict[str, Any]:
        """The state to load ``path`` into: this run's, less what the checkpoint lacks."""
        state = self.state_dict(0)
        saved_keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata.keys()
        rng_key = _rng_key(self.rank)
        saved_rng = {key.split(".", 1)[1] for key in saved_keys if key.startswith(f"{rng_key}.")}
        if saved_rng:
            _check_rng_kinds(path, self.rank, saved_rng, set(state[rng_key]))
        else:
            logger.warning(
                "checkpoint %s has no RNG state for rank %d (saved by fewer ranks); this rank "
                "keeps its fresh RNG state",
                path,
                self.rank,
            )
            del state[rng_key]
        saved_flat = not any(_GROUP_PARAMS.match(key) for key in saved_keys)
        if saved_flat != self.flatten_optimizer:
            raise ValueError(
                f"{path}: its optimizer state was saved "
                f"{_OPTIMIZER_FORMS[saved_flat]}, but this run's is "
                f"{_OPTIMIZER_FORMS[self.flatten_optimizer]}: a checkpoint of a pipeline-parallel "
                "run (parallel.plan.pp > 1) resumes into a pipeline-parallel run only, any other "
                "into a run without pipeline parallelism; start a new run (another name=...)"
            )
        if self.bucketers and not any(key.startswith("bucketers.") for key in saved_keys):
            logger.warning(
                "checkpoint %s has no bucket layout (saved without a GradBucketer); the "
                "bucketers rebuild theirs after the first step",
                path,
            )
            del state["bucketers"]
        return state

    def _apply(self, state: dict[str, Any]) -> None:
        """Put a loaded state into the live objects."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._options,
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.stream.load_state_dict(state["progress"]["data"])
        if "bucketers" in state:
            for key, bucketer in self._keyed_bucketers().items():
                bucketer.load_state_dict(state["bucketers"][key])
        rng_key = _rng_key(self.rank)
        if rng_key in state:
            torch.set_rng_state(state[rng_key]["cpu"])
            if "cuda" in state[rng_key]:
                torch.cuda.set_rng_state(state[rng_key]["cuda"], _cuda_device(self.model))
