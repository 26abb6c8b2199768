"""Where the Hydra config directory is (no Hydra import: `report` reads prices from it)."""

from __future__ import annotations

from pathlib import Path

from dcp_fsdp.errors import UserError


def conf_dir() -> Path:
    """The Hydra config directory: a source tree's top-level `conf/` (read in place by an
    editable install), or a wheel's copy `dcp_fsdp/conf` (pyproject.toml)."""
    package = Path(__file__).resolve().parent.parent
    for where in (package / "conf", package.parent / "conf"):
        if (where / "config.yaml").is_file():
            return where
    raise UserError(f"no Hydra config directory (conf/config.yaml) under {package} or "
                    f"{package.parent}: the installation is incomplete; reinstall dcp_fsdp")
