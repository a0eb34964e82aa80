"""The distill cache reader counts malformed lines, reports them and refuses a damaged cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from build.eagle_data import MAX_MALFORMED_FRACTION, MalformedCache, distill_samples


def _good(i: int) -> str:
    return json.dumps({"idx": i, "prompt_len": 3, "ids": [1, 2, 3, 4, 5]})


def _write(path: Path, lines: list[str], cut_tail: str | None = None) -> Path:
    path.write_text("".join(line + "\n" for line in lines) + (cut_tail or ""))
    return path


def test_a_cut_last_line_is_skipped_without_counting(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path / "d.jsonl", [_good(i) for i in range(5)], cut_tail='{"idx": 5, "prompt_')
    samples = distill_samples(path)
    assert [s.idx for s in samples] == list(range(5)) and samples[0].start == 2
    assert "last line cut" in capsys.readouterr().err


def test_malformed_lines_are_counted_and_reported(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    n = int(1 / MAX_MALFORMED_FRACTION) * 2  # two bad lines are within the threshold
    lines = [_good(i) for i in range(n)]
    lines[3] = "not json"
    lines[7] = json.dumps({"idx": 7, "prompt_len": 9, "ids": [1]})  # valid JSON, impossible record
    assert len(distill_samples(_write(tmp_path / "d.jsonl", lines))) == n - 2
    err = capsys.readouterr().err
    assert f"2 of {n} lines malformed" in err and "line 4" in err and "line 8" in err


def test_too_many_malformed_lines_fail(tmp_path: Path) -> None:
    lines = [_good(i) for i in range(20)]
    lines[5] = lines[11] = '{"idx": "x"}'
    with pytest.raises(MalformedCache, match=r"2 of 20 lines malformed.*line 6"):
        distill_samples(_write(tmp_path / "d.jsonl", lines))
