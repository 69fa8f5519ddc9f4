"""Memory readings: the resident set through psutil, and the peak in the units each platform reports (ru_maxrss is
KiB on Linux and bytes on macOS; Windows has no getrusage, psutil reads its peak working set)."""

from __future__ import annotations

import resource
from types import SimpleNamespace

import psutil
import pytest

from accel_train import tracking

CPU = SimpleNamespace(type="cpu")
MB = 2**20


@pytest.mark.parametrize("platform, ru_maxrss", [("linux", 300 * 1024), ("darwin", 300 * MB)])
def test_peak_memory_units_per_platform(monkeypatch, platform, ru_maxrss):
    monkeypatch.setattr(tracking.sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=ru_maxrss))
    assert tracking.peak_memory_mb(CPU) == pytest.approx(300.0)


def test_peak_memory_on_windows_reads_the_peak_working_set(monkeypatch):
    monkeypatch.setattr(tracking.sys, "platform", "win32")
    fake = SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=100 * MB, peak_wset=300 * MB))
    monkeypatch.setattr(tracking.psutil, "Process", lambda: fake)
    assert tracking.peak_memory_mb(CPU) == pytest.approx(300.0)


def test_current_memory_is_this_process_resident_set():
    rss = psutil.Process().memory_info().rss / MB
    assert tracking.current_memory_mb(CPU) == pytest.approx(rss, rel=0.1)
