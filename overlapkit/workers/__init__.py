"""Starting local worker processes.

``local_ranks.run_on_ranks(fn, world_size)`` runs a function on N local gloo (or NCCL) ranks and
never hangs (tests, benchmarks, ``overlapkit doctor``, ``overlapkit calibrate``); a failure is a
``RankFailure`` carrying every failing rank's traceback. ``forkserver`` is how both it and
``overlapkit-train`` start workers: forked from a server that imported torch once.

A leaf: it imports no other overlapkit package (the server preloads
``overlapkit.train.launch.elastic`` by name, so that ``overlapkit-train``'s workers start warm too).
"""
