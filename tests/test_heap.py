"""keep_freed_memory: large tensors come from the heap once it is called, and every command
calls it."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import iresflow.cli as cli
from iresflow.heap import keep_freed_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# Allocates a 16 MB tensor and prints whether glibc served it with a fresh mapping (its bytes
# counted in mallinfo2's hblkhd).
_MAPPED = """
import ctypes, sys, torch
from iresflow.heap import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
tensor = torch.ones(4 * 2**20)
print(libc.mallinfo2().hblkhd - before >= tensor.numel() * 4)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_large_tensors_come_from_the_heap_once_kept() -> None:
    def mapped(mode: str) -> str:
        result = subprocess.run([sys.executable, "-c", _MAPPED, mode], capture_output=True,
                                text=True, check=True)
        return result.stdout.strip()

    assert mapped("default") == "True"
    assert mapped("keep") == "False"


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_keep_freed_memory_applies_and_can_be_repeated() -> None:
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert keep_freed_memory() is False


def test_every_command_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(True) or True)
    assert cli.main(["info", "no/such/run"]) == 1
    assert calls == [True]
