"""SpeculativeRunner (spec_engine's scheduler) on the real model in fp32: one at a time, FIFO, and the
hand-over the gate asks for under load (requests submitted before it stop at their next step with
`handed_over`; the baseline continues them from prompt + emitted tokens, losslessly)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from specgate.cost_model.calibration import Calibration
from specgate.cost_model.goodput import CostCurve
from specgate.decoding.config import EngineConfig
from specgate.decoding.model import Llama, load_llama
from specgate.decoding.plain import greedy_decode
from specgate.decoding.request import Event, GenerationRequest
from specgate.decoding.torch_target import TorchTarget
from specgate.machine import machine
from specgate.speculative import spec_runner
from specgate.speculative.ngram import NgramDrafter
from specgate.speculative.spec_runner import SpeculativeRunner
from specgate.text.tokenizer import PromptTokenizer

MAX_CONTEXT = 256
NEW = 32
PROMPTS = ["Explain recursion to a ten-year-old.", "Write a limerick about a cat who codes."]


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Llama:
    return load_llama(checkpoint, torch.float32, MAX_CONTEXT)


@pytest.fixture(scope="module")
def prompts(checkpoint: Path) -> list[list[int]]:
    tok = PromptTokenizer(checkpoint, MAX_CONTEXT)
    return [tok.encode_prompt(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(model: Llama, prompts: list[list[int]]) -> list[list[int]]:
    return [greedy_decode(TorchTarget(model, MAX_CONTEXT, 1), p, NEW) for p in prompts]


@pytest.fixture
def runner(checkpoint: Path, model: Llama):
    cfg = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=MAX_CONTEXT, max_batch_size=1)
    r = SpeculativeRunner(TorchTarget(model, MAX_CONTEXT, 1), {"ngram": NgramDrafter()}, cfg, calibrated=False)
    yield r
    r.shutdown()


class Collect:
    def __init__(self, on_event=None) -> None:  # noqa: ANN001
        self.tokens: list[int] = []
        self.final: Event | None = None
        self.done = threading.Event()
        self.on_event = on_event

    def __call__(self, ev: Event) -> None:
        self.tokens += ev.tokens
        if self.on_event:
            self.on_event(self)
        if ev.finished:
            self.final = ev
            self.done.set()


def _greedy(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(input_ids=prompt, max_new_tokens=NEW)


def test_hand_over_stops_earlier_requests_and_the_baseline_continues_losslessly(runner, model, prompts, reference) -> None:
    # a: asks for the hand-over itself once it has 3 tokens (deterministic: same thread); b waits behind a
    a = Collect(on_event=lambda c: len(c.tokens) >= 3 and runner.hand_over_all())
    b = Collect()
    runner.submit(_greedy(prompts[0]), a, algorithm="ngram")
    runner.submit(_greedy(prompts[1]), b, algorithm="ngram")
    assert a.done.wait(300) and b.done.wait(300)
    assert a.final.handed_over and a.final.error is None
    assert 3 <= len(a.tokens) < NEW and a.tokens == reference[0][: len(a.tokens)]
    assert b.final.handed_over and b.tokens == []  # queued before the hand-over: never started
    # what the gate does next: the baseline continues from prompt + emitted tokens
    rest = greedy_decode(TorchTarget(model, MAX_CONTEXT, 1), prompts[0] + a.tokens, NEW - len(a.tokens))
    assert a.tokens + rest == reference[0]
    # a request submitted after the hand-over runs to the end
    c = Collect()
    runner.submit(_greedy(prompts[1]), c, algorithm="ngram")
    assert c.done.wait(300)
    assert not c.final.handed_over and c.tokens == reference[1]


def test_a_finished_request_is_not_handed_over(runner, prompts, reference) -> None:
    """A hand-over asked for during the last step must not turn a complete answer into a partial one
    (the baseline would continue past its end)."""
    a = Collect(on_event=lambda c: len(c.tokens) >= NEW and runner.hand_over_all())
    runner.submit(_greedy(prompts[0]), a, algorithm="ngram")
    assert a.done.wait(300)
    assert not a.final.handed_over and a.tokens == reference[0]


def test_bad_prompts_are_refused_at_submit(runner, model) -> None:
    """The same prompt checks as the baseline engine: a clear ValueError before anything runs; and
    a direct call must name its algorithm (the default lives in the gate's policy)."""
    with pytest.raises(ValueError, match="speculative_algorithm"):
        runner.submit(_greedy([1, 2]), Collect())
    with pytest.raises(ValueError, match="context"):
        runner.submit(_greedy([1] * MAX_CONTEXT), Collect(), algorithm="ngram")
    with pytest.raises(ValueError, match="token ids"):
        runner.submit(_greedy([1, model.cfg.vocab_size]), Collect(), algorithm="ngram")
    with pytest.raises(ValueError, match="token ids"):
        runner.submit(_greedy([-1, 2]), Collect(), algorithm="ngram")


def test_a_failing_response_stream_ends_its_request_not_the_worker(runner, prompts, reference) -> None:
    """An emit that raises (the client went away mid-stream) must not kill the worker thread: the
    next request is still served (before the fix each later request waited for the stall timeout)."""

    def broken(ev: Event) -> None:
        raise ConnectionError("client went away")

    runner.submit(_greedy(prompts[0]), broken, algorithm="ngram")
    after = Collect()
    runner.submit(_greedy(prompts[1]), after, algorithm="ngram")
    assert after.done.wait(120), "the worker thread died with the first request's stream"
    assert after.tokens == reference[1] and after.final.error is None


def test_cancel_stops_within_a_step_and_frees_the_slot(runner, prompts, reference) -> None:
    """A request cancelled mid-decode ends after the step under way; its final event reports an
    empty KV cache (the slot freed before the event went out) and the next request runs."""
    cancel = threading.Event()
    at_cancel: list[int] = []

    def on_event(c: Collect) -> None:
        if len(c.tokens) >= 3 and not cancel.is_set():
            at_cancel.append(len(c.tokens))
            cancel.set()

    c = Collect(on_event)
    runner.submit(_greedy(prompts[0]), c, cancel.is_set, algorithm="ngram")
    assert c.done.wait(120)
    assert len(c.tokens) == at_cancel[0] < NEW  # nothing after the step that saw the cancel
    assert c.tokens == reference[0][: len(c.tokens)] and c.final.error is None
    assert c.final.cached_tokens == 0
    after = Collect()
    runner.submit(_greedy(prompts[1]), after, algorithm="ngram")
    assert after.done.wait(120) and after.tokens == reference[1] and after.final.cached_tokens == 0


def test_a_request_cancelled_while_it_waits_never_starts(runner, prompts, reference) -> None:
    running, cancel = Collect(), threading.Event()
    waiting = Collect()
    runner.submit(_greedy(prompts[0]), running, algorithm="ngram")
    runner.submit(_greedy(prompts[1]), waiting, cancel.is_set, algorithm="ngram")
    cancel.set()
    assert waiting.done.wait(120) and running.done.wait(120)
    assert waiting.tokens == [] and waiting.final.error is None and waiting.final.stats is None  # no prefill, no step
    assert running.tokens == reference[0]


SLOW = CostCurve(tokens=[1, 2, 4], ms=[1000.0, 2000.0, 4000.0])  # far slower than any real decode


def _slow_calibration() -> Calibration:
    """A measured calibration with the SLOW curve: every request's decodes contradict it."""
    return Calibration.build(SLOW, {"ngram": 0.0}, set(), machine=machine(), backend="torch", dtype="float32", threads=1,
                             measured_at="then")


def test_served_decodes_republish_a_calibration_that_was_off(checkpoint: Path, model: Llama, prompts: list[list[int]]) -> None:
    """A measured calibration 20x too slow: after one request the runner publishes the curve its
    decodes taught it (the gauge and the gate read what it publishes), keeping when it was measured."""
    published: list[Calibration] = []
    cfg = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=MAX_CONTEXT, max_batch_size=1)
    r = SpeculativeRunner(TorchTarget(model, MAX_CONTEXT, 1), {"ngram": NgramDrafter()}, cfg, on_calibration=published.append,
                          calibrated=False)
    try:
        r.calibration = _slow_calibration()
        r.generator.set_curve(SLOW)
        done = Collect()
        r.submit(_greedy(prompts[0]), done, algorithm="ngram")
        assert done.done.wait(300) and done.final.error is None
    finally:
        r.shutdown()
    assert published, "nothing republished after the decodes contradicted the calibration"
    learned = published[-1]
    assert learned.refined_at is not None and learned.measured_at == "then"
    assert learned.curve.cost(1) < 0.5 * SLOW.cost(1), learned.curve.table()


