"""The files an image build sends to the builder: the folder minus what `.dockerignore` excludes.

Docker's and podman's rules (moby's patternmatcher, which buildah's copy of it follows): one pattern
a line, `#` comments, paths relative to the context's root (a leading `/` is dropped), `*` and `?`
within one path component, `**` across any number of them, and a line starting with `!` taking
files back. A file is excluded when the last pattern that matches it, or one of its folders, is not
a `!` one. `make image-test` checks this listing against the real builder's (build/image_test.py);
tests/unit/test_deploy_image.py checks that no secret is in it. Standard library only: `make image`
runs before any virtual environment exists.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*" and pattern[i + 1 : i + 2] == "*":  # `**`, with the separator after it if any
            i += 1
            if pattern[i + 1 : i + 2] == "/":
                i += 1
            out += ".*" if i + 1 == len(pattern) else "(.*/)?"
        elif ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[":  # a character class, as written
            end = pattern.find("]", i + 1)
            out += pattern[i : end + 1] if end > i else re.escape(ch)
            i = end if end > i else i
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(f"^{out}$")


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.rules: list[tuple[re.Pattern[str], bool]] = []  # (pattern, takes files back)
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            back = line.startswith("!")
            path = os.path.normpath(line[1:].strip() if back else line).lstrip("/")
            self.rules.append((_regex(path), back))

    def excluded(self, path: str) -> bool:
        """`path` (relative, `/`-separated) is left out of the context."""
        candidates = [path, *(str(p) for p in PurePosixPath(path).parents if str(p) != ".")]
        verdict = False
        for pattern, back in self.rules:
            if any(pattern.match(c) for c in candidates):
                verdict = not back
        return verdict

    def prunes(self, folder: str) -> bool:
        """Nothing under `folder` can be taken back: the listing need not look inside."""
        return self.excluded(folder) and not any(back for _, back in self.rules)


def context_files(root: Path) -> set[str]:
    """Every file and symlink the builder receives from `root`, as relative `/`-separated paths."""
    ignore_file = root / ".dockerignore"
    ignore = DockerIgnore(ignore_file.read_text() if ignore_file.exists() else "")
    files = set()
    for folder, dirs, names in os.walk(root):
        rel = Path(folder).relative_to(root).as_posix()
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not ignore.prunes(rel + d) or os.path.islink(os.path.join(folder, d))]
        links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]  # sent as links, never followed
        dirs[:] = [d for d in dirs if d not in links]
        files.update(rel + n for n in [*names, *links] if not ignore.excluded(rel + n))
    return files
