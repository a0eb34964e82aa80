"""Server secrets and the tenant labels keyed by them: created once 0600, stable, refused when exposed."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from specgate.gate.labels import LABEL_KEY_ENV, TenantLabels, label_secret_from_env
from specgate.secret_file import ensure_secret, read_secret


def test_secret_is_created_once_owner_only(tmp_path: Path) -> None:
    path = ensure_secret(tmp_path / "secrets" / "label.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    first = read_secret(path)
    assert len(first) >= 32
    ensure_secret(path)  # a second start keeps it, so labels survive restarts
    assert read_secret(path) == first


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "label.key"
    path.write_text("s3cret\n")
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        read_secret(path)


def test_labels_come_from_the_secret_file_named_in_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_secret(tmp_path / "label.key")
    monkeypatch.setenv(LABEL_KEY_ENV, str(path))
    assert label_secret_from_env() == read_secret(path).encode()
    a, b = TenantLabels(label_secret_from_env()), TenantLabels(read_secret(path).encode())
    assert a("team") == b("team") and len(a("team")) == 8 and a("team") != a("other")


def test_without_a_secret_file_labels_are_random_per_process(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(LABEL_KEY_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        assert label_secret_from_env() != label_secret_from_env()
    assert LABEL_KEY_ENV in caplog.text
