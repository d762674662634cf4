"""Marking tests that need a newer torch than a host's own: ``@requires_torch("2.13", why)``.

CI runs torch 2.13 (``pyproject.toml``), where none of them is skipped. A GPU host that keeps
its own, older torch (``make test-gpu-host``, docs/development.md) skips each with the version
it needs and why, instead of failing on an API that torch does not have yet.
"""

import pytest
import torch
from torch.torch_version import TorchVersion


def requires_torch(minimum: str, why: str) -> pytest.MarkDecorator:
    """Skip unless torch >= ``minimum``; ``why`` names what the test needs from it."""
    return pytest.mark.skipif(
        TorchVersion(torch.__version__) < minimum,
        reason=f"needs torch >= {minimum} ({why}); this is torch {torch.__version__}",
    )
