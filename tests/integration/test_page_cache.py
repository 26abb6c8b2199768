"""The fs baseline reads the file system, not the page cache (storage/pagecache.py).

Real files on the machine's disk (pytest's tmp_path, ext4 here) and on /dev/shm (tmpfs), a
real gloo rank running the tool's own loop; residency is read with mincore(2) at the very
instant the timed dcp.load / raw GET starts (tests/kit/pagecache_rank.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dcp_fsdp.launch.embedded_s3 import free_ports
from dcp_fsdp.storage import pagecache
from tests.kit.cli import REPO, clean_env


def run_rank(tmp_path: Path, checkpoint_dir: Path, *settings: str) -> dict:
    out = tmp_path / "seen.json"
    env = clean_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])})
    result = subprocess.run(
        [sys.executable, "-m", "tests.kit.pagecache_rank", str(out), "model=tiny_llama",
         "storage=fs", f"storage.path={checkpoint_dir}", "ceiling=true", "progress=false",
         f"results_dir={tmp_path / 'results'}", *settings],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return json.loads(out.read_text())


def policies(seen: dict) -> dict[str, str]:
    return {s["op"]: s["cache_policy"] for s in seen["samples"]}


def on_disk(path: Path) -> bool:
    return pagecache.file_system_type(path) not in pagecache.MEMORY_FS_TYPES


@pytest.mark.parametrize("sync_files", ["true", "false"])
def test_fs_load_and_raw_get_start_with_the_files_out_of_the_page_cache(tmp_path, sync_files):
    if not on_disk(tmp_path):
        pytest.skip(f"{tmp_path} is on a memory file system: nothing to drop")
    seen = run_rank(tmp_path, tmp_path / "ckpt", f"storage.sync_files={sync_files}")
    resident, pages = seen["load"]
    assert pages > 0 and resident == 0, f"{resident} of {pages} pages cached when dcp.load began"
    resident, pages = seen["raw_get"]
    assert pages > 0 and resident == 0, f"{resident} of {pages} pages cached when the GET began"
    assert policies(seen) == {"save": None, "load": pagecache.DROPPED, "raw_put": None,
                              "raw_get": pagecache.DROPPED, "raw_get_tensors": pagecache.DROPPED,
                              "raw_put_tensors": None, "tc_save": None,
                              "ra_load": pagecache.DROPPED,
                              # DCP alone runs on tmpfs: the memory is the storage
                              "mem_save": None, "mem_load": pagecache.TMPFS}


def test_tmpfs_load_is_recorded_as_not_droppable(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or pagecache.file_system_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    checkpoint_dir = Path(tempfile.mkdtemp(prefix="dcp-fsdp-test-", dir=shm))
    try:
        seen = run_rank(tmp_path, checkpoint_dir)
        resident, pages = seen["load"]
        assert resident == pages > 0  # tmpfs: the memory is the storage
        assert policies(seen)["load"] == policies(seen)["raw_get"] == pagecache.TMPFS
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)


def test_resident_pages_counts_what_a_read_brought_in_and_drop_evicts(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(1 << 20))
    if not on_disk(path):
        pytest.skip("memory file system")
    path.read_bytes()
    resident, pages = pagecache.resident_pages(path)
    assert pages == (1 << 20) // os.sysconf("SC_PAGE_SIZE") and resident == pages
    assert pagecache.drop([path]) == pagecache.DROPPED
    assert pagecache.resident_pages(path) == (0, pages)
