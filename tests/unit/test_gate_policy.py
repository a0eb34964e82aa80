"""Policy file: validation, defaults, tenant keys, hot reload keeping the old policy on errors."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from specgate.gate.policy import Mode, Policy, PolicyStore, load_policy, parse_policy

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _write(path: Path, text: str, mtime: float) -> None:
    path.write_text(text)
    os.utime(path, (mtime, mtime))  # explicit mtimes: no reliance on filesystem granularity


def test_defaults() -> None:
    p = Policy()
    assert p.mode is Mode.OFF
    assert p.temperature_threshold == 0.70
    assert p.breaker.open_threshold == 0.08
    assert p.load.max_in_flight == 1
    assert p.unknown_tenant == "org_default" and p.malformed_header == "reject"


def test_shipped_default_policy_is_valid() -> None:
    p = load_policy(REPO / "policy" / "default.yaml")
    assert p.temperature_threshold == 0.70 and p.breaker.open_threshold == 0.08


def test_json_is_accepted() -> None:
    assert parse_policy('{"mode": "shadow", "canary_percent": 25}').canary_percent == 25


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "empty"),
        ("- a list", "mapping"),
        ("mode: maybe", "mode"),
        ("canary_percent: 101", "canary_percent"),
        ("temperture_threshold: 0.5", "temperture_threshold"),  # typo: extra keys are rejected
        ("breaker: {probe_fraction: 0.9}", "probe_fraction"),
        ("breaker: {open_threshold: 0.7, close_threshold: 0.6}", "close_threshold"),
        ("speculative: {num_speculative_tokens: 9}", "max_num_speculative_tokens"),
        ("tenants: {'sha256:abc': {mode: prod}}", "64 hex"),
        ("mode: [unclosed", "YAML"),
    ],
)
def test_invalid_policies_are_rejected_with_a_reason(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_policy(text)


def test_tenant_keys_raw_or_hashed_map_to_one_digest() -> None:
    digest = hashlib.sha256(b"k1").hexdigest()
    raw = parse_policy("tenants: {k1: {mode: prod}}")
    hashed = parse_policy(f"tenants: {{'sha256:{digest.upper()}': {{mode: prod}}}}")
    assert list(raw.tenants) == list(hashed.tenants) == [digest]
    with pytest.raises(ValueError, match="twice"):
        parse_policy(f"tenants: {{k1: {{}}, 'sha256:{digest}': {{}}}}")


def test_hot_reload_and_invalid_file_keeps_previous(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "policy.yaml", Clock()
    _write(path, "mode: shadow\n", 1)
    store = PolicyStore(path, check_interval_s=1.0, now=clock)
    assert store.current().mode is Mode.SHADOW

    _write(path, "mode: prod\n", 2)
    assert store.current().mode is Mode.SHADOW  # not re-checked within the interval
    clock.t += 1.0
    assert store.current().mode is Mode.PROD

    with caplog.at_level(logging.ERROR):
        _write(path, "mode: prod\ncanary_percent: 500\n", 3)
        clock.t += 1.0
        assert store.current().mode is Mode.PROD and store.current().canary_percent == 100
    assert "rejected" in caplog.text and "canary_percent" in caplog.text

    path.unlink()
    clock.t += 1.0
    assert store.current().mode is Mode.PROD  # a missing file keeps the policy too

    _write(path, "mode: off\n", 4)
    clock.t += 1.0
    assert store.current().mode is Mode.OFF


def test_initial_load_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PolicyStore(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("mode: maybe\n")
    with pytest.raises(ValueError):
        PolicyStore(tmp_path / "bad.yaml")


def test_no_path_means_builtin_defaults() -> None:
    assert PolicyStore(None).current() == Policy()


def test_unquoted_yaml_off_means_mode_off() -> None:
    p = parse_policy("mode: off\ntenants: {k: {mode: off}}")
    assert p.mode is Mode.OFF and next(iter(p.tenants.values())).mode is Mode.OFF
    with pytest.raises(ValueError, match="mode"):
        parse_policy("mode: on")
