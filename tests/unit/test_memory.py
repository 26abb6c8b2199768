"""Per-operation memory high-water marks: the /proc/self/status reader and the VmHWM reset."""

from __future__ import annotations

import os

import pytest
import torch

from dcp_fsdp.rank import memory

STATUS_SAMPLE = """Name:\tpython
VmPeak:\t 1234568 kB
VmSize:\t 1200000 kB
VmHWM:\t  420476 kB
VmRSS:\t  225160 kB
RssAnon:\t  200000 kB
Threads:\t3
"""


def test_parse_status_reads_kib_lines_as_bytes():
    fields = memory.parse_status(STATUS_SAMPLE)
    assert fields["VmHWM"] == 420476 * 1024
    assert fields["VmRSS"] == 225160 * 1024
    assert fields["RssAnon"] == 200000 * 1024
    assert "Threads" not in fields and "Name" not in fields


def test_read_status_of_this_process_and_of_no_proc(tmp_path):
    fields = memory.read_status()
    assert fields["VmHWM"] >= fields["VmRSS"] > 0
    assert memory.read_status(str(tmp_path / "missing")) == {}
    assert memory.reset_peak_rss(str(tmp_path / "no-such-dir" / "clear_refs")) is False


@pytest.mark.skipif(not os.path.exists(memory.CLEAR_REFS_PATH), reason="no /proc/self/clear_refs")
def test_reset_drops_the_high_water_mark_after_a_freed_allocation():
    big_bytes = 256 * 2**20
    before = memory.read_status()["VmRSS"]
    tensor = torch.ones(big_bytes // 4)  # touched: resident
    peak_with = memory.read_status()["VmHWM"]
    assert peak_with >= before + big_bytes // 2
    del tensor  # large allocations go back to the OS at once (mmap)
    # The mark stays without a reset (the kernel's RSS counters lag a little: approximate).
    assert memory.read_status()["VmHWM"] >= peak_with - big_bytes // 8
    assert memory.reset_peak_rss()
    after = memory.read_status()
    assert after["VmHWM"] < peak_with - big_bytes // 2
    assert after["VmHWM"] >= after["VmRSS"] - 2**20  # reset to (about) the current RSS


def test_peak_memory_brackets_an_operation():
    peak = memory.PeakMemory(torch.device("cpu"))
    peak.begin()
    tensor = torch.ones(64 * 2**20 // 4)
    rss, cuda = peak.end()
    del tensor
    assert cuda is None  # no CUDA device: no CUDA figure
    assert rss is not None and rss >= memory.read_status()["VmRSS"]
    assert rss >= 64 * 2**20


def test_lifetime_peak_is_the_fallback_and_warns_once(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(memory, "reset_peak_rss", lambda path=None: False)
    peak = memory.PeakMemory(torch.device("cpu"), warnings.append)
    for _ in range(2):
        peak.begin()
        rss, _ = peak.end()
        assert rss == memory.lifetime_peak_rss_bytes()
    assert len(warnings) == 1 and "ru_maxrss" in warnings[0]
