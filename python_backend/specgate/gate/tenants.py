"""Tenant identity: a key file maps each tenant's name to the SHA-256 hashes of its API keys.

The file holds hashes, never keys, so it can be read, copied and reviewed like any config file:

    team-a:
      - sha256:<64 hex>        # one entry per key; two while a key is being rotated
    team-b:
      - sha256:<64 hex>

Tenant names are what the policy's `tenants:` settings, breakers and metric labels use, so rotating
a key changes none of them. Keys should be random (the `new` command below makes them): an unkeyed
hash is as strong as the key it hashes. Errors name a tenant and an entry's position, never a value,
in case someone pastes a key where a hash belongs.

    python -m specgate.gate.tenants new team-a    # a fresh key, and the entry to add for it
    python -m specgate.gate.tenants hash < key    # the entry of an existing key (read from stdin)
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import RootModel, StringConstraints, ValidationError, field_validator
from pydantic_core import ErrorDetails

ORG = "org"  # the tenant of every request without a known key; no key-file tenant may take it

TenantName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
KeyHash = Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-fA-F]{64}$")]


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def hash_key(api_key: str) -> str:
    """The key file's entry for `api_key`."""
    return f"sha256:{key_digest(api_key)}"


class KeyFile(RootModel[dict[TenantName, list[KeyHash]]]):
    @field_validator("root")
    @classmethod
    def _names_and_hashes(cls, tenants: dict[str, list[str]]) -> dict[str, list[str]]:
        if ORG in tenants:
            raise ValueError(f"tenant name {ORG!r} is reserved for requests without a known key")
        owner: dict[str, str] = {}
        for name, hashes in tenants.items():
            for i, h in enumerate(hashes):
                digest = h.removeprefix("sha256:").lower()
                if digest in owner:
                    raise ValueError(f"{name}[{i}]: the same key hash is already listed under {owner[digest]}")
                owner[digest] = name
        return tenants


class TenantKeys:
    """API key -> tenant name; empty without a key file (then every key is unknown)."""

    def __init__(self, key_file: KeyFile | None = None) -> None:
        tenants = key_file.root if key_file is not None else {}
        self.names: frozenset[str] = frozenset(tenants)
        self._by_digest = {h.removeprefix("sha256:").lower(): name for name, hashes in tenants.items() for h in hashes}

    def tenant_of(self, api_key: str) -> str | None:
        return self._by_digest.get(key_digest(api_key))


def parse_key_file(text: str, source: str = "<key file>") -> TenantKeys:
    """Validate key-file text (YAML). Raises ValueError naming the problem but never a value."""
    if not text.strip():
        raise ValueError(f"{source}: key file is empty (write `{{}}` for no tenants)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        # yaml's message quotes the offending line, which may hold a pasted key
        raise ValueError(f"{source}: not YAML") from None
    try:
        return TenantKeys(KeyFile.model_validate(data))
    except ValidationError as e:
        raise ValueError(f"{source}: {'; '.join(_describe(err) for err in e.errors(include_input=False))}") from None


def _describe(err: ErrorDetails) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    match err["loc"]:
        case (str(name), int(i)):
            return f"{name}[{i}]: {msg}"
        case (str(name),):
            return f"{name}: {msg}"
        case (_, "[key]"):
            return f"a tenant name: {msg}"  # not quoted: it may be a key pasted in the wrong place
        case _:
            return msg


def load_key_file(path: Path) -> TenantKeys:
    return parse_key_file(path.read_text(encoding="utf-8"), str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description="Make API keys and their key-file entries.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("new", help="a fresh random key for a tenant, and its key-file entry").add_argument("tenant")
    sub.add_parser("hash", help="the key-file entry of a key read from stdin")
    a = ap.parse_args()
    if a.command == "new":
        key = secrets.token_urlsafe(32)
        print(f"key for {a.tenant} (give it to the tenant; it is stored nowhere):\n  {key}")
        print(f"key-file entry:\n{a.tenant}:\n  - {hash_key(key)}")
    else:
        print(hash_key(sys.stdin.read().strip()))


if __name__ == "__main__":
    main()
