"""The allocator a rank runs and malloc=raised's refusals (process/allocator.py,
launch/checks.py): pure functions over a maps file and an environment."""

from __future__ import annotations

import pytest

from dcp_fsdp.config.schema import BenchmarkConfig, Malloc
from dcp_fsdp.errors import UserError
from dcp_fsdp.launch import checks
from dcp_fsdp.process import allocator


def test_a_mapped_replacement_is_named_before_libc(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f20-7f30 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert allocator.loaded_allocator(str(maps)) == "jemalloc"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.loaded_allocator(str(maps)).startswith("glibc ")
    assert allocator.loaded_allocator(str(tmp_path / "absent")).startswith("glibc ")


def test_the_record_holds_only_the_variables_that_change_the_allocator():
    environ = {"MALLOC_ARENA_MAX": "2", "LD_PRELOAD": "/x/libtcmalloc.so", "HOME": "/root",
               "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "AWS_SECRET_ACCESS_KEY": "s"}
    assert allocator.allocator_environment(environ) == {
        "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "LD_PRELOAD": "/x/libtcmalloc.so",
        "MALLOC_ARENA_MAX": "2"}
    assert allocator.preloaded_replacement(environ) == "tcmalloc"
    assert allocator.preloaded_replacement({}) is None
    block = allocator.describe(True, {"MALLOC_ARENA_MAX": "2"})
    assert block["thresholds"] == "raised" and block["environment"] == {"MALLOC_ARENA_MAX": "2"}


def test_malloc_raised_is_refused_under_a_preloaded_replacement(monkeypatch):
    cfg = BenchmarkConfig()
    cfg.malloc = Malloc.raised
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    with pytest.raises(UserError, match=r"^malloc=raised: LD_PRELOAD loads jemalloc"):
        checks.check_environment(cfg)
    monkeypatch.delenv("LD_PRELOAD")
    checks.check_environment(cfg)  # glibc here: accepted
