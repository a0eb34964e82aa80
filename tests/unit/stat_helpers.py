"""Chi-square goodness of fit without scipy: the statistic and hard-coded critical values."""

from __future__ import annotations

from torch import Tensor

Z_0999 = 3.0902  # standard normal quantile at 0.999


def chi2_critical(df: int) -> float:
    """Critical value at alpha = 0.001 (Wilson-Hilferty; within 1% of scipy's chi2.ppf(0.999, df)
    for df >= 3, e.g. 66.7 vs 66.62 at df = 35, 31.4 vs 31.26 at df = 11)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_0999 * a**0.5) ** 3


def passes_chi2(counts: Tensor, expected_p: Tensor) -> bool:
    """True when `counts` are consistent with samples from `expected_p` (alpha = 0.001)."""
    stat, df = chi2(counts, expected_p)
    return stat < chi2_critical(df)


def chi2(counts: Tensor, expected_p: Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `counts` against probabilities `expected_p`.

    Cells expected to hold fewer than `min_expected` samples are pooled into one, where the
    chi-square approximation would be poor; any count in a zero-probability cell makes it infinite.
    """
    counts, expected_p = counts.flatten().double(), expected_p.flatten().double()
    if bool((counts[expected_p == 0] > 0).any()):
        return float("inf"), 1
    expected = expected_p * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big]) + [counts[~big & (expected_p > 0)].sum()]
    exp = list(expected[big]) + [expected[~big & (expected_p > 0)].sum()]
    pairs = [(o, e) for o, e in zip(obs, exp) if e > 0]
    return float(sum((o - e) ** 2 / e for o, e in pairs)), len(pairs) - 1
