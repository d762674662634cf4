"""The hand-off of a chosen layout to the framework that runs it: overlapkit-train overrides
(``run_config``) and torchtitan's own arguments (``torchtitan``)."""
