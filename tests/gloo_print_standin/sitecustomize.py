"""Stands in for torch 2.9's gloo, which prints from C++ to file descriptor 1 when a group connects.

Put this folder on ``PYTHONPATH``: every Python process started with it (the command, the
forkserver, the ranks) then writes ``GLOO_PRINT`` to descriptor 1 with ``os.write`` (below
Python's ``sys.stdout``, as gloo's ``std::cout`` is) after each ``init_process_group``.
"""

import os

import torch.distributed as dist

GLOO_PRINT = b"[Gloo] Rank 0 is connected to 1 peer ranks (stand-in print to fd 1)\n"
_init_process_group = dist.init_process_group


def init_process_group(*args, **kwargs):
    _init_process_group(*args, **kwargs)
    os.write(1, GLOO_PRINT)


dist.init_process_group = init_process_group
