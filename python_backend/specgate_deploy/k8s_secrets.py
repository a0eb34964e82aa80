"""`python -m specgate_deploy.k8s_secrets DIR`: the files the Kubernetes Secret is generated from.

Writes a random admin.key and label.key (specgate.secret_file, mode 0600) and an empty tenants.yaml,
each only where none exists, so running it again changes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specgate.secret_file import ensure_secret

EMPTY_KEY_FILE = "# tenant name -> sha256 hashes of its API keys (docs/gate.md); `python -m specgate.gate.tenants new NAME`\n{}\n"


def make_secrets(folder: Path) -> list[Path]:
    made = []
    for name in ("admin.key", "label.key"):
        path = folder / name
        if not path.exists():
            made.append(ensure_secret(path))
    keys = folder / "tenants.yaml"
    if not keys.exists():
        keys.write_text(EMPTY_KEY_FILE)
        made.append(keys)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, nargs="?", default=Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "secrets")
    folder = ap.parse_args().folder
    made = make_secrets(folder)
    print(f"{folder}: made {', '.join(p.name for p in made) or 'nothing (all there)'}")


if __name__ == "__main__":
    main()
