"""build/install_llamacpp.py, the parts that run before any compiler: unpacking the sdist on Pythons
without tarfile's filters (Debian 12's 3.11.2), and the choice between the native and the portable build."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from build import install_llamacpp


def _sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def python_3_11_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile as Python 3.11.2 has it: no data_filter, and extractall takes no `filter`."""
    monkeypatch.delattr(tarfile, "data_filter")
    extractall = tarfile.TarFile.extractall

    def old_extractall(self, path=".", members=None, *, numeric_owner=False):  # noqa: ANN001, ANN202
        return extractall(self, path, members, numeric_owner=numeric_owner)

    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)


def test_the_sdist_unpacks_on_python_3_11_2(tmp_path: Path, python_3_11_2: None) -> None:
    sdist = _sdist(tmp_path / "pkg-1.0.tar.gz", {"pkg-1.0/vendor/llama.cpp/CMakeLists.txt": b"project(x)\n"})
    with tarfile.open(sdist) as tar:
        install_llamacpp.extract(tar, tmp_path / "out")
    assert (tmp_path / "out" / "pkg-1.0" / "vendor" / "llama.cpp" / "CMakeLists.txt").read_bytes() == b"project(x)\n"


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/outside.txt"])
def test_without_the_filter_a_member_outside_the_folder_is_refused(tmp_path: Path, python_3_11_2: None, name: str) -> None:
    sdist = _sdist(tmp_path / "evil.tar.gz", {"ok.txt": b"", name: b"x"})
    with tarfile.open(sdist) as tar, pytest.raises(SystemExit, match="refusing to unpack"):
        install_llamacpp.extract(tar, tmp_path / "out")
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "out" / "ok.txt").exists()  # nothing unpacked


def test_the_portable_build_dispatches_at_runtime_and_keeps_the_thread_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    avx2 = {"avx", "avx2", "fma", "f16c", "bmi2"}
    assert "-DGGML_AVX2=ON" in install_llamacpp.cmake_args(avx2) and "-DGGML_AVX512=OFF" in install_llamacpp.cmake_args(avx2)
    monkeypatch.setenv("LLAMA_CPP_BUILD", "portable")
    args = install_llamacpp.cmake_args(avx2).split()
    assert {"-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"} <= set(args)
    assert not [a for a in args if a.startswith("-DGGML_AVX")]  # no instruction set of the build machine
    monkeypatch.setenv("LLAMA_CPP_BUILD", "fast")
    with pytest.raises(SystemExit, match="native .* or portable"):
        install_llamacpp.cmake_args(avx2)