def test_a_curve_that_keeps_moving_is_republished_at_most_once_per_interval(
    checkpoint: Path, model: Llama, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A noisy machine's live curve moves past REPUBLISH_DRIFT from request to request; the runner
    republishes the first refinement at once and the next ones at most every REPUBLISH_MIN_INTERVAL_S."""
    published: list[Calibration] = []
    cfg = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=MAX_CONTEXT, max_batch_size=1)
    r = SpeculativeRunner(TorchTarget(model, MAX_CONTEXT, 1), {"ngram": NgramDrafter()}, cfg, on_calibration=published.append,
                          calibrated=False)
    r.generator.set_curve(SLOW)

    def request_against_a_curve_far_off(prompt: list[int]) -> None:
        # each request finds the published curve 20x off its decodes, as if the machine had moved
        r.calibration = _slow_calibration()
        done = Collect()
        r.submit(_greedy(prompt), done, algorithm="ngram")
        assert done.done.wait(300) and done.final.error is None

    try:
        request_against_a_curve_far_off(prompts[0])
        request_against_a_curve_far_off(prompts[1])
        assert len(published) == 1, "republished twice within the interval"
        monkeypatch.setattr(spec_runner, "REPUBLISH_MIN_INTERVAL_S", 0.0)  # the interval has passed
        request_against_a_curve_far_off(prompts[0])
        assert len(published) == 2
    finally:
        r.shutdown()


def test_a_failed_republish_sends_no_second_final(checkpoint: Path, model: Llama, prompts: list[list[int]]) -> None:
    """Issue 26: the calibration was republished after the request's final event; when saving it
    failed, the worker sent the request a second final, with an error (a client saw an error for a
    finished request, and the engine's active gauge went negative)."""

    def broken(cal: Calibration) -> None:
        raise OSError("no space left on device")

    cfg = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=MAX_CONTEXT, max_batch_size=1)
    r = SpeculativeRunner(TorchTarget(model, MAX_CONTEXT, 1), {"ngram": NgramDrafter()}, cfg, on_calibration=broken, calibrated=False)
    try:
        r.calibration = _slow_calibration()  # far off: the first request republishes
        r.generator.set_curve(SLOW)
        events: list[Event] = []
        r.submit(_greedy(prompts[0]), events.append, algorithm="ngram")
        after = Collect()  # FIFO: once this one ends, the first request's turn is over
        r.submit(_greedy(prompts[1]), after, algorithm="ngram")
        assert after.done.wait(300)
    finally:
        r.shutdown()
    finals = [e for e in events if e.finished]
    assert len(finals) == 1 and finals[0].error is None, [e.error for e in finals]


def test_a_recalibration_is_refused_when_the_queue_is_full(checkpoint: Path, model: Llama, prompts: list[list[int]]) -> None:
    """Issue 26: `recalibrate` queued past max_queue_size, so a flood of them held up every request."""
    from specgate.decoding.batch_runner import QueueFull

    cfg = EngineConfig(backend="torch", model=checkpoint, dtype="float32", max_context=MAX_CONTEXT, max_batch_size=1, max_queue_size=2)
    r = SpeculativeRunner(TorchTarget(model, MAX_CONTEXT, 1), {"ngram": NgramDrafter()}, cfg, calibrated=False)
    started, release = threading.Event(), threading.Event()
    try:
        running = Collect(on_event=lambda c: (started.set(), release.wait(300)))  # holds the worker at its first tokens
        r.submit(_greedy(prompts[0]), running, algorithm="ngram")
        assert started.wait(300)  # the worker took it: the queue is empty
        for _ in range(cfg.max_queue_size):  # the queue fills (they end unstarted: cancelled)
            r.submit(_greedy(prompts[1]), Collect(), lambda: True, algorithm="ngram")
        with pytest.raises(QueueFull):
            r.recalibrate(lambda result: None)
    finally:
        release.set()
        r.shutdown()


def test_a_stop_word_across_a_continuation_ends_the_continued_request(runner, prompts, reference) -> None:
    """Issue 49: as in the baseline engine (test_batching.py): the gate continues a request here when
    target_engine failed, from prompt + the output sent so far, and a stop word may span the two."""
    out, k = reference[0], 5
    req = GenerationRequest(input_ids=prompts[0] + out[:k], max_new_tokens=NEW - k, stop_words=[out[k - 1 : k + 1]], continued=k)
    got = Collect()
    runner.submit(req, got, algorithm="ngram")
    assert got.done.wait(300) and got.final.error is None
    assert got.tokens == [out[k]]
