"""bench.batching's step accounting: what its c=8 lines say about the batched runner's steps."""

from bench.batching import StepLog, step_summary


class _Target:
    def forward(self, items):  # noqa: ANN001, ANN202
        return [len(t) for _, t in items]


def test_step_log_records_each_forward_and_passes_its_result_through() -> None:
    target = _Target()
    log = StepLog(target)
    assert target.forward([(0, [5, 6, 7]), (1, [8])]) == [3, 1]
    assert target.forward([(1, [9])]) == [1]
    steps = log.take()
    assert [(n, t) for n, t, _ in steps] == [(2, 4), (1, 1)]
    assert all(ms >= 0 for _, _, ms in steps)
    assert log.take() == []


def test_step_summary_splits_prompt_steps_from_decode_steps() -> None:
    c1 = [{"steps": [(1, 30, 100.0), (1, 1, 10.0), (1, 1, 12.0)]}, {"steps": [(1, 1, 11.0)]}]
    # c=8: a prompt step (2 sequences, 40 tokens), decode steps of 8, and a tail step of 3
    c8 = [{"steps": [(2, 40, 200.0), (8, 8, 50.0), (8, 8, 60.0), (3, 3, 40.0)]}, {"steps": [(8, 8, 55.0), (8, 10, 95.0)]}]
    s = step_summary(c1, c8)
    assert s is not None
    assert s["step1_ms"] == 11.0
    assert s["step8_ms"] == 55.0
    assert s["prompt_share_c8"] == (200.0 + 95.0) / (200.0 + 50.0 + 60.0 + 40.0 + 55.0 + 95.0)


def test_step_summary_needs_both_sizes() -> None:
    assert step_summary([{"steps": [(1, 1, 10.0)]}], [{"steps": [(4, 4, 30.0)]}]) is None
