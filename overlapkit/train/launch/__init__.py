"""Launching ``overlapkit-train``: the Hydra entry point, workers started by torch elastic on
one or many nodes, and Slurm allocations."""
