"""The multi-process test harness: run a test body on N gloo ranks (``overlapkit.workers``).

Usage in a test module::

    def _body(rank, world_size):          # module level, so spawned children can import it
        ...
        return something_picklable

    def test_x():
        results = run_on_ranks(_body, 2)  # raises RankFailure with each child's traceback
"""

from overlapkit.workers.local_ranks import RankFailure, run_on_ranks

__all__ = ["RankFailure", "run_on_ranks"]
