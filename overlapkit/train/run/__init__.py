"""The run: the training loop, one step, data, checkpoints and resume, progress and summary,
the learning-rate schedule."""
