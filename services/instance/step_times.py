"""Engine step times: the recent ones, whose medians go into load reports, and a histogram
of every step since start for /metrics (`ferry_instance_step_duration_seconds`).

Two medians over the same recent steps: the plain one, and one weighted by the tokens each step
produced. A client's gaps between tokens follow the second: a step that makes 8 tokens is 8 gaps of
its length, an idle-ish step of one token is one (serving benchmark's overhead line).

The engine thread adds one time per step (a deque append and a counter bump); the metrics
thread reads them. Each bucket counts its own steps and the scrape makes them cumulative, so
a scrape between two bumps still sees buckets that add up to their count.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics

from prometheus_client.utils import floatToGoString

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StepTimes:
    def __init__(self, num_recent: int = 256) -> None:
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=num_recent)  # (s, tokens)
        self._counts = [0] * (len(BUCKETS_S) + 1)  # steps per bucket; the last is past the largest bound
        self.sum_s = 0.0

    def add(self, seconds: float, num_tokens: int) -> None:
        """One step's time and the tokens it produced (engine thread)."""
        self._recent.append((seconds, num_tokens))
        self._counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1  # a bound is inclusive: le
        self.sum_s += seconds

    @property
    def median_ms(self) -> float:
        """Median of the recent steps in milliseconds (0 before the first step)."""
        recent = [seconds for seconds, _ in list(self._recent)]
        return statistics.median(recent) * 1000 if recent else 0.0

    @property
    def token_weighted_median_ms(self) -> float:
        """Median of the recent steps in milliseconds, each counted once per token it produced: the step time of
        the median token (0 while none produced any). Halfway between two steps where the tokens split evenly, as
        `median_ms` is between two steps when every step made one token."""
        steps = sorted((seconds, num_tokens) for seconds, num_tokens in list(self._recent) if num_tokens > 0)
        half, below = sum(num_tokens for _, num_tokens in steps) / 2, 0
        for i, (seconds, num_tokens) in enumerate(steps):
            below += num_tokens
            if below > half:
                return seconds * 1000
            if below == half:
                return (seconds + steps[i + 1][0]) / 2 * 1000
        return 0.0

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """(le, steps at most that long) for each bound and +Inf, as Prometheus exposes them."""
        buckets, total = [], 0
        for bound, count in zip((*BUCKETS_S, math.inf), list(self._counts), strict=True):
            total += count
            buckets.append((floatToGoString(bound), total))
        return buckets
