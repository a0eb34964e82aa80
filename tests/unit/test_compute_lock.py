"""decoding/compute_lock: the engines' turn per decode must never stall them (issue 49). It was an
flock on a fixed /tmp file, opened without an owner check and taken with a blocking flock: another
local user who held it hung every engine for good, while their pings still answered."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path

import pytest

import specgate_launcher as launcher
from specgate.decoding import compute_lock
from specgate.decoding.compute_lock import ComputeLock


def test_the_launcher_puts_it_in_the_checkout_not_in_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compute_lock.ENV, raising=False)
    path = Path(launcher.server_env()[compute_lock.ENV])
    assert path.is_relative_to(launcher.ROOT / "artifacts"), path


def test_a_lock_file_another_user_owns_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run" / "compute.lock"
    ComputeLock(path)  # ours: fine; its directory is this user's alone
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)  # as another user sees the same file
    with pytest.raises(PermissionError, match="belongs to uid"):
        ComputeLock(path)


def test_a_turn_held_past_the_stall_limit_is_decoded_beside_then_taken_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "compute.lock"
    lock = ComputeLock(path)
    lock.stall_s = 0.5
    other = os.open(path, os.O_RDWR)  # another process's hold (flock: per open file)
    fcntl.flock(other, fcntl.LOCK_EX)
    entered = threading.Event()

    def decode() -> None:
        with lock:
            entered.set()

    t0 = time.monotonic()
    with caplog.at_level(logging.ERROR):
        threading.Thread(target=decode, daemon=True).start()
        assert entered.wait(10), "a decode waited for good on a turn someone else holds"
    assert 0.4 < time.monotonic() - t0 < 5
    assert f"held by pid {os.getpid()}" in caplog.text
    t1 = time.monotonic()
    with lock:  # still held: no second wait of stall_s
        pass
    assert time.monotonic() - t1 < 0.3
    fcntl.flock(other, fcntl.LOCK_UN)
    time.sleep(0.2)
    with lock:  # the stalled wait got the turn: taking turns again
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and released after the decode
    os.close(other)
