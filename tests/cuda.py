"""Marking tests that need a CUDA GPU: ``@requires_cuda`` (``make test-gpu`` runs them).

They are marked ``cuda`` (``pytest -m cuda`` selects them) and skipped, with the reason, where
CUDA is not available; ``make test-gpu`` refuses to start without CUDA, so on a GPU host none is
skipped.
"""

import pytest
import torch

CUDA_SKIP_REASON = "needs a CUDA GPU; `make test-gpu` runs it on a GPU host"


def requires_cuda(test):
    """Mark ``test`` as CUDA-only: the ``cuda`` marker, skipped without CUDA."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)
    return pytest.mark.cuda(skip(test))
