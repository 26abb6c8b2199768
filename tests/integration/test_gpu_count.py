"""The light parent counts CUDA devices from the driver (nvidia-smi -L, or
/proc/driver/nvidia/gpus) and CUDA_VISIBLE_DEVICES, never by importing torch (5-20 s of
CUDA start-up per launch on a GPU host). The driver is faked here: an `nvidia-smi` script
on PATH, a /proc-like directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_fsdp.launch import checks

REPO = Path(__file__).resolve().parents[2]

NVIDIA_SMI_L = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-cccc)
  MIG 1g.10gb     Device  0: (UUID: MIG-dddd)
GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-eeee)
"""


@pytest.fixture
def fake_driver(tmp_path, monkeypatch):
    """A GPU host of 4 GPUs as the launcher sees it: the driver's device files and an
    nvidia-smi on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat <<'END'\n{NVIDIA_SMI_L}END\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(checks, "_cuda_driver_present", lambda: True)
    checks.cuda_device_count.cache_clear()
    yield bin_dir
    checks.cuda_device_count.cache_clear()


def test_the_parent_counts_gpus_from_the_driver_without_torch(fake_driver, monkeypatch):
    commands: list[list[str]] = []
    real_run = subprocess.run

    def recorded(argv, *args, **kwargs):
        commands.append(list(argv))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", recorded)
    assert checks.cuda_device_count() == 4
    assert commands and not any("torch" in " ".join(argv) for argv in commands), commands


@pytest.mark.parametrize("visible, expected", [
    ("1", 1), ("3,1", 2), ("", 0), ("-1", 0), ("0,7,1", 1),  # 7: CUDA stops there
    ("1,1", 1), ("GPU-bbbb", 1), ("MIG-dddd", 1), ("0, 2", 2),
])
def test_cuda_visible_devices_narrows_the_count_as_cuda_does(fake_driver, monkeypatch, visible,
                                                             expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert checks.cuda_device_count() == expected


def test_without_nvidia_smi_the_proc_directory_counts(tmp_path, monkeypatch):
    proc = tmp_path / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0"):
        (proc / bus).mkdir(parents=True)
    monkeypatch.setattr(checks, "PROC_GPUS", proc)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert checks.visible_gpu_count() == 2
    monkeypatch.setattr(checks, "PROC_GPUS", tmp_path / "absent")
    assert checks.visible_gpu_count() == 0


def test_counting_gpus_in_the_parent_imports_no_torch(fake_driver):
    """In a fresh interpreter: the launcher's checks and the count leave torch unimported."""
    code = ("import sys\nfrom dcp_fsdp.launch import checks, local\n"
            "checks._cuda_driver_present = lambda: True\n"
            "print(checks.cuda_device_count(), 'torch' in sys.modules)")
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.split() == ["4", "False"]
