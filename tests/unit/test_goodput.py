"""The goodput arithmetic behind each step's draft budget and the gate's expected speedup."""

from __future__ import annotations

import random
import statistics

import pytest

from specgate.algorithms import ALGORITHMS
from specgate.cost_model.goodput import (
    Acceptance,
    CostCurve,
    DraftCost,
    alpha_of_rate,
    break_even_alpha,
    choose_budget,
    expected_speedup,
    rate_of_alpha,
)

LINEAR = CostCurve.of_ratios({t: float(t) for t in (1, 2, 4, 8, 16, 32)})  # T tokens cost T times one
FLAT = CostCurve.of_ratios({1: 1.0, 32: 1.0})  # verification is free
FREE = DraftCost(per_node=True)
CHAIN = ALGORITHMS["eagle"].depth  # k nodes reach depth k
TREE = ALGORITHMS["eagle2"].depth  # at most EAGLE2_DEPTH (5)


def test_curve_interpolates_and_extends_linearly() -> None:
    c = CostCurve(tokens=[1, 2, 4], ms=[10.0, 12.0, 20.0])
    assert c.cost(1) == 10.0 and c.cost(3) == 16.0 and c.cost(6) == 28.0  # past the last point: last slope
    with pytest.raises(ValueError):
        CostCurve(tokens=[2, 4], ms=[1.0, 2.0])  # must start at one token


def test_acceptance_expected_tokens_and_shrinkage() -> None:
    a = Acceptance(prior=[0.5])
    assert a.expected(3) == pytest.approx([0.0, 0.5, 0.75, 0.875])
    for _ in range(200):  # position 1 always accepted, position 2 never
        a.record(depth=3, accepted=1)
    assert a.rate(0) > 0.95 and a.rate(1) < 0.05
    assert a.rate(2) == 0.5  # never tried: the prior


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9, 0.99])
def test_linear_cost_drafts_nothing_and_flat_cost_drafts_everything(alpha: float) -> None:
    acc = Acceptance(prior=[alpha])
    assert choose_budget(LINEAR, acc, FREE, 16, CHAIN) == 0
    assert choose_budget(FLAT, acc, FREE, 16, CHAIN) == 16
    assert choose_budget(FLAT, acc, FREE, 13, TREE) == 13  # a tree's nodes past its depth are free here


def test_budget_trades_acceptance_against_cost() -> None:
    curve = CostCurve(tokens=[1, 2, 3, 4, 8], ms=[10.0, 15.0, 20.0, 25.0, 45.0])  # llama.cpp-like
    assert choose_budget(curve, Acceptance(prior=[0.3]), FREE, 8, CHAIN) == 0
    high = choose_budget(curve, Acceptance(prior=[0.9]), FREE, 8, CHAIN)
    assert 1 <= high < 8
    # drafting time counts like verification time
    assert choose_budget(curve, Acceptance(prior=[0.9]), DraftCost(per_node=True, ms=20.0), 8, CHAIN) == 0


def test_speedup_break_even_and_rate_conversions() -> None:
    curve = CostCurve(tokens=[1, 2, 3, 4, 8], ms=[10.0, 15.0, 20.0, 25.0, 45.0])
    be = break_even_alpha(curve, FREE, 5, CHAIN)
    assert be is not None and 0.3 < be < 0.9
    assert expected_speedup(curve, FREE, be + 0.01, 5, CHAIN)[0] > 1.0 > expected_speedup(curve, FREE, be - 0.01, 5, CHAIN)[0]
    assert break_even_alpha(LINEAR, FREE, 5, CHAIN) is None  # never pays
    for alpha in (0.2, 0.5, 0.8):
        assert alpha_of_rate(rate_of_alpha(alpha, 5), 5) == pytest.approx(alpha, abs=1e-6)


def test_draws_spread_with_little_evidence_and_concentrate_with_much() -> None:
    rng = random.Random(0)
    unsure = Acceptance(prior=[0.6])
    sure = Acceptance(prior=[0.6], weight=[400.0])
    spread_unsure = statistics.pstdev(unsure.rates(1, rng)[0] for _ in range(2000))
    spread_sure = statistics.pstdev(sure.rates(1, rng)[0] for _ in range(2000))
    assert 0.12 < spread_unsure < 0.22 and spread_sure < 0.03
    assert statistics.mean(unsure.rates(1, rng)[0] for _ in range(4000)) == pytest.approx(0.6, abs=0.02)  # unbiased
    assert unsure.rates(3) == [unsure.rate(0)] * 3  # without rng: the posterior means


