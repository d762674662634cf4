"""Every overlapkit module imports on its own, whatever was imported before it.

``import overlapkit`` is lazy, so the order in which modules load is the user's (or a test
file's) and no longer the package's; an import cycle that an eager ``__init__`` used to hide
then breaks whichever module happens to come first.
"""

from __future__ import annotations

import json
import subprocess
import sys

_IMPORT_EACH_FRESH = """
import importlib, json, pkgutil, sys
import torch  # kept loaded: only overlapkit's own modules are imported afresh
import overlapkit

found = pkgutil.walk_packages(overlapkit.__path__, "overlapkit.", onerror=lambda name: None)
shard, shards = map(int, sys.argv[1:3])
names = sorted(m.name for m in found)[shard::shards]
failures = {}
for name in names:
    for loaded in [m for m in sys.modules if m == "overlapkit" or m.startswith("overlapkit.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] != "overlapkit":
            continue  # an optional framework (lightning, accelerate, ...) not installed here
        failures[name] = repr(err)
    except Exception as err:
        failures[name] = repr(err)
print(json.dumps({"imported": len(names), "failures": failures}))
"""


SHARDS = 2
"""Interpreters importing a share of the modules each, side by side (the machine's 2 cores)."""


def test_every_module_imports_first_in_a_fresh_package():
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _IMPORT_EACH_FRESH, str(shard), str(SHARDS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for shard in range(SHARDS)
    ]
    imported, failures = 0, {}
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err
            result = json.loads(out.strip().splitlines()[-1])
            imported += result["imported"]
            failures |= result["failures"]
    finally:
        for worker in workers:
            worker.kill()
    assert imported > 50
    assert failures == {}
