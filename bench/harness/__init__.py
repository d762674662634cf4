"""What every benchmark shares: an emulated scale-out link, CPU priority on a shared machine,
the ``--json`` report, two emulated nodes, device set-up and the workloads they time."""