def test_sampled_budgets_explore_what_the_mean_rejects_and_stop_once_sure() -> None:
    curve = CostCurve(tokens=[1, 2, 4, 8], ms=[10.0, 20.0, 28.0, 46.0])  # steep: drafting pays above ~0.75
    rng = random.Random(1)
    unsure = Acceptance(prior=[0.6])
    assert choose_budget(curve, unsure, FREE, 5, CHAIN) == 0  # greedy: never tries
    tried = sum(choose_budget(curve, unsure, FREE, 5, CHAIN, rng) > 0 for _ in range(1000))
    assert 20 < tried < 500, tried
    sure = Acceptance(prior=[0.6], weight=[400.0])
    assert sum(choose_budget(curve, sure, FREE, 5, CHAIN, rng) > 0 for _ in range(1000)) < 5


def test_no_draw_makes_a_linear_curve_pay_or_a_flat_one_stop() -> None:
    rng = random.Random(2)
    for alpha in (0.2, 0.6, 0.95):
        acc = Acceptance(prior=[alpha])
        assert all(choose_budget(LINEAR, acc, FREE, 16, CHAIN, rng) == 0 for _ in range(200))
        assert all(choose_budget(FLAT, acc, FREE, 16, CHAIN, rng) == 16 for _ in range(200))


def test_a_drafted_steps_own_cost_counts_against_drafting() -> None:
    """What a drafted step costs beyond its decode and drafting, above a plain step's own share, is
    learned from the engine's steps (EngineLedger) and charged to every drafting budget."""
    from specgate.cost_model.ledger import EngineLedger

    curve = CostCurve(tokens=[1, 2, 3, 4, 8], ms=[10.0, 11.0, 12.0, 13.0, 17.0])
    acc = Acceptance(prior=[0.3])
    assert choose_budget(curve, acc, DraftCost(per_node=True), 8, CHAIN) > 0
    assert choose_budget(curve, acc, DraftCost(per_node=True, step_ms=2.0), 8, CHAIN) == 0
    ledger = EngineLedger(["ngram"], curve)
    request = ledger.request("ngram", 5)
    for _ in range(60):  # plain steps: 0.1 ms beyond the decode; drafted ones: 0.6 beyond decode and drafting
        request.step(0, 0, 0, 0, drafting_ms=0.0, verify_ms=10.0, step_ms=10.1)
        request.step(0, 2, 2, 1, drafting_ms=0.2, verify_ms=11.0, step_ms=11.8)
    assert ledger.plain_extra_ms == pytest.approx(0.1, abs=1e-3)
    assert ledger.draft_cost["ngram"].step_ms == pytest.approx(0.5, abs=0.02)
    assert ledger.draft_cost["ngram"](2) == pytest.approx(0.2 + 0.5, abs=0.02)  # n-gram's drafting is per step
    pinned = DraftCost(per_node=True, ms=1.0, pinned=True)
    pinned.record(5.0, 2, step_extra_ms=3.0)
    assert (pinned.ms, pinned.step_ms) == (1.0, 0.0)


def test_a_catch_up_is_priced_per_feature_and_spread_over_the_request() -> None:
    """A drafter's catch-up (EAGLE's head feeding on steps it skipped) is learned per feature, not
    per node, and charged to drafting now in proportion to the features waiting, spread over the
    tokens the request has left."""
    from specgate.cost_model.ledger import EngineLedger

    curve = CostCurve(tokens=[1, 2, 3, 4, 8], ms=[10.0, 11.0, 12.0, 13.0, 17.0])
    ledger = EngineLedger(["eagle"], curve)
    request = ledger.request("eagle", 5)
    request.step(0, 2, 2, 2, drafting_ms=1.0, verify_ms=11.0, step_ms=52.0, catchup_ms=40.0, caught_up=400)
    assert ledger.draft_cost["eagle"].ms == pytest.approx(0.5)  # per node, without the catch-up
    assert ledger.catchup_ms_per_unit["eagle"].value == pytest.approx(0.1)  # the first catch-up is the estimate
    request.step(0, 2, 2, 2, drafting_ms=1.0, verify_ms=11.0, step_ms=32.0, catchup_ms=20.0, caught_up=400)
    assert ledger.catchup_ms_per_unit["eagle"].value == pytest.approx((0.1 + 0.05) / 2)  # the plain mean while samples < 1/weight
    ledger._explore = None  # the posterior mean, not a draw
    assert request.budget(0, unseen=0, tokens_left=100) > 0
    assert request.budget(0, unseen=100_000, tokens_left=100) == 0  # 90 ms a step to catch up on
    assert request.budget(0, unseen=100_000, tokens_left=10**6) > 0  # the same, spread thin
