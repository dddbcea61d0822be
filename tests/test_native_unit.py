"""The native engine's C++ unit tests (ext/tests), built with CMake and run.

They cover the checks that take peer input (worker addresses, the mapping a
remote key claims, segment bounds). The executable is a separate CMake target
(``-DAIOKVCACHE_NATIVE_TESTS=ON``), never part of the wheel; it links the
libucx wheel's UCX as the extension does, and needs doctest (Debian:
doctest-dev), which ``.ci/run`` installs.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCTEST_DIRS = [pathlib.Path(p) for p in ("/usr/include", "/usr/local/include")]


def _doctest_present() -> bool:
    return any((d / "doctest" / "doctest.h").is_file() for d in DOCTEST_DIRS)


def _cmake() -> str:
    found = shutil.which("cmake")
    if found is not None:
        return found
    try:
        import cmake  # the PyPI package, where the build environment had one

        return str(pathlib.Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        pytest.fail("cmake is needed to build the C++ unit tests (apt-get install cmake)")


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not _doctest_present(),
    reason="doctest.h is not installed (apt-get install doctest-dev)",
)
def test_native_unit(tmp_path: pathlib.Path) -> None:
    cmake = _cmake()
    build = tmp_path / "build"
    configure = [
        cmake,
        "-S",
        str(ROOT),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DAIOKVCACHE_MODULE=OFF",
        "-DAIOKVCACHE_NATIVE_TESTS=ON",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    if shutil.which("ninja") is not None:
        configure += ["-G", "Ninja"]
    jobs = str(max(1, min(4, os.cpu_count() or 1)))
    steps = [configure, [cmake, "--build", str(build), "--target", "native_unit_tests", "-j", jobs]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{cmd[:2]} failed:\n{r.stdout}\n{r.stderr}"
    exe = build / "ext" / "tests" / "native_unit_tests"
    r = subprocess.run([str(exe)], capture_output=True, text=True, check=False, timeout=300)
    assert r.returncode == 0, f"C++ unit tests failed:\n{r.stdout}\n{r.stderr}"
    assert "Status: SUCCESS" in r.stdout, r.stdout
