"""The parallel layouts a run trains with: the mesh and its groups, the ``parallel`` group's
wrapper, tensor and expert parallelism, pipeline stages and schedules, context parallelism and
activation recomputation."""
