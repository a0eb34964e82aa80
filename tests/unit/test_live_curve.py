"""The live cost curve: the calibration corrected by the engine's own decodes.

The accounting is checked on injected timings; the last test shows a wrong calibration being
corrected by real llama.cpp decodes while serving, so that the engine stops paying for drafts the
calibration called cheap.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from specgate.cost_model.goodput import CostCurve
from specgate.cost_model.live import LiveCurve
from specgate.cost_model.measure import measure
from specgate.decoding.llamacpp_target import LlamaCppTarget
from specgate.speculative import SpeculativeGenerator
from specgate.speculative.ngram import NgramDrafter

PRIOR = CostCurve(tokens=[1, 2, 4, 8], ms=[13.0, 15.0, 20.0, 30.0])


def test_plain_steps_correct_the_one_token_cost_and_nothing_else() -> None:
    curve = LiveCurve(PRIOR)
    for _ in range(40):
        curve.record_step(1, 7.4)
    assert curve.cost(1) == pytest.approx(7.4, rel=0.1)  # the calibration's 13 ms was wrong
    assert curve.cost(4) == 20.0 and curve.cost(3) == 17.5  # never verified: the calibration's, interpolated
    assert curve.ratio(2) == pytest.approx(15.0 / curve.cost(1))


def test_a_draft_step_is_charged_the_excess_of_the_plain_step_after_it() -> None:
    curve = LiveCurve(PRIOR, prior_decodes=0.0)  # no shrinkage: the arithmetic alone
    for _ in range(5):
        curve.record_step(1, 7.0)
    curve.record_step(4, 20.0)
    curve.record_step(1, 9.0)  # 2 ms over a plain step: the graph re-planned after the draft
    assert curve.cost(4) == pytest.approx(22.0)
    assert curve.cost(1) == pytest.approx(7.0)  # the slow plain step is not a plain step's cost
    curve.record_step(8, 40.0)
    curve.record_step(8, 40.0)  # a draft right after a draft: the first is recorded as it was
    curve.end_request()  # and the last when the request ends
    assert curve.cost(8) == pytest.approx(40.0)


def test_shrinkage_towards_the_calibration_fades_with_decodes() -> None:
    curve = LiveCurve(PRIOR, prior_decodes=4.0)
    curve.record_step(1, 7.0)
    assert curve.cost(1) == pytest.approx((4 * 13.0 + 7.0) / 5)  # one decode moves it a fifth of the way
    for _ in range(60):
        curve.record_step(1, 7.0)
    assert curve.cost(1) == pytest.approx(7.0, rel=0.1)


def test_a_new_token_count_becomes_a_point_of_the_curve() -> None:
    curve = LiveCurve(PRIOR, prior_decodes=0.0)
    curve.record_step(6, 40.0)
    curve.end_request()
    assert curve.cost(6) == pytest.approx(40.0)
    assert curve.cost(5) == pytest.approx(30.0)  # between 4 (20 ms) and the new point
    assert curve.snapshot().tokens == PRIOR.tokens  # the published curve keeps the calibration's points
    assert curve.drift(PRIOR) == pytest.approx(max(curve.cost(t) / PRIOR.cost(t) for t in PRIOR.tokens))


def test_an_injected_curve_is_pinned() -> None:
    injected = CostCurve.of_ratios({1: 1.0, 32: 1.0})
    curve = LiveCurve(injected)
    for _ in range(20):
        curve.record_step(1, 50.0)
        curve.record_step(8, 400.0)
    assert curve.cost(1) == injected.cost(1) and curve.cost(8) == injected.cost(8)


def test_serving_corrects_a_calibration_that_called_drafts_cheap(gguf: Path) -> None:
    """A calibration that says verification is free (every size costs the one-token time) against
    what llama.cpp's decodes take: the engine drafts, learns what its drafts cost, and then drafts less.
    The truth is measured between the requests, in rounds, so that it sees the machine the served
    decodes saw (its speed drifts, other work comes and goes). At every size it verified often, what
    the served decodes taught it (the learned cost before its shrinkage towards the calibration, over
    the rounds' median one-token time) must go at least half the way from the lie (1.0x) to the least
    steep round's ratio, and stay within three times the steepest's. Why before the shrinkage: at 3
    decodes the learned cost is only 60% of the way to what they measured, by design, and under load
    a size the rounds saw at 4.3-12x was served at 3.6x: the shrunk 2.62x missed a half-way bar of 2.63.

    Why over the rounds' one-token time and not the learned one: the learned cost(1) is the median
    of the last 32 plain steps, the end of the run, while a size's few verifications are spread over
    all of it. On a 2-core EPYC whose speed drifted (cost(1) 7.0-10.5 ms across the rounds of one
    run) the learned 2 tokens, 20.5 ms, over a learned cost(1) of 10.9 ms fell 1% short of the bar,
    while the rounds' cost(1) was about 8.4 ms. The rounds are spread over the run as the served
    decodes are, and their median is robust to one slowed round.

    Why rounds and not one truth: under background load (`stress --cpu 1`) a decode is sometimes
    descheduled mid-way, which only adds time, so it flattens a round's ratio or, when it hits the
    bigger decode, steepens it; the band is what the rounds saw. A learner that does not learn stays
    at the lie (about 1.0x, below any round of a machine whose verification is not free: checked on
    its steepest round) and keeps drafting as much."""
    target = LlamaCppTarget(gguf, max_context=1024, num_slots=1, threads=2, tree_nodes=16)
    sizes = (1, 2, 3, 4, 5, 6)
    truths = [measure(target, slot=0, sizes=sizes, reps=3)]
    lie = CostCurve(tokens=list(sizes), ms=[truths[0].ms[0]] * len(sizes))
    gen = SpeculativeGenerator(target, {"ngram": NgramDrafter()}, lie)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 40  # prompt lookup has matches: steps draft
    drafted = []
    for _ in range(4):
        stream = gen.generate(prompt, 48, algorithm="ngram", k=5)
        for _ in stream:
            pass
        drafted.append(stream.stats.draft_tokens)
        truths.append(measure(target, slot=0, sizes=sizes, reps=3))
    truth = CostCurve(tokens=list(sizes), ms=[statistics.median(c.ms[i] for c in truths) for i in range(len(sizes))])  # for the message
    # whether the machine's verification is free at all, from the steepest round: load only flattens
    # a round (the first one alone fell to 1.43x in 2 of 20 runs under `stress --cpu 1`)
    steepest = max(truths, key=lambda c: c.ratio(4))
    assert steepest.ratio(4) > 1.5, f"llama.cpp's verification was near free here ({steepest.table()}): this test cannot tell"
    assert gen.curve is not None
    counts = {t: gen.curve._count.get(t, 0) for t in sizes[1:]}
    # Sizes verified 3 times or more are compared with the rounds. Under load one descheduled
    # verification can cost several plain steps, and the engine may then not draft that size again
    # (a dear size stays dear until it is tried): 1 of 20 runs under `stress --cpu 1` ended with no
    # size verified 3 times (1 each) and so nothing to compare; the drafting check below still runs.
    # A learner that does not learn never ends so: on the lie it drafts the full k at every step.
    often = [t for t, n in counts.items() if n >= 3]
    print(f"\nverifications per size {counts}; draft tokens per request {drafted}")
    one = statistics.median(c.cost(1) for c in truths)  # the machine's one-token time over the run
    w = gen.curve._prior_decodes
    for t in often:
        # what the served decodes said, before the shrinkage towards the lie (cost_model/live.py)
        served = ((w + counts[t]) * gen.curve.cost(t) - w * lie.cost(t)) / counts[t] / one
        rounds = [c.ratio(t) for c in truths]
        tables = (t, counts, gen.curve.snapshot().table(), truth.table(), [round(r, 2) for r in rounds], round(served, 2))
        assert served - lie.ratio(t) >= 0.5 * (min(rounds) - lie.ratio(t)), tables
        assert served <= 3 * max(rounds), tables
    # What the lie drafts unlearned: k at every step where prompt lookup matches, which is what an
    # engine with no curve does. The later requests, on what was learned, draft less on average (one
    # of them alone can draft more: a stretch of fast decodes under load lowers the curve). Not
    # against the first request: it learns as it goes, and on a 2-core EPYC it once drafted 27 against
    # 31, 30 and 21 after it, while this request unlearned drafts 40.
    unlearned = SpeculativeGenerator(target, {"ngram": NgramDrafter()}).generate(prompt, 48, algorithm="ngram", k=5)
    for _ in unlearned:
        pass
    assert sum(drafted[1:]) / len(drafted[1:]) < unlearned.stats.draft_tokens, (
        f"draft tokens per request {drafted}, unlearned {unlearned.stats.draft_tokens}"
    )


def test_the_modelled_speedup_is_what_the_steps_bought_on_the_curve(gguf: Path) -> None:
    """1.0 where nothing is drafted (T tokens cost T times one); on a free curve, tokens per step."""
    target = LlamaCppTarget(gguf, max_context=1024, num_slots=1, threads=2, tree_nodes=16)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 40
    linear = CostCurve.of_ratios({t: float(t) for t in (1, 2, 4, 8, 16)})
    stream = SpeculativeGenerator(target, {"ngram": NgramDrafter()}, linear).generate(prompt, 32, algorithm="ngram", k=5)
    tokens = sum(len(block) for block in stream)
    assert stream.stats.draft_tokens == 0 and stream.stats.modelled_speedup == pytest.approx(1.0)
    # A free curve whose step costs a simulated 1000 s: the drafter's real time (microseconds, or a few
    # ms on a loaded machine) is then too small to move the ratio, and the test does not depend on
    # this machine's speed (at 10 ms a step, a slow CI machine's drafting took 7% off it).
    free = CostCurve.of_ratios({1: 1.0, 32: 1.0}, base_ms=1e6)
    gen = SpeculativeGenerator(target, {"ngram": NgramDrafter()}, free)
    stream = gen.generate(prompt, 32, algorithm="ngram", k=5)
    blocks = [len(block) for block in stream]
    assert stream.stats.accepted_tokens > 0
    # every step costs cost(1) on a free curve: tokens per step; drafting's time still counts, so just under
    steps_after_first = len(blocks) - 1  # the first block is the prefill's token
    per_step = (sum(blocks) - 1) / steps_after_first
    assert stream.stats.modelled_speedup == pytest.approx(per_step, rel=1e-4)
    assert stream.stats.modelled_speedup < per_step
    assert tokens > 0
