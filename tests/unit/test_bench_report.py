"""bench.report's checks: the c=8 batching bar comes from the curve read before the first cell."""

import pytest

import bench.report as report
from bench.report import Cell, checks
from loadtest.measure import Sample
from specgate.cost_model.goodput import CostCurve


def _cell(scenario: str, c: int, tokens: int, wall_s: float = 10.0) -> Cell:
    sample = Sample(category="chat", temperature=0.0, e2e_s=1.0, ttft_s=0.1, tpot_s=0.012, tokens=tokens, route="baseline")
    return Cell(scenario=scenario, concurrency=c, wall_s=wall_s, samples=[sample], gate={})


def _cells(c8_over_c1: float) -> list[Cell]:
    return [_cell(sc, c, round(100 * (c8_over_c1 if c == 8 else 1.0))) for c in (1, 8) for sc in report.SERIES]


def _bar_line(lines: list[str]) -> str:
    (line,) = [s for s in lines if s.startswith("**The baseline through Triton")]
    return line


def test_the_bar_reads_the_curve_it_is_given_not_the_engine_file(monkeypatch) -> None:  # noqa: ANN001
    startup = CostCurve(tokens=[1, 8], ms=[10.0, 58.1])  # 8 / 5.81 x 0.9 = 1.24x asked
    refined = CostCurve(tokens=[1, 8], ms=[12.0, 58.1])  # a served cost(1): 1.49x asked
    monkeypatch.setattr(report, "calibrated_curve", lambda _published: refined)  # what the file says by then
    cells = _cells(1.07)
    line = _bar_line(checks(cells, [1, 8], cells, startup))
    assert "target >= 0.9 x that = 1.24x: NOT met" in line
    assert "1.07x" in line


def test_no_curve_no_target() -> None:
    cells = _cells(1.07)
    assert "no calibration: no target" in _bar_line(checks(cells, [1, 8], cells, None))


def test_counting_the_prompts_lowers_the_bound_towards_one() -> None:
    """Without prompts it is the curve's 8 cost(1) / cost(8); prompts are read once per request at
    any concurrency, so the longer they take against the decodes, the less batching can buy."""
    from bench.common import batching_bound_with_prompts

    curve = CostCurve(tokens=[1, 8], ms=[10.0, 40.0])  # 2x from batching 8 decodes
    assert batching_bound_with_prompts(0.0, 10.0, 49, curve) == pytest.approx(2.0)
    # 48 decodes of 10 ms after a 240 ms prompt: 8 x 720 ms at c=1, 8 x 240 + 48 x 40 at c=8
    assert batching_bound_with_prompts(240.0, 10.0, 49, curve) == pytest.approx(8 * 720 / (8 * 240 + 48 * 40))
    assert 1.0 < batching_bound_with_prompts(1e6, 10.0, 49, curve) < 1.001


def test_the_report_states_the_bound_with_its_prompts() -> None:
    cells = _cells(1.07)
    lines = checks(cells, [1, 8], cells, CostCurve(tokens=[1, 8], ms=[10.0, 58.1]))
    (line,) = [s for s in lines if "Counting the prompts" in s]
    assert "TTFT 100 ms" in line and "the curve allows" in line


def test_bench_engines_results_plot_by_route(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """The report plots bench-engine's rows as bench.engine writes them (keyed by route)."""
    from bench.engine import NO_DRAFTS, Run, summarize

    base, spec = Run([1, 2], 10.0), Run([1, 2], 8.0, steps=1)
    rows = summarize({"baseline": [(base, base)], NO_DRAFTS: [(base, Run([1, 2], 10.5, steps=2))], "ngram": [(base, spec)]})
    monkeypatch.setattr(report, "OUT", tmp_path)
    png = report.plot_engine({"results": {"0.0": {"code": rows, "overall": rows}}})
    assert png is not None and (tmp_path / png).stat().st_size > 0
