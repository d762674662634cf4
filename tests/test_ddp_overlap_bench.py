"""``python -m bench.ddp_overlap``: its command line, checked before any rank starts."""

from __future__ import annotations

import pytest

from bench import ddp_overlap


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--rounds", "1", "--steps", "2", "--warmup", "2"],
            "--rounds 1 with --steps 2 <= --warmup 2 times no step: pass --steps > 2, fewer "
            "--warmup steps, or --rounds 2 or more",
        ),
        (["--steps", "0"], "--steps 0, --rounds 5, --warmup 2: each case needs --steps >= 1"),
    ],
)
def test_flags_that_time_no_step_are_refused_naming_them(argv, message):
    # main() checks them first: no CPU priority change, no emulated link, no rank started.
    with pytest.raises(SystemExit) as exit_info:
        ddp_overlap.main(argv)
    assert str(exit_info.value).startswith(message)
