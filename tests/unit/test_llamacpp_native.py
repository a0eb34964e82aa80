"""Which loaded copy of a llama.cpp library the engines call into (llamacpp_native.loaded): a native
build's libggml-cpu.so.N, or the CPU variant that a portable build's ggml chose at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgate.decoding.llamacpp_native import loaded

LIB = Path("/venv/site-packages/llama_cpp/lib")


def _maps(tmp_path: Path, *files: Path) -> Path:
    """/proc/self/maps as the kernel writes it: address, perms, offset, device, inode, path."""
    maps = tmp_path / "maps"
    maps.write_text("".join(f"7f00{i:04x}000-7f00{i:04x}fff r-xp 00000000 fd:00 {1000 + i}                     {f}\n"
                            for i, f in enumerate(files)))
    return maps


def test_a_portable_builds_cpu_backend_is_the_variant_ggml_loaded(tmp_path: Path) -> None:
    maps = _maps(tmp_path, Path("/usr/lib/libc.so.6"), LIB / "libggml-base.so.0", LIB / "libggml.so.0", LIB / "libggml-cpu-zen4.so",
                 LIB / "libllama.so.0")
    assert loaded(LIB, "libggml-cpu*", maps) == LIB / "libggml-cpu-zen4.so"
    assert loaded(LIB, "libggml", maps) == LIB / "libggml.so.0"  # neither libggml-base nor the CPU variant
    assert loaded(LIB, "libggml-base", maps) == LIB / "libggml-base.so.0"


def test_a_native_builds_cpu_backend_and_only_the_package_own_copy(tmp_path: Path) -> None:
    maps = _maps(tmp_path, Path("/elsewhere/lib/libggml-cpu.so.0"), LIB / "libggml-cpu.so.0")
    assert loaded(LIB, "libggml-cpu*", maps) == LIB / "libggml-cpu.so.0"
    with pytest.raises(RuntimeError, match="libllama from .* is not loaded"):
        loaded(LIB, "libllama", maps)
