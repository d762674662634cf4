"""overlapkit's version, in a module of its own.

At the package root because it belongs to no concept: ``overlapkit/__init__`` exports it as
``ok.__version__`` and modules inside the package (the wrap-time consistency check compares it
across ranks) read it from here, never from ``overlapkit`` itself, which is the top layer.
"""

__version__ = "0.1.0"
