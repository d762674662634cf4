"""overlapkit's benchmarks: side-by-side ratios measured in one run (not part of the package).

Each benchmark is a module run from the repository root, e.g. ``python -m bench.ddp_overlap``
(``make bench`` runs them all). What they share (emulated links, CPU priority, the JSON report,
two emulated nodes, device set-up, workloads) lives in ``bench.harness``; the scripts for a lent
GPU in ``bench.gpu``. ``pyproject.toml`` installs only ``overlapkit``: this package is imported
from the checkout (``python -m`` puts the working directory on ``sys.path``; pytest puts the
repository root there through ``tests/__init__.py``).
"""
