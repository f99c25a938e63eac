"""The quality/cost curve of a difficulty router, from a per-question table of measured outcomes.

Each question has, for both models, whether the answer was correct and the measured compute-seconds of that
request alone. A router gives each question a difficulty score; at a threshold t, questions with score >= t
go to the large model. Sweeping t from above the largest score (all small) to the smallest (all large) traces
the curve of (fraction sent large, accuracy, total compute-seconds), as RouteLLM (Ong et al. 2024) plots
quality against the share of calls to the strong model. A random router's expected curve is the straight
line between the two ends. Torch-free and numpy-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class Outcome:
    """What both models did on one question."""

    small_correct: bool  # the small model's reply passed the checker
    large_correct: bool  # the large model's reply passed the checker
    small_seconds: float  # measured compute-seconds of the small model's request
    large_seconds: float  # measured compute-seconds of the large model's request
    overhead_seconds: float = 0.0  # the estimator's own cost when the question goes large (e.g. a small draft)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One operating point of a router."""

    threshold: float  # questions with score >= threshold went to the large model (inf: none did)
    frac_large: float  # fraction of questions sent to the large model, 0..1
    accuracy: float  # fraction answered correctly, 0..1
    seconds: float  # total compute-seconds over the questions (estimator overhead included)


def route_point(scores: Sequence[float], outcomes: Sequence[Outcome], threshold: float) -> CurvePoint:
    """The operating point at `threshold`: score >= threshold goes large.

    Raises:
        ValueError: scores and outcomes differ in length or are empty.
    """
    if len(scores) != len(outcomes) or not outcomes:
        raise ValueError(f"scores and outcomes must be non-empty and equal in length, got {len(scores)}, "
                         f"{len(outcomes)}")
    large = correct = 0
    seconds = 0.0
    for score, o in zip(scores, outcomes):
        if score >= threshold:
            large += 1
            correct += o.large_correct
            seconds += o.large_seconds + o.overhead_seconds
        else:
            correct += o.small_correct
            seconds += o.small_seconds
    n = len(outcomes)
    return CurvePoint(threshold, large / n, correct / n, seconds)


def sweep(scores: Sequence[float], outcomes: Sequence[Outcome]) -> list[CurvePoint]:
    """Every distinct operating point, from all small (threshold inf) to all large, frac_large ascending."""
    thresholds = [float("inf"), *sorted(set(scores), reverse=True)]
    return [route_point(scores, outcomes, t) for t in thresholds]


def random_curve(outcomes: Sequence[Outcome], steps: int = 20) -> list[CurvePoint]:
    """The expected curve of routing a fraction f at random: linear between all small and all large (the
    threshold field holds f)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = len(outcomes)
    small_acc = sum(o.small_correct for o in outcomes) / n
    large_acc = sum(o.large_correct for o in outcomes) / n
    small_s = sum(o.small_seconds for o in outcomes)
    large_s = sum(o.large_seconds for o in outcomes)
    return [CurvePoint(f, f, (1 - f) * small_acc + f * large_acc, (1 - f) * small_s + f * large_s)
            for f in (i / steps for i in range(steps + 1))]


def oracle_point(outcomes: Sequence[Outcome]) -> CurvePoint:
    """The best any router can do: large only where the small model fails and the large one succeeds."""
    scores = [1.0 if (not o.small_correct and o.large_correct) else 0.0 for o in outcomes]
    return route_point(scores, outcomes, 1.0)


def best_within(points: Sequence[CurvePoint], max_seconds: float) -> CurvePoint | None:
    """The most accurate point costing at most `max_seconds` (the cheaper of ties), or None."""
    fitting = [p for p in points if p.seconds <= max_seconds]
    if not fitting:
        return None
    return max(fitting, key=lambda p: (p.accuracy, -p.seconds))


def cheapest_reaching(points: Sequence[CurvePoint], min_accuracy: float) -> CurvePoint | None:
    """The cheapest point with accuracy >= min_accuracy, or None (RouteLLM's "call-performance threshold")."""
    reaching = [p for p in points if p.accuracy >= min_accuracy]
    return min(reaching, key=lambda p: (p.seconds, -p.accuracy)) if reaching else None


__all__ = ["CurvePoint", "Outcome", "best_within", "cheapest_reaching", "oracle_point", "random_curve",
           "route_point", "sweep"]
