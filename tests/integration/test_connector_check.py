"""The launcher refuses a connector whose request log it has not checked, in one line (a real
command). Moved from tests/unit/test_request_parser.py."""

from __future__ import annotations

from tests.kit.cli import run_cli


def test_the_launcher_refuses_an_unchecked_connector_in_one_line(tmp_path):
    """A newer connector (its package metadata first on the path) with request_stats=true:
    refused before any rank, naming the setting that lets the run go on."""
    fake = tmp_path / "site" / "s3torchconnectorclient-1.6.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: s3torchconnectorclient\n"
                                   "Version: 1.6.0\n")
    from tests.kit.cli import REPO

    env = {"PYTHONPATH": f"{tmp_path / 'site'}:{REPO}"}
    refused = run_cli(["save", "model=tiny_llama", f"results_dir={tmp_path / 'r'}"], env=env,
                      timeout_s=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    errors = [text for text in refused.stderr.splitlines() if text.strip()]
    assert len(errors) == 1 and "s3torchconnectorclient 1.6.0" in errors[0], errors
    assert "request_stats=false" in errors[0] and "Traceback" not in refused.stderr
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*.jsonl"))
