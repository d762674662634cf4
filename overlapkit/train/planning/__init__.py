"""The auto-planner's adapters for a run: ``parallel=auto``, the run's predicted step, and the
host calibration that lets the planner price CPU ranks."""
