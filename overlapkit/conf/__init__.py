"""The Hydra config tree of ``overlapkit-train`` (a package so that Hydra finds it installed)."""
