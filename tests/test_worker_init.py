"""``launcher.worker_init``: the one start-up hook of overlapkit-train's workers, and what ships.

The fault injectors of the tests (``tests/faults.py``, ``bench/harness/slow_rank.py``) reach the
workers only through this hook; the installed package holds no code that can kill a worker or
write a checkpoint that runs code when loaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from overlapkit.train.launch.elastic import LauncherConfig
from overlapkit.train.launch.worker_init import WorkerContext, resolve_worker_init, run_worker_init
from tests.train_steps import compose_config

REPO = Path(__file__).resolve().parent.parent
CALLS: list[WorkerContext] = []


def record(context: WorkerContext) -> None:
    """A worker_init function for the tests below."""
    CALLS.append(context)


def test_worker_init_functions_are_called_in_order_with_the_context(tmp_path):
    context = WorkerContext(rank=1, local_rank=1, world_size=2, attempt=0, run_dir=tmp_path)
    CALLS.clear()
    run_worker_init([f"{__name__}:record", f"{__name__}:record"], context)
    assert [context, context] == CALLS


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("tests.test_worker_init", "must be 'module:function'"),
        ("tests.test_worker_init:", "must be 'module:function'"),
        (":record", "must be 'module:function'"),
        ("tests.no_such_module:arm", "cannot import 'tests.no_such_module'"),
        ("tests.test_worker_init:no_such_function", "has no function 'no_such_function'"),
        ("tests.test_worker_init:CALLS", "has no function 'CALLS'"),
    ],
)
def test_a_bad_worker_init_entry_is_refused_naming_the_key_and_the_value(spec, why):
    with pytest.raises(ValueError, match=rf"launcher\.worker_init entry '{spec}'.*{why}"):
        resolve_worker_init(spec)


def test_the_launcher_group_declares_worker_init_empty_by_default():
    cfg = compose_config()
    assert list(cfg.launcher.worker_init) == []
    assert LauncherConfig(worker_init=["a.b:c"]).worker_init == ["a.b:c"]


def test_a_bad_worker_init_is_refused_before_any_worker_starts():
    from hydra.utils import instantiate

    from overlapkit.train.launch.cli import check_job

    cfg = compose_config("launcher.worker_init=[tests.no_such_module:arm]")
    with pytest.raises(ValueError, match="launcher.worker_init entry 'tests.no_such_module:arm'"):
        check_job(cfg, instantiate(cfg.launcher))


def test_a_plain_install_has_no_module_that_kills_a_worker_or_damages_a_checkpoint(tmp_path):
    # Build the wheel pip would install, from a copy (setuptools writes build/ beside the sources).
    source = tmp_path / "src"
    shutil.copytree(
        REPO / "overlapkit", source / "overlapkit", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    wheels = tmp_path / "wheel"
    subprocess.run([*pip_wheel, str(source), "-w", str(wheels)], check=True, timeout=120)
    [wheel] = wheels.glob("overlapkit-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        modules = {n: archive.read(n).decode() for n in archive.namelist() if n.endswith(".py")}
    assert "overlapkit/train/launch/worker_init.py" in modules
    assert len(modules) > 100
    for name, text in modules.items():
        for sign in ("SIGKILL", "__reduce__", "OVERLAPKIT_TEST_", "tests.faults"):
            assert sign not in text, f"{name} holds {sign!r}: test code in the package"
