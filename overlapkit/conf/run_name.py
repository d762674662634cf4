"""Run names made safe as directory names: ``runs/${path_safe:${name}}`` in ``config.yaml``.

A run's ``name`` comes from the user (``name=...``), a recipe or the scheduler
(``recipes/slurm/train.sbatch`` passes ``SLURM_JOB_NAME``), and names one directory under
``runs/``. Taken verbatim, ``/`` in a name made nested directories (job ``team/exp1`` wrote to
``runs/team/exp1``, inside the run directory of a job named ``team``), and ``..`` or a leading
``/`` left ``runs/`` altogether. So the directory is the name with the characters a path gives
meaning to percent-encoded, as in a URL: ``/`` is ``%2F``, ``\\`` ``%5C``, control characters
``%0A`` and so on, ``%`` itself ``%25``, and a leading ``.`` ``%2E`` (so ``.`` and ``..`` are
plain names, and no run is hidden). Everything else stays as it is (``two=(a,b)`` is
``runs/two=(a,b)``). The encoding can be undone, so two names never share a directory.

The resolver is registered when the config package is imported, which Hydra does before it
reads the tree: wherever ``overlapkit.conf`` is composed, ``path_safe`` is defined.
"""

from __future__ import annotations

from omegaconf import OmegaConf

RESOLVER = "path_safe"
MAX_NAME_BYTES = 255
"""The longest file name Linux file systems hold (ext4, xfs, btrfs: ``NAME_MAX``)."""


def _escaped(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode())


def path_safe_name(name: object) -> str:
    """``name`` as one directory name: path characters percent-encoded (see the module).

    Raises:
        ValueError: an empty name, or one longer than 255 bytes once encoded; the message
            names ``name`` as the user spells it.

    Example:
        >>> path_safe_name("team/exp1")
        'team%2Fexp1'
    """
    text = str(name)
    if not text:
        raise ValueError("name must not be empty: it names the run directory runs/<name>")
    safe = "".join(_escaped(c) if c in "/\\%" or ord(c) < 32 or ord(c) == 127 else c for c in text)
    if safe.startswith("."):
        safe = _escaped(".") + safe[1:]
    if len(safe.encode()) > MAX_NAME_BYTES:
        raise ValueError(
            f"name={text[:40]!r}... is {len(safe.encode())} bytes as a directory name "
            f"({safe[:40]!r}...); a file system holds at most {MAX_NAME_BYTES}: choose a "
            "shorter name"
        )
    return safe


def register_resolver() -> None:
    """Make ``${path_safe:...}`` available to OmegaConf (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, path_safe_name)
