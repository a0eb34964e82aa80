"""The launcher's restricted control APIs: the exact Triton 2.51 flags, and what it refuses to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

import specgate_launcher as launcher
from specgate.secret_file import ensure_secret, read_secret


def test_control_apis_go_behind_the_admin_header_over_http_and_grpc() -> None:
    spec = "model-repository,shared-memory,logging,trace:specgate-admin-key=k3y_-0"
    assert launcher.restricted_api_args("specgate-admin-key", "k3y_-0") == [
        f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}",
    ]
    assert "inference" not in launcher.RESTRICTED_APIS and "health" not in launcher.RESTRICTED_APIS


@pytest.mark.parametrize(
    "header, key",
    [
        ("x-admin-key", "k"),  # matches the forward pattern: it would reach the models as a parameter
        ("Admin-Key", "k"),  # gRPC metadata keys are lowercase
        ("admin key", "k"),
        ("admin-key", "a:b"),  # Triton splits the flag at ':', ',' and '='
        ("admin-key", "a=b"),
        ("admin-key", ""),
    ],
)
def test_unusable_headers_and_keys_are_refused(header: str, key: str) -> None:
    with pytest.raises(ValueError):
        launcher.restricted_api_args(header, key)


def test_the_server_command_carries_the_admin_key_from_its_secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "ADMIN_SECRET", ensure_secret(tmp_path / "admin.key"))
    key = read_secret(tmp_path / "admin.key")
    cmd = launcher.command(Path("/repo"), launcher.Ports(), Path("/backends"), admin_header="ops-key")
    assert f"--http-restricted-api=model-repository,shared-memory,logging,trace:ops-key={key}" in cmd
    assert launcher.admin_headers("ops-key") == {"ops-key": key}
    assert launcher.admin_headers("ops-key", grpc=True) == {"triton-grpc-protocol-ops-key": key}
