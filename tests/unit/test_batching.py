"""In-flight batching in the baseline engine (BatchRunner) on the real model, fp32.

Batching must be invisible to a request: the same tokens as when it runs alone (greedy, and seeded
sampling), whoever joins or leaves the batch around it; and one request's cancellation, failure or
bad input must not touch the others. Kept small (short prompts, few tokens) to fit CI on 2 cores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from specgate.decoding.batch_runner import BatchRunner, QueueFull
from specgate.decoding.request import Event, GenerationRequest
from specgate.decoding.sampling import SamplingParams
from tests.prompts import GREEDY_PROMPTS
from tests.unit.torch_engine import chat_ids, model, run_all, tok, torch_runner  # noqa: F401 (fixtures)

NEW_TOKENS = 12
MAX_CONTEXT = 192
WAIT_S = 120


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # On 2 shared, busy cores, 2 intra-op threads spin against the other jobs (measured ~10x slower
    # per step than 1 thread); these tests check tokens, not speed.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    # questions with long answers, so no request ends at EOS before the tests expect it to
    return [chat_ids(tok, GREEDY_PROMPTS[i]) for i in (2, 5, 7, 10, 13)]


def greedy(prompt: list[int], n: int = NEW_TOKENS, end_id: int | None = 2) -> GenerationRequest:
    return GenerationRequest(input_ids=prompt, max_new_tokens=n, end_id=end_id)


def sampled(prompt: list[int], seed: int) -> GenerationRequest:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    return GenerationRequest(input_ids=prompt, max_new_tokens=NEW_TOKENS, sampling=params)


def make_runner(checkpoint, model, max_batch_size: int, **cfg) -> BatchRunner:
    return torch_runner(checkpoint, model, MAX_CONTEXT, max_batch_size, **cfg)


@pytest.fixture(scope="module")
def alone(checkpoint, model, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens with max_batch_size=1: every request runs by itself (FIFO)."""
    runner = make_runner(checkpoint, model, 1)
    try:
        return run_all(runner, [greedy(p) for p in prompts])
    finally:
        runner.shutdown()


