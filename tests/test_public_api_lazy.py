"""``import overlapkit`` loads nothing heavy; every public name still resolves to its object."""

from __future__ import annotations

import subprocess
import sys
import types

import overlapkit as ok


def _fresh_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_import_overlapkit_imports_no_torch():
    assert _fresh_python("import sys, overlapkit; print('torch' in sys.modules)") == "False"


def test_cli_help_imports_no_command_module():
    code = (
        "import sys, contextlib, io, overlapkit.cli as c\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    c.main(['--help'])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'overlapkit.'))))"
    )
    assert _fresh_python(code) == "['overlapkit.cli']"


def test_every_public_name_resolves_to_a_function_or_class():
    for name in ok.__all__:
        value = getattr(ok, name)
        assert not isinstance(value, types.ModuleType), f"ok.{name} is a module"
        assert value is not None, name
    from overlapkit.ddp.wrap import ddp
    from overlapkit.fsdp.wrap import fsdp

    assert ok.ddp is ddp and ok.fsdp is fsdp


def test_ddp_and_fsdp_stay_functions_after_their_subpackages_load():
    # Importing overlapkit.ddp.* binds the sub-package to overlapkit.ddp unless prevented.
    code = (
        "import types, overlapkit as ok\n"
        "import overlapkit.ddp.comm_stats, overlapkit.ddp.compile_guard, overlapkit.fsdp.mesh\n"
        "from overlapkit.ddp import comm_stats\n"
        "print(*(isinstance(f, types.FunctionType) for f in (ok.ddp, ok.fsdp, ok.comm_stats,"
        " comm_stats)))"
    )
    assert _fresh_python(code) == "True True True True"
    assert isinstance(ok.ddp, types.FunctionType)


def test_no_lazy_public_name_is_also_a_sub_module_name():
    # A lazy package's public name that is also one of its sub-modules would be replaced by
    # that module once it is imported (the import system binds it on the package).
    code = (
        "import importlib, importlib.util\n"
        "packages = ('overlapkit.profiling', 'overlapkit.fsdp', 'overlapkit.ddp')\n"
        "print([f'{p}.{n}' for p in packages for n in importlib.import_module(p).__all__"
        " if importlib.util.find_spec(f'{p}.{n}') is not None])"
    )
    assert _fresh_python(code) == "['overlapkit.ddp.comm_stats']"  # imported eagerly, first


def test_profile_stays_the_function_once_every_profiling_module_is_imported():
    code = (
        "import pkgutil, importlib, types, overlapkit as ok, overlapkit.profiling as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module(f'overlapkit.profiling.{m.name}')\n"
        "print(isinstance(p.profile, types.FunctionType), ok.profile is p.profile)"
    )
    assert _fresh_python(code) == "True True"


def test_unknown_name_raises_attribute_error():
    try:
        ok.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("ok.no_such_name did not raise AttributeError")
