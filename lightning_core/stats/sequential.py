"""The live gate's statistics: a sequential test of challenger against champion on feedback.

The canary's feedback arrives one episode at a time and the gate looks after each poll, so a
fixed-sample test (a t-test read every minute) would reject far more often than its nominal
error rate. This is the mixture sequential probability ratio test (mSPRT) of Johari, Koomen,
Pekelis and Walsh ("Peeking at A/B tests", KDD 2017; "Always valid inference", Operations
Research 2022), the test behind Optimizely's always-valid p-values: for the difference of the
two means, with the normal approximation and a normal mixture N(0, tau^2) over the effect,

    Lambda_n = sqrt(V / (V + tau^2)) * exp(tau^2 * d^2 / (2 * V * (V + tau^2))),
    d = mean_challenger - mean_champion,  V = var_challenger / n_c + var_champion / n_p.

Lambda is a nonnegative martingale under "no difference", so by Ville's inequality it ever
reaches 1/alpha with probability at most alpha, however often the gate looks: the false
decision rate is at most `alpha` (per canary). Before `min_episodes` per arm the normal
approximation is not trusted and the gate waits; after `max_episodes` per arm without a
decision the canary ends and the champion stays (a challenger no better than it is not worth
the swap). scipy and statsmodels offer no sequential two-sample test, hence this small one.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# A feedback stream of identical values has a variance of 0 (every canary episode rated 1.0):
# floored so that V > 0 and the statistic stays finite; far below any real rating's variance.
VARIANCE_FLOOR = 1e-4


class LiveGateConfig(BaseModel):
    """The live gate: the sequential test a challenger in canary must pass on feedback."""

    alpha: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Error rate of the live gate: the chance that it promotes (or ends) a canary "
        "whose challenger is in truth as good as the champion, however often it looks.",
    )
    tau: float = Field(
        0.1,
        gt=0,
        description="Scale of the differences in mean feedback the test is tuned to find (its "
        "mixture's standard deviation); 0.1 for ratings in [0, 1].",
    )
    min_episodes: int = Field(
        20,
        ge=2,
        description="Episodes with feedback each arm needs before the gate decides: the normal "
        "approximation behind the test needs that many.",
    )
    max_episodes: int = Field(
        2000,
        ge=2,
        description="Episodes with feedback per arm after which a canary without a decision "
        "ends and the champion stays.",
    )


Verdict = Literal["wait", "promote", "end"]


class LiveGateDecision(BaseModel):
    """What the live gate says about a canary now, and why."""

    model_config = ConfigDict(frozen=True)

    verdict: Verdict = Field(description="wait (need more feedback), promote, or end.")
    reason: str = Field(description="Why, with both means and the statistic.")
    difference: float | None = Field(None, description="Challenger mean minus champion mean.")
    statistic: float | None = Field(None, description="The mixture likelihood ratio Lambda.")


def mixture_ratio(difference: float, variance: float, tau: float) -> float:
    """Lambda for an observed `difference` whose variance is `variance` (V), mixture `tau`."""
    t2 = tau * tau
    exponent = t2 * difference * difference / (2 * variance * (variance + t2))
    # Past e^700 the ratio is beyond any threshold; avoid the overflow.
    return math.sqrt(variance / (variance + t2)) * math.exp(min(exponent, 700.0))


def live_gate(
    champion: tuple[int, float, float],
    challenger: tuple[int, float, float],
    config: LiveGateConfig,
) -> LiveGateDecision:
    """The gate on (episodes, mean, variance) of the champion's and the challenger's feedback
    since the canary began."""
    (n_p, mean_p, var_p), (n_c, mean_c, var_c) = champion, challenger
    counts = f"challenger {mean_c:.3f} (n={n_c}) vs champion {mean_p:.3f} (n={n_p})"
    if min(n_p, n_c) < config.min_episodes:
        return LiveGateDecision(
            verdict="wait",
            reason=f"{counts}: each arm needs {config.min_episodes} episodes with feedback",
        )
    difference = mean_c - mean_p
    variance = max(var_c, VARIANCE_FLOOR) / n_c + max(var_p, VARIANCE_FLOOR) / n_p
    ratio = mixture_ratio(difference, variance, config.tau)
    stat = f"Lambda {ratio:.3g} vs 1/alpha {1 / config.alpha:.3g}"
    if ratio >= 1 / config.alpha:
        verdict: Verdict = "promote" if difference > 0 else "end"
        better = "better" if difference > 0 else "worse"
        reason = f"{counts}: challenger {better} by {difference:+.3f} ({stat})"
    elif min(n_p, n_c) >= config.max_episodes:
        verdict = "end"
        reason = f"{counts}: no difference found in {config.max_episodes} episodes ({stat})"
    else:
        verdict = "wait"
        reason = f"{counts}: no decision yet ({stat})"
    return LiveGateDecision(verdict=verdict, reason=reason, difference=difference, statistic=ratio)


class RollbackConfig(BaseModel):
    """When the champion's live feedback rolls it back to the previous champion."""

    enabled: bool = Field(True, description="Roll a champion back automatically.")
    margin: float = Field(
        0.1,
        ge=0,
        description="How far the champion's mean feedback may fall below the previous "
        "champion's before it is rolled back.",
    )
    window: int = Field(
        50,
        ge=2,
        description="Newest episodes with feedback per version compared (the champion's since "
        "it serves, the previous champion's from when it did).",
    )
    min_episodes: int = Field(
        20, ge=2, description="Episodes with feedback each needs in the window first."
    )


def rollback_reason(
    champion: tuple[int, float], previous: tuple[int, float], config: RollbackConfig
) -> str | None:
    """Why the champion (episodes, mean feedback in the window) must give way to the previous
    champion, or None. A margin rule rather than a test: a rollback is cheap to undo (the
    next canary), serving a broken champion is not."""
    (n, mean), (n_prev, mean_prev) = champion, previous
    if not config.enabled or min(n, n_prev) < config.min_episodes:
        return None
    if mean < mean_prev - config.margin:
        return (
            f"live feedback {mean:.3f} over its newest {n} episodes is below the previous "
            f"champion's {mean_prev:.3f} (n={n_prev}) by more than the margin {config.margin:g}"
        )
    return None
