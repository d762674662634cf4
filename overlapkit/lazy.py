"""Packages whose public names load on first use (PEP 562), so importing one module of a
package does not import all of its siblings.

For import speed only, never to hide a cycle: ``import overlapkit.ddp.hooks`` takes about 1.0 s
with ``ddp/__init__`` lazy and 1.7 s eager (it would load DTensor and the bucketer), and every
module still imports first with eager ``__init__``s (``tests/test_import_cycles.py``). At the
package root, a leaf importing nothing of overlapkit, because sub-packages of any layer use it
(``ddp``, ``fsdp``) and it belongs to none of their concepts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package (str): the package's ``__name__``.
        exports (Mapping[str, str]): public name -> the module that defines it.

    Example::

        >>> __getattr__, __dir__ = lazy_exports(__name__, {"ddp": "overlapkit.ddp.wrap"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *exports})

    return __getattr__, __dir__
