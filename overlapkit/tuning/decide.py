"""Pure decision functions of auto-tuning: candidates, trial order, the choice, memory bounds.

Nothing here touches a process group or a clock, so every rule tests without processes. The
measuring glue (``overlapkit.tuning.search``) feeds these functions trials whose timings were
already combined across ranks (the slowest rank per step), so every rank computes the same
answer from the same numbers.

The search for both knobs is a short ladder, a refinement and a confirmation:

1. try the coarse ladder once each, in ascending order, for a few measured steps: every
   candidate when there are at most ``COARSE_MAX`` of them, else every other one (a factor of 4
   between bucket sizes) plus the largest;
2. stop the ladder early once two consecutive candidates were both clearly slower than the best
   so far (step time is close to unimodal in bucket size: small buckets pay per-collective
   latency, large ones leave a long exposed tail);
3. try the untried neighbours of the best (the factor-of-2 sizes the coarse ladder skipped);
4. confirm: measure the best once more if it was measured only once (the lowest of several
   noisy single trials is biased low: one lucky trial should not decide), and the runner-up
   too if it is within ``confirm_within`` of the best; decide on the mean of each candidate's
   trial medians. At most ``MAX_REPEATS`` trials are repeats: on a flat curve, where every
   candidate is within a few per cent, more measuring would only chase noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from overlapkit.tuning.report import Trial

MiB = 1024 * 1024
AUTO = "auto"
MIN_BUCKET_MB = 0.25
MAX_BUCKET_MB = 256.0
MAX_CANDIDATES = 8
COARSE_MAX = 4
MAX_REPEATS = 2
EARLY_STOP_SLOWER = 0.25
CONFIRM_WITHIN = 0.05
PREFETCH_DEPTHS = (0, 1, 2)


def is_auto(value: object, *, knob: str, caller: str, expected: str) -> bool:
    """Whether ``value`` asks for auto-tuning; any other string is refused.

    Args:
        value: what the user passed for ``knob``.
        knob (str): the option's name as the user spells it (``"bucket_mb"``, ``"prefetch"``).
        caller (str): the API, for the message (``"ok.ddp"``).
        expected (str): what else the option accepts, for the message.

    Raises:
        ValueError: ``value`` is a string other than ``"auto"``.
    """
    if isinstance(value, str):
        if value == AUTO:
            return True
        raise ValueError(
            f"{caller}: {knob}={value!r} is not understood; use {expected} or {AUTO!r} "
            "(tune it from measurements during the first steps)"
        )
    return False


def check_max_memory(max_memory: object, *, auto: bool, caller: str = "ok.fsdp") -> int | None:
    """Validate ``max_memory`` (bytes of unsharded block parameters), used with prefetch='auto'.

    Raises:
        TypeError: not an int (bools are refused too).
        ValueError: negative, or given without ``prefetch='auto'``.
    """
    if max_memory is None:
        return None
    if isinstance(max_memory, bool) or not isinstance(max_memory, int):
        raise TypeError(f"{caller}: max_memory must be an int number of bytes, got {max_memory!r}")
    if max_memory < 0:
        raise ValueError(f"{caller}: max_memory must be >= 0 bytes, got {max_memory}")
    if not auto:
        raise ValueError(
            f"{caller}: max_memory={max_memory} bounds the prefetch that prefetch='auto' may "
            "choose; with a fixed prefetch the bound is 1 + prefetch blocks (ok.fsdp_stats)"
        )
    return max_memory


# -- bucket sizes ----------------------------------------------------------------------------


def bucket_layout(param_bytes: Sequence[int], cap_bytes: float) -> tuple[int, ...]:
    """Bucket sizes (bytes) that DDP's rule makes of ``param_bytes`` (in readiness order).

    The rule of DDP's ``compute_bucket_assignment_by_size`` and of ``GradBucketer``: a bucket
    takes parameters until it holds at least ``cap_bytes``.
    """
    sizes: list[int] = []
    current = 0
    for nbytes in param_bytes:
        current += nbytes
        if current >= cap_bytes:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return tuple(sizes)


def bucket_ladder(
    param_bytes: Sequence[int],
    *,
    min_mb: float = MIN_BUCKET_MB,
    max_mb: float = MAX_BUCKET_MB,
    max_candidates: int = MAX_CANDIDATES,
) -> list[float]:
    """Candidate bucket sizes in MiB: powers of two that give distinct bucket layouts.

    Powers of two from ``min_mb`` up to the first that puts every gradient in one bucket (or
    ``max_mb``). Sizes that produce the same layout as a smaller one are dropped: they would
    measure the same thing. With more than ``max_candidates`` left, every other one is dropped
    (keeping both ends) until they fit.

    Args:
        param_bytes (Sequence[int]): gradient bytes per parameter, in readiness order (reverse
            registration order is DDP's first guess).

    Returns:
        list[float]: ascending bucket sizes in MiB.

    Raises:
        ValueError: no parameters, or ``min_mb``/``max_mb`` not positive and ordered.
    """
    if not param_bytes or sum(param_bytes) <= 0:
        raise ValueError(f"bucket_ladder: no gradient bytes to bucket, got {list(param_bytes)}")
    if not 0 < min_mb <= max_mb:
        raise ValueError(f"bucket_ladder: need 0 < min_mb <= max_mb, got {min_mb}, {max_mb}")
    candidates: list[float] = []
    seen: set[tuple[int, ...]] = set()
    cap = 2.0 ** math.floor(math.log2(min_mb))
    while cap <= max_mb:
        if cap >= min_mb:
            layout = bucket_layout(param_bytes, cap * MiB)
            if layout not in seen:
                seen.add(layout)
                candidates.append(cap)
            if len(layout) == 1:
                break
        cap *= 2
    while len(candidates) > max(max_candidates, 2):
        candidates = candidates[::2] + ([candidates[-1]] if len(candidates) % 2 == 0 else [])
    return candidates


# -- prefetch depth ----------------------------------------------------------------------------


def prefetch_memory_bound(
    block_bytes: Sequence[int], depth: int, *, reshard_after_forward: bool = True
) -> int:
    """Most unsharded block bytes at once with prefetch ``depth`` (what ok.fsdp_stats measures).

    Forward holds the computing block plus ``depth`` prefetched ones; backward the computing one
    plus ``max(depth, 1)`` (FSDP2 prefetches one block in backward by default). Without
    resharding after forward every block stays unsharded. The bound takes the largest blocks.
    """
    blocks = len(block_bytes)
    count = 1 + max(depth, 1) if reshard_after_forward else blocks
    return sum(sorted(block_bytes, reverse=True)[: min(count, blocks)])


def prefetch_candidates(
    block_bytes: Sequence[int],
    max_memory: int | None,
    *,
    reshard_after_forward: bool = True,
    caller: str = "ok.fsdp",
) -> list[int]:
    """Prefetch depths whose memory bound fits ``max_memory`` bytes (all of them if None).

    Raises:
        ValueError: not even ``prefetch=0`` fits, naming ``max_memory`` and what is needed.
    """
    fits = [
        d
        for d in PREFETCH_DEPTHS
        if max_memory is None
        or prefetch_memory_bound(block_bytes, d, reshard_after_forward=reshard_after_forward)
        <= max_memory
    ]
    if not fits:
        need = prefetch_memory_bound(block_bytes, 0, reshard_after_forward=reshard_after_forward)
        raise ValueError(
            f"{caller}: max_memory={max_memory} bytes is below the {need} bytes of unsharded "
            "block parameters that even prefetch=0 holds at once (the two largest blocks in "
            "backward); raise max_memory or shard into smaller blocks"
        )
    return fits


# -- the search --------------------------------------------------------------------------------


def _scores(trials: Sequence[Trial]) -> dict[float | int, float]:
    """Mean of the trial medians per candidate value (ms)."""
    by_value: dict[float | int, list[float]] = {}
    for trial in trials:
        by_value.setdefault(trial.value, []).append(trial.step_ms)
    return {value: sum(ms) / len(ms) for value, ms in by_value.items()}


def _ranked(trials: Sequence[Trial]) -> list[tuple[float | int, float]]:
    # Ties go to the earlier (smaller) candidate so that every rank breaks them alike.
    scores = _scores(trials)
    order = {value: i for i, value in enumerate(dict.fromkeys(t.value for t in trials))}
    return sorted(scores.items(), key=lambda item: (item[1], order[item[0]]))


def coarse_ladder(candidates: Sequence[float | int]) -> list[float | int]:
    """The candidates tried first: all of up to ``COARSE_MAX``, else every other and the last."""
    if len(candidates) <= COARSE_MAX:
        return list(candidates)
    coarse = list(candidates[::2])
    return coarse if coarse[-1] == candidates[-1] else [*coarse, candidates[-1]]


def ladder_done(
    candidates: Sequence[float | int],
    trials: Sequence[Trial],
    *,
    early_stop_slower: float = EARLY_STOP_SLOWER,
) -> bool:
    """Whether the ladder phase is over: every candidate tried, or two in a row clearly slower.

    "Clearly slower" is more than ``early_stop_slower`` (a fraction) above the best so far.
    """
    # First measurements only, in ladder order: a later repeat is confirmation, not ladder.
    firsts: dict[float | int, Trial] = {}
    for t in trials:
        if t.value in candidates:
            firsts.setdefault(t.value, t)
    tried = list(firsts.values())
    if len(tried) >= len(candidates):
        return True
    if len(tried) < 3:
        return False
    best = min(t.step_ms for t in tried)
    return all(t.step_ms > best * (1 + early_stop_slower) for t in tried[-2:])


def next_trial(
    candidates: Sequence[float | int],
    trials: Sequence[Trial],
    *,
    early_stop_slower: float = EARLY_STOP_SLOWER,
    confirm_within: float = CONFIRM_WITHIN,
) -> float | int | None:
    """The next candidate to measure, or None when the search is over.

    Args:
        candidates: values to try, in ladder order.
        trials: what was measured so far, oldest first (identical on every rank).
        early_stop_slower (float): see ``ladder_done``.
        confirm_within (float): also re-measure the runner-up when it is within this fraction
            of the best; 0 turns confirmation (re-measuring the best, too) off.
    """
    if not candidates:
        raise ValueError("next_trial: no candidates to try")
    if len(candidates) == 1:
        return None if trials else candidates[0]
    tried = {t.value for t in trials}
    coarse = coarse_ladder(candidates)
    if not ladder_done(coarse, trials, early_stop_slower=early_stop_slower):
        return next(c for c in coarse if c not in tried)
    ranked = _ranked(trials)
    i = list(candidates).index(ranked[0][0])
    for neighbour in candidates[max(i - 1, 0) : i + 2]:
        if neighbour not in tried:
            return neighbour
    if len(ranked) < 2 or confirm_within <= 0:
        return None
    if len(trials) - len(tried) >= MAX_REPEATS:
        return None
    (best, best_ms), (second, second_ms) = ranked[0], ranked[1]
    counts = {value: sum(t.value == value for t in trials) for value in (best, second)}
    if counts[best] < 2:
        return best
    if counts[second] < 2 and second_ms <= best_ms * (1 + confirm_within):
        return second
    return None


def decide(trials: Sequence[Trial], *, unit: str = "") -> tuple[float | int, str]:
    """The candidate with the lowest mean step time, and a one-line reason.

    Raises:
        ValueError: no trials.
    """
    if not trials:
        raise ValueError("decide: no trials measured")
    ranked = _ranked(trials)
    best, best_ms = ranked[0]
    reason = f"fastest mean step {best_ms:.1f} ms over {len(trials)} trials"
    if len(ranked) > 1:
        second, second_ms = ranked[1]
        reason += (
            f"; runner-up {second:g}{unit} at {second_ms:.1f} ms "
            f"(+{(second_ms / best_ms - 1) * 100:.1f}%)"
        )
    return best, reason
