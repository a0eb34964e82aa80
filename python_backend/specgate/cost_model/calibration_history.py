"""Earlier starts' measurements on this machine, pooled into what a start publishes.

One start measures for about 10 s on a machine whose speed moves by ±15% between neighbouring runs.
Seven starts of the server in one day on a 2-core Zen 3 EPYC (AVX2) published cost(2)/cost(1) from
1.43 to 1.89, cost(8)/cost(1) from 3.22 to 4.18, and EAGLE's drafting from 1.31 to 2.26 ms a node;
n-gram's break-even acceptance moved from 0.43 to 0.62 across its prior of 0.50, so the start decided
whether the gate sent a new tenant to speculation at all (docs/engines.md, "Calibration").

So each start keeps its own measurement in a short history beside the calibration and publishes the
median over the last `HISTORY` of them: each cost(T)/cost(1) and each drafter's time over cost(1),
taken at this start's one-token time and floor (the machine's speed drifts; the curve's shape and the
drafters' share of a decode far less). A history holds measurements of one engine only: the machine,
the model and draft files, the engine library's build and the settings that shape the curve make up
its key, and a start whose key differs starts the history again. An operator who asks the engine to
measure again (a recalibration) gets that measurement alone, and later starts pool from it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import statistics
from pathlib import Path

from pydantic import BaseModel, ValidationError

from specgate.cost_model.calibration import Calibration
from specgate.decoding.config import EngineConfig

log = logging.getLogger(__name__)

HISTORY = 5  # starts pooled: two starts in a row then share four of their five measurements


class _History(BaseModel):
    key: str
    measured: list[Calibration]  # oldest first, each one start's own (never pooled) measurement


def _stamp(path: Path | None) -> list[object]:
    """What identifies a file, or each file of a folder, without reading it: name, size, mtime."""
    if path is None or not path.exists():
        return [None]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p), (s := p.stat()).st_size, s.st_mtime_ns] for p in files]


def _library(backend: str) -> list[object]:
    """The engine library's build: llama_cpp's installed libraries (`make setup` rebuilds them when
    the kernel patch changes), or PyTorch's version."""
    if backend == "llamacpp":
        spec = importlib.util.find_spec("llama_cpp")
        return _stamp(None if spec is None or spec.origin is None else Path(spec.origin).parent / "lib")
    import torch

    return [torch.__version__]


def history_key(cfg: EngineConfig, cal: Calibration) -> str:
    """Measurements pool only under the same key: same machine, engine build, files and settings."""
    parts = {
        "machine": cal.machine.model_dump(),
        "engine": [cal.backend, cal.dtype, cal.threads, _library(cal.backend)],
        "settings": cfg.model_dump(mode="json", include={"max_context", "exact", "eagle_head_dtype"}),
        "files": [_stamp(cfg.model), _stamp(cfg.draft_model), _stamp(cfg.eagle_head_dir)],
        "sizes": cal.curve.tokens,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def pooled(measured: list[Calibration]) -> Calibration:
    """The last of `measured` (this start's), its curve's shape and its drafting times replaced by the
    medians over all of them, relative to cost(1) and at the last one's cost(1)."""
    latest = measured[-1]
    base = latest.curve.ms[0]
    ratios = [statistics.median(c.curve.ms[i] / c.curve.ms[0] for c in measured) for i in range(len(latest.curve.tokens))]
    draft_ms = {
        name: base * statistics.median(
            c.algorithms[name].draft_ms / c.curve.ms[0] for c in measured if name in c.algorithms and not c.algorithms[name].pinned
        )
        for name, a in latest.algorithms.items() if not a.pinned
    }
    return latest.rebuilt(latest.curve.model_copy(update={"ms": [base * r for r in ratios]}), draft_ms, starts=len(measured))


class CalibrationHistory:
    """The history file beside `calibration_path` (calibration-history.json in the same folder)."""

    def __init__(self, calibration_path: Path, key: str) -> None:
        self.path, self.key = calibration_path.with_name("calibration-history.json"), key

    def _load(self) -> list[Calibration]:
        try:
            history = _History.model_validate_json(self.path.read_text())
        except FileNotFoundError:
            return []
        except (ValidationError, ValueError, OSError) as exc:  # unreadable: start again rather than fail a start
            log.warning("calibration history %s unreadable (%s): starting it again", self.path, exc)
            return []
        if history.key != self.key:
            log.info("calibration history %s is another engine's or machine's: starting it again", self.path)
            return []
        return history.measured

    def _save(self, measured: list[Calibration]) -> None:
        """Write the history; a folder it cannot write costs the next start its pooling, not this
        start its calibration."""
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(_History(key=self.key, measured=measured).model_dump_json(indent=2))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep the calibration history in %s (%s): the next start measures alone", self.path, exc)

    def add(self, measurement: Calibration) -> Calibration:
        """A start's own measurement joins the history; returns what to publish (pooled)."""
        measured = [*self._load(), measurement][-HISTORY:]
        self._save(measured)
        return pooled(measured)

    def restart(self, measurement: Calibration) -> Calibration:
        """An asked-for measurement: the history starts again from it, and it is published as it is."""
        self._save([measurement])
        return measurement
