"""The Hydra config tree of ``overlapkit-train`` (a package so that Hydra finds it installed).

Importing it registers the tree's own resolver, ``path_safe`` (``overlapkit.conf.run_name``);
Hydra imports the package before it reads the tree.
"""

from overlapkit.conf.run_name import register_resolver

register_resolver()
