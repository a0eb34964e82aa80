"""Policy file: validation, defaults, tenant keys, hot reload keeping the old policy on errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from specgate.gate.policy import Mode, Policy, PolicyStore, load_policy, parse_policy
from specgate.gate.tenants import hash_key, parse_key_file

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
    assert p.breaker.open_threshold == p.breaker.close_threshold == "auto"  # from spec_engine's calibration
    assert p.speculative.algorithm == "auto" and p.speculative.max_num_speculative_tokens is None
    assert p.load.max_in_flight == 1
    assert p.unknown_tenant == "org_default" and p.malformed_header == "reject"


def test_shipped_default_policy_is_valid() -> None:
    p = load_policy(REPO / "policy" / "default.yaml")
    assert p.temperature_threshold == 0.70 and p.breaker.open_threshold == "auto" and p.speculative.algorithm == "auto"


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
        ("speculative: {num_speculative_tokens: 9, max_num_speculative_tokens: 8}", "max_num_speculative_tokens"),
        ("breaker: {open_threshold: 0.1}", "both auto or both numbers"),
        ("breaker: {gain_prompt_classes: [512, 128]}", "gain_prompt_classes must be prompt lengths >= 1 in ascending order"),
        (f"tenants: {{'sha256:{'0' * 64}': {{mode: prod}}}}", "keyed by name"),  # the old format
        ("tenants: {'two words': {}}", "tenants"),
        ("mode: [unclosed", "YAML"),
    ],
)
def test_invalid_policies_are_rejected_with_a_reason(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_policy(text)


def test_key_file_maps_keys_to_tenant_names_by_hash() -> None:
    keys = parse_key_file(f"team-a: [{hash_key('k1')}, '{hash_key('k2').upper().replace('SHA256', 'sha256')}']\nteam-b: []\n")
    assert keys.names == {"team-a", "team-b"}
    assert keys.tenant_of("k1") == keys.tenant_of("k2") == "team-a"  # two keys while rotating
    assert keys.tenant_of("k3") is None
    assert parse_key_file("{}").names == frozenset()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "empty"),
        ("team-a: [the-raw-key-itself]", r"team-a\[0\].*sha256"),
        ("the-raw-key-itself: []\nx y: []", "a tenant name"),
        (f"org: [{hash_key('k')}]", "reserved"),
        (f"a: [{hash_key('k')}]\nb: [{hash_key('k')}]", r"b\[0\].*already listed under a"),
        ("team-a: the-raw-key-itself", "valid list"),
        ("team-a: [the-raw-key-itself", "not YAML"),
    ],
)
def test_invalid_key_files_are_rejected_without_echoing_values(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        parse_key_file(text)
    assert "the-raw-key-itself" not in str(err.value)


def test_every_configured_tenant_needs_a_key(tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text(f"team-a: [{hash_key('k1')}]\n")
    path = tmp_path / "policy.yaml"
    path.write_text("key_file: keys.yaml\ntenants: {team-a: {mode: prod}, team-b: {mode: prod}}\n")
    with pytest.raises(ValueError, match="no key in .*keys.yaml: team-b"):
        PolicyStore(path)
    path.write_text("tenants: {team-a: {mode: prod}}\n")
    with pytest.raises(ValueError, match="no key_file"):
        PolicyStore(path)


def test_key_file_edits_reload_and_a_bad_one_keeps_the_previous_keys(tmp_path: Path) -> None:
    clock, keys = Clock(), tmp_path / "keys.yaml"
    _write(keys, f"team-a: [{hash_key('k1')}]\n", 1)
    _write(tmp_path / "policy.yaml", "key_file: keys.yaml\n", 1)
    store = PolicyStore(tmp_path / "policy.yaml", now=clock)
    assert store.snapshot().keys.tenant_of("k2") is None

    _write(keys, f"team-a: [{hash_key('k1')}, {hash_key('k2')}]\n", 2)  # the policy is unchanged
    clock.t += 1.0
    assert store.snapshot().keys.tenant_of("k2") == "team-a"

    _write(keys, "team-a: [k3]\n", 3)
    clock.t += 1.0
    assert store.snapshot().keys.tenant_of("k2") == "team-a"


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
    p = parse_policy("mode: off\ntenants: {team: {mode: off}}")
    assert p.mode is Mode.OFF and next(iter(p.tenants.values())).mode is Mode.OFF
    with pytest.raises(ValueError, match="mode"):
        parse_policy("mode: on")
