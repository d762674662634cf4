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
names = sorted(m.name for m in found)
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


def test_every_module_imports_first_in_a_fresh_package():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_FRESH],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] > 50
    assert result["failures"] == {}
