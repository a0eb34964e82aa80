"""bench.report's checks: the c=8 batching bar comes from the curve read before the first cell."""

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
