"""What every overlapkit wrapper shares about the process group it communicates over.

``process_group`` resolves and validates the group (and holds the collective helpers and
timeouts the wrappers share), ``consistency`` is the wrap-time check that every rank set up the
same model and options (``ConfigMismatch``), and ``failures`` explains a failed or timed-out
collective (``CollectiveFailure``: which collective, bucket or block, step, and missing ranks);
``stall_watchdog`` names a rank stuck before a collective within a stall limit, from the ranks'
arrival records (``stall_diagnosis``).

A leaf: it imports no other overlapkit package, so ``ddp``, ``fsdp`` and ``planner`` build on it.
"""
