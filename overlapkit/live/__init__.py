"""Live monitoring: every step's exposed communication and the rank that holds the job back.

``LiveMonitor`` (``ok.LiveMonitor``) times each rank's steps and its waits on collectives
(``waits``, ``steps``), gathers a fixed-size window to rank 0 every few steps, where the
straggler rule (``detect``) names a rank whose late arrivals cost the others, with the cause and
the cost, as the run goes, without a profiler.
"""

from overlapkit.live.detect import LiveStraggler, StragglerRule
from overlapkit.live.monitor import LiveConfig, LiveMonitor, LiveWindow

__all__ = ["LiveConfig", "LiveMonitor", "LiveStraggler", "LiveWindow", "StragglerRule"]
