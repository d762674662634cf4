"""The optimizer side of overlap: the user's optimizer applied to part of the model at a time.

``subset`` steps an optimizer on a subset of its parameters with the same bits as one
``optimizer.step()`` (and ``mark_stepped`` tells its LR scheduler the step happened);
``per_bucket`` schedules the updates of ``GradBucketer(optimizer=)`` bucket by bucket as their
all-reduces complete (``pending_step`` holds one step's pending buckets, ``issue_paths`` runs
them on the training thread or a CUDA side stream), ``per_block`` those of
``overlapkit.fsdp.step_by_block`` block by block in forward order. ``clip`` (exact global-norm
clipping part by part), ``grad_scaling`` (GradScaler's unscale part by part) and ``gate``
(holding a step's updates until every part has landed) fold clipping and loss scaling into
them; ``forward_reads`` says where the next forward must wait, ``overlap_checks`` what
per-bucket updates refuse. The schedulers see the wrappers through the Protocols of
``protocols``, so this package sits below ``ddp`` and ``fsdp`` and imports neither.
"""
