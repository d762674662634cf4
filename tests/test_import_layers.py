"""Imports run one way: every unit of overlapkit has a layer, and no import runs upward or
closes a circle (``tests/import_graph.py`` reads the graph from the source with ``ast``).

A unit is a sub-package of ``overlapkit`` or a module at its root. Direction is checked by unit:
an import may go to its own unit, to another unit of its layer, or to a lower layer. Circles are
checked twice: among modules (an import circle, even one closed inside a function) and among the
units of a layer (two packages leaning on each other sideways, through different modules).
Imports under ``if TYPE_CHECKING:`` count too: they never run, but a circle closed by a type
hint is a circle a reader follows (a Protocol or a module below both breaks it). The second half
of the file proves that the checks fail, with the offending ``file:line``, on a package made to
break them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import overlapkit
from tests.import_graph import (
    Edge,
    import_edges,
    module_circles,
    module_files,
    stale_layers,
    unit_circles,
    unit_of,
    unlayered,
    upward_imports,
    within,
)

LAYERS: dict[str, int] = {
    # 0: leaves. What every wrapper shares about its group, the optimizer side of overlap,
    # starting workers, the topology model, the tuner's rules; and the root leaf modules (each
    # says in its docstring why it is not in a package). They import only each other.
    "overlapkit.group": 0,
    "overlapkit.optim": 0,
    "overlapkit.workers": 0,
    "overlapkit.topology": 0,
    "overlapkit.tuning": 0,
    "overlapkit.conf": 0,
    "overlapkit._version": 0,
    "overlapkit.lazy": 0,
    "overlapkit.validation": 0,
    # The one description of a training layout (complete and partial) and what overlapkit-train
    # runs: the planner, the search, train, the doctor and the benchmarks read it.
    "overlapkit.layout": 0,
    # 1: the wrappers, the profiler and the collective cost model (which sees a placement only
    # through a Protocol: it imports neither placement nor the search).
    "overlapkit.ddp": 1,
    "overlapkit.fsdp": 1,
    "overlapkit.inlayer": 1,
    "overlapkit.profiling": 1,
    # Live monitoring: per-step waits and the straggler rule.
    "overlapkit.live": 1,
    "overlapkit.cost": 1,
    # 2: placement of the sizes a user chose, priced by the cost model; never the search.
    "overlapkit.planner": 2,
    # 3: the auto-planner, which chooses the sizes and places them.
    "overlapkit.autoplan": 3,
    # 4: what is built from them: the checklist, the training entry point, framework adapters.
    "overlapkit.doctor": 4,
    "overlapkit.train": 4,
    "overlapkit.integrations": 4,
    # 5: the ``overlapkit`` command and the public surface ``import overlapkit as ok``.
    "overlapkit.cli": 5,
    "overlapkit": 5,
}

INNER_LAYERS: dict[str, dict[str, int]] = {
    # The training entry point by concept: the model zoo, the parallel layouts built on it, the
    # planner's adapters for a run, the run itself, and launching it.
    "overlapkit.train": {
        "overlapkit.train.models": 0,
        "overlapkit.train.parallel": 1,
        "overlapkit.train.planning": 2,
        "overlapkit.train.run": 3,
        "overlapkit.train.launch": 4,
        "overlapkit.train": 5,
    },
    # The search and its models, then the hand-offs of a winner, then the command.
    "overlapkit.autoplan": {
        "overlapkit.autoplan.*": 0,
        "overlapkit.autoplan.handoff": 1,
        "overlapkit.autoplan.auto_cli": 2,
        "overlapkit.autoplan.auto_report": 2,
        "overlapkit.autoplan.cli": 2,
        "overlapkit.autoplan": 2,
    },
}
"""Layers inside the packages that have sub-packages (``"<package>.*"``: its other root modules)."""

ROOT = Path(overlapkit.__file__).parent
PACKAGE = "overlapkit"


@pytest.fixture(scope="module")
def edges():
    return import_edges(ROOT, PACKAGE)


def test_every_unit_has_a_layer_and_every_layer_names_a_unit():
    modules = module_files(ROOT, PACKAGE)
    assert unlayered(modules, LAYERS, PACKAGE) == [], "give each new unit a layer in LAYERS"
    assert stale_layers(modules, LAYERS, PACKAGE) == [], "drop units that no longer exist"


def test_no_import_runs_upward(edges):
    assert len(edges) > 100
    found = upward_imports(edges, LAYERS, PACKAGE)
    assert not found, "\n" + "\n".join(found)


def test_every_package_with_sub_packages_has_inner_layers():
    modules = module_files(ROOT, PACKAGE)
    nested = {m.rsplit(".", 1)[0] for m, path in modules.items() if m.count(".") >= 3}
    nested |= {m for m, path in modules.items() if path.name == "__init__.py" and m.count(".") == 2}
    parents = {".".join(m.split(".")[:2]) for m in nested}
    assert parents == set(INNER_LAYERS), "give each package with sub-packages INNER_LAYERS"


@pytest.mark.parametrize("package", sorted(INNER_LAYERS))
def test_no_import_runs_upward_inside_a_package(edges, package):
    layers = INNER_LAYERS[package]
    inside = [m for m in module_files(ROOT, PACKAGE) if m == package or m.startswith(package + ".")]
    assert unlayered(inside, layers, package) == [], f"give each unit of {package} a layer"
    assert stale_layers(inside, layers, package) == [], f"drop {package}'s gone units"
    found = upward_imports(within(edges, package), layers, package)
    assert not found, "\n" + "\n".join(found)


def test_no_import_circle_among_modules(edges):
    found = module_circles(edges)
    assert not found, "\n" + "\n".join(found)


def test_no_circle_among_packages(edges):
    found = unit_circles(edges, PACKAGE)
    assert not found, "\n" + "\n".join(found)


# -- the checks themselves, on a package built to break them --------------------------------

BROKEN = {
    "__init__.py": "",
    "low/__init__.py": "",
    "low/a.py": """\
        import os

        from pkg.high import b
        """,
    "low/c.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from pkg.high.b import f
        """,
    "low/x.py": "from . import y\n",
    "low/y.py": """\
        def g():
            import pkg.low.x
        """,
    "low/p.py": "from pkg.side import q\n",
    "low/s.py": "",
    "side/__init__.py": "",
    "side/q.py": "",
    "side/r.py": "from ..low.s import *\n",
    "high/__init__.py": "",
    "high/b.py": """\
        def f():
            from ..low import c
        """,
}
BROKEN_LAYERS = {"pkg": 1, "pkg.low": 0, "pkg.side": 0, "pkg.high": 1}