class Tracker:
    """Collects each request's events; `wait_tokens` / `wait_done` block until they arrive."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.errors: dict[str, str | None] = {}
        self.finished_order: list[str] = []
        self.cached_at_end: dict[str, int | None] = {}  # each final event's cached_tokens
        self._cv = threading.Condition()

    def emit(self, name: str, fail_on_call: int | None = None):
        self.tokens[name] = []
        calls = 0

        def emit(ev: Event) -> None:
            nonlocal calls
            calls += 1
            if calls == fail_on_call:
                raise ConnectionError("client went away")
            with self._cv:
                self.tokens[name].extend(ev.tokens)
                if ev.finished:
                    assert name not in self.errors, f"{name} got a second final event"
                    self.errors[name] = ev.error
                    self.cached_at_end[name] = ev.cached_tokens
                    self.finished_order.append(name)
                self._cv.notify_all()

        return emit

    def wait_tokens(self, name: str, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.tokens[name]) >= n or name in self.errors, WAIT_S)

    def wait_done(self, *names: str) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: all(n in self.errors for n in names), WAIT_S), self.errors


def test_concurrent_greedy_matches_alone(checkpoint, model, prompts, alone):
    """All in one batch, leaving at different steps (different max_new_tokens)."""
    lengths = [NEW_TOKENS, 3, 7, NEW_TOKENS, 5]
    runner = make_runner(checkpoint, model, 8)
    try:
        outs = run_all(runner, [greedy(p, n) for p, n in zip(prompts, lengths)])
    finally:
        runner.shutdown()
    assert outs == [ref[:n] for ref, n in zip(alone, lengths)]


def test_join_leave_and_slot_reuse_match_alone(checkpoint, model, prompts, alone):
    """Two slots, five requests: later ones join while others decode and reuse freed slots."""
    t = Tracker()
    runner = make_runner(checkpoint, model, 2)
    try:
        runner.submit(greedy(prompts[0]), t.emit("a"))
        runner.submit(greedy(prompts[1], 4), t.emit("b"))
        t.wait_tokens("a", 3)  # a and b are mid-decode
        runner.submit(greedy(prompts[2], 6), t.emit("c"))  # takes b's slot
        t.wait_tokens("c", 2)
        runner.submit(greedy(prompts[3]), t.emit("d"))
        runner.submit(greedy(prompts[4]), t.emit("e"))
        t.wait_done("a", "b", "c", "d", "e")
    finally:
        runner.shutdown()
    assert t.errors == dict.fromkeys("abcde")
    expected = {"a": alone[0], "b": alone[1][:4], "c": alone[2][:6], "d": alone[3], "e": alone[4]}
    assert t.tokens == expected


def test_seeded_sampling_is_isolated_from_the_batch(checkpoint, model, prompts):
    single = make_runner(checkpoint, model, 1)
    batched = make_runner(checkpoint, model, 4)
    try:
        (by_itself,) = run_all(single, [sampled(prompts[0], seed=11)])
        outs = run_all(batched, [greedy(prompts[1]), sampled(prompts[0], seed=11), sampled(prompts[0], seed=12), greedy(prompts[2], 5)])
    finally:
        single.shutdown()
        batched.shutdown()
    assert outs[1] == by_itself
    assert outs[2] != by_itself  # the seed matters, so the match above is not vacuous


def test_cancel_one_member_mid_decode(checkpoint, model, prompts, alone):
    t = Tracker()
    cancel = threading.Event()
    runner = make_runner(checkpoint, model, 4)
    try:
        runner.submit(greedy(prompts[0]), t.emit("a"))
        runner.submit(greedy(prompts[1]), t.emit("b"), cancel.is_set)
        runner.submit(greedy(prompts[2]), t.emit("c"))
        t.wait_tokens("b", 3)
        cancel.set()
        n_at_cancel = len(t.tokens["b"])
        t.wait_done("b")
        assert len(t.tokens["b"]) <= n_at_cancel + 1  # at most the step already running
        assert "a" not in t.errors and "c" not in t.errors  # b ended first, promptly
        t.wait_done("a", "c")
    finally:
        runner.shutdown()
    assert t.errors == dict.fromkeys("bac")
    assert t.cached_at_end[t.finished_order[-1]] == 0  # every slot's cache released, b's included
    assert t.tokens["b"] == alone[1][: len(t.tokens["b"])]
    assert t.tokens["a"] == alone[0] and t.tokens["c"] == alone[2]


def test_cancel_while_waiting_ends_before_a_slot_frees(checkpoint, model, prompts):
    """Even behind another waiting request: cancellation does not wait for the queue to move."""
    t = Tracker()
    cancel = threading.Event()
    runner = make_runner(checkpoint, model, 1)
    try:
        runner.submit(greedy(prompts[0]), t.emit("running"))
        runner.submit(greedy(prompts[1], 2), t.emit("ahead"))
        runner.submit(greedy(prompts[2]), t.emit("cancelled"), cancel.is_set)
        t.wait_tokens("running", 1)
        cancel.set()
        t.wait_done("cancelled", "running", "ahead")
    finally:
        runner.shutdown()
    assert t.finished_order == ["cancelled", "running", "ahead"]
    assert t.tokens["cancelled"] == [] and t.errors["cancelled"] is None


class _StopWordsThatFail(list):
    """Stop words whose check raises after `ok` checks: an engine failure in one request, mid-decode."""

    def __init__(self, ok: int) -> None:
        super().__init__([[0]])
        self.ok = ok

    def __iter__(self):
        self.ok -= 1
        if self.ok < 0:
            raise RuntimeError("injected failure")
        return super().__iter__()


def test_bad_requests_fail_alone(checkpoint, model, prompts, alone):
    t = Tracker()
    runner = make_runner(checkpoint, model, 8)
    try:
        with pytest.raises(ValueError, match="context"):
            runner.submit(greedy([1] * MAX_CONTEXT), t.emit("too_long"))
        with pytest.raises(ValueError, match="token ids"):
            runner.submit(greedy([1, model.cfg.vocab_size]), t.emit("bad_id"))
        failing = greedy(prompts[3])
        failing.stop_words = _StopWordsThatFail(ok=4)  # assignment is not re-validated
        runner.submit(greedy(prompts[0]), t.emit("a"))
        runner.submit(greedy(prompts[1]), t.emit("stream_breaks", fail_on_call=3))
        runner.submit(failing, t.emit("engine_fails"))
        # decodes in the batch next to a nearly full slot, then ends at the context limit
        runner.submit(greedy(prompts[2][-1:] * (MAX_CONTEXT - 3), end_id=None), t.emit("fills_context"))
        runner.submit(greedy(prompts[2]), t.emit("c"))
        t.wait_done("a", "stream_breaks", "engine_fails", "fills_context", "c")
        assert runner.in_flight == 0  # every slot came back
    finally:
        runner.shutdown()
    assert t.errors["stream_breaks"] == "response stream failed"
    assert t.errors["engine_fails"] == "engine error: injected failure"
    assert t.tokens["engine_fails"] == alone[3][:4]
    assert t.errors["fills_context"] is None and len(t.tokens["fills_context"]) == 3
    assert t.errors["a"] is None and t.tokens["a"] == alone[0]
    assert t.errors["c"] is None and t.tokens["c"] == alone[2]


def test_queue_is_fifo_bounded_and_times_out(checkpoint, model, prompts, alone):
    t = Tracker()
    runner = make_runner(checkpoint, model, 1, max_queue_size=2)
    try:
        runner.submit(greedy(prompts[0]), t.emit("first"))
        t.wait_tokens("first", 1)  # admitted, so the queue is empty again
        runner.submit(greedy(prompts[1], 4), t.emit("second"))
        runner.submit(greedy(prompts[2], 4), t.emit("third"))
        with pytest.raises(QueueFull):
            runner.submit(greedy(prompts[3]), t.emit("refused"))
        t.wait_done("first", "second", "third")
    finally:
        runner.shutdown()
    assert t.finished_order == ["first", "second", "third"]
    assert [t.tokens[n] for n in ("first", "second", "third")] == [alone[0], alone[1][:4], alone[2][:4]]

    t = Tracker()
    runner = make_runner(checkpoint, model, 1, queue_timeout_s=0.3)
    try:
        runner.submit(greedy(prompts[0], 64, end_id=None), t.emit("slow"))  # holds the only slot > 0.3 s
        t.wait_tokens("slow", 1)
        runner.submit(greedy(prompts[1]), t.emit("late"))
        t.wait_done("late")
        assert "slow" not in t.errors
    finally:
        runner.shutdown()
    assert t.errors["late"] == "timed out after 0.3s in queue" and t.tokens["late"] == []


def test_shutdown_ends_every_request(checkpoint, model, prompts):
    t = Tracker()
    runner = make_runner(checkpoint, model, 1)
    runner.submit(greedy(prompts[0], 64, end_id=None), t.emit("running"))
    runner.submit(greedy(prompts[1]), t.emit("waiting"))
    t.wait_tokens("running", 1)
    runner.shutdown()
    t.wait_done("running", "waiting")
    assert t.errors == {"running": "engine shut down", "waiting": "engine shut down"}
    with pytest.raises(RuntimeError, match="shutting down"):
        runner.submit(greedy(prompts[0]), t.emit("after"))


def test_a_stop_word_across_a_continuation_ends_the_continued_request(checkpoint, model, prompts, alone):
    """Issue 49: the gate continues a request on the other engine from prompt + the output sent so far
    (a hand-over under load, a failed engine). A stop word whose first token went out before the
    continuation and whose last comes after it must end the continued request at once; it used to run
    on, since the engine matched only its own new tokens."""
    out, k = alone[0], 5
    stop = out[k - 1 : k + 1]
    req = GenerationRequest(input_ids=prompts[0] + out[:k], max_new_tokens=NEW_TOKENS - k, end_id=2, stop_words=[stop], continued=k)
    runner = make_runner(checkpoint, model, 1)
    try:
        (got,) = run_all(runner, [req])
    finally:
        runner.shutdown()
    assert got == [out[k]]