@pytest.fixture
def broken(tmp_path):
    root = tmp_path / "pkg"
    for name, text in BROKEN.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root, import_edges(root, "pkg")


def test_an_upward_import_is_reported_with_its_file_and_line(broken):
    _, edges = broken
    found = sorted(upward_imports(edges, BROKEN_LAYERS, "pkg"))
    assert len(found) == 2
    assert found[0].startswith("pkg/low/a.py:3: pkg.low.a (layer 0, pkg.low) imports pkg.high.b")
    assert found[1].startswith(
        "pkg/low/c.py:4: pkg.low.c (layer 0, pkg.low) imports pkg.high.b (layer 1, pkg.high) "
        "(under TYPE_CHECKING)"
    )
    assert all("runs upward" in message for message in found)


def test_imports_under_type_checking_count_marked_and_function_imports_count(broken):
    _, edges = broken
    marked = {(e.source, e.target): e.type_checking for e in edges}
    assert marked[("pkg.low.c", "pkg.high.b")] is True
    assert marked[("pkg.high.b", "pkg.low.c")] is False  # ``from ..low import c`` inside f()


def test_a_circle_closed_inside_a_function_is_reported_with_both_lines(broken):
    _, edges = broken
    [found] = [m for m in module_circles(edges) if "pkg.low.x <-> pkg.low.y" in m]
    assert "pkg/low/x.py:1: pkg.low.x imports pkg.low.y" in found
    assert "pkg/low/y.py:2: pkg.low.y imports pkg.low.x" in found


def test_a_circle_closed_by_a_type_checking_import_is_reported(broken):
    # low/c.py names high.b for a type hint; high/b.py imports low.c inside a function.
    _, edges = broken
    found = module_circles(edges)
    assert len(found) == 2
    [circle] = [m for m in found if "pkg.high.b <-> pkg.low.c" in m]
    assert "pkg/high/b.py:2: pkg.high.b imports pkg.low.c;" in circle
    assert "pkg/low/c.py:4: pkg.low.c imports pkg.high.b (under TYPE_CHECKING)" in circle
    # Without the type-hint edge, no circle is left: the check counts it.
    plain = [e for e in edges if not e.type_checking]
    assert not [m for m in module_circles(plain) if "pkg.low.c" in m]


def test_packages_leaning_on_each_other_sideways_are_a_circle(broken):
    _, edges = broken
    found = unit_circles(edges, "pkg")
    circle = [m for m in found if "pkg.low <-> pkg.side" in m]
    assert len(circle) == 1
    assert "pkg/low/p.py:1: pkg.low.p imports pkg.side.q" in circle[0]
    assert "pkg/side/r.py:1: pkg.side.r imports pkg.low.s" in circle[0]


def test_a_unit_without_a_layer_and_a_layer_without_a_unit_are_reported(broken):
    root, _ = broken
    modules = module_files(root, "pkg")
    assert unlayered(modules, {"pkg": 1, "pkg.low": 0, "pkg.gone": 0}, "pkg") == [
        "pkg.high",
        "pkg.side",
    ]
    assert stale_layers(modules, {"pkg": 1, "pkg.low": 0, "pkg.gone": 0}, "pkg") == ["pkg.gone"]


def test_inside_a_package_an_upward_import_among_its_sub_packages_is_reported():
    edges = [
        Edge("pkg.high.run.loop", "pkg.high.models.gpt", "pkg/high/run/loop.py", 1),
        Edge("pkg.high.models.gpt", "pkg.high.run.step", "pkg/high/models/gpt.py", 3),
        Edge("pkg.high.models.gpt", "pkg.low.a", "pkg/high/models/gpt.py", 4),
    ]
    inner = within(edges, "pkg.high")
    assert len(inner) == 2  # the edge leaving pkg.high is the top-level check's
    layers = {"pkg.high.models": 0, "pkg.high.run": 1, "pkg.high": 2}
    [found] = upward_imports(inner, layers, "pkg.high")
    assert found.startswith("pkg/high/models/gpt.py:3: pkg.high.models.gpt (layer 0, ")
    assert unit_of("pkg.high.run.loop", "pkg.high") == "pkg.high.run"
    assert unit_of("pkg.high", "pkg.high") == "pkg.high"
