"""Logic behind issue 17's fixes: .metadata read without torch, the report's group legend,
and the batch scripts' load command."""

from __future__ import annotations

from typing import Any

import pytest

from dcp_fsdp.analysis import columns, report
from dcp_fsdp.storage import metadata_peek
from tests.unit.analysis_kit import variant


def test_metadata_is_read_without_torch_classes(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(5)},
             "optim": {"state": {"w": {"exp_avg": torch.zeros(3, 4)}}, "step": 3}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    tensors = metadata_peek.read_facts((tmp_path / ".metadata").read_bytes()).tensors
    assert tensors["model.w"] == metadata_peek.TensorEntry((3, 4), "bfloat16")
    assert tensors["model.b"] == metadata_peek.TensorEntry((5,), "float32")
    assert tensors["optim.state.w.exp_avg"].size_bytes == 3 * 4 * 4
    assert metadata_peek.bytes_by_part(tensors) == {"model": 3 * 4 * 2 + 5 * 4, "optim": 48}


def test_a_pickle_with_other_globals_is_not_executed(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("executed",))

    import pytest

    for refused in (pickle.dumps(Evil()), b"not a pickle"):  # more in test_metadata_screen
        with pytest.raises(metadata_peek.MetadataRefused):
            metadata_peek.read_facts(refused)


def test_many_groups_keep_the_throughput_figures_at_100_columns(tmp_path):
    """Once the group keys fill the width, they move to a legend; the figures stay."""
    root = tmp_path / "results"
    many: dict[str, Any] = {"storage.part_size_mib": 8, "storage.thread_count": 1,
            "storage.throughput_target_gbps": 10.0, "storage.max_attempts": 10,
            "storage.prefix_strategy": "default", "storage.reader": "dcp_optimized",
            "storage.connect_timeout_s": 3.0, "seed": 0}
    for number in range(6):
        settings = {name: (value if isinstance(value, str) else value + number)
                    for name, value in many.items()}
        settings["storage.prefix_strategy"] = ["default", "binary", "hex"][number % 3]
        settings["storage.reader"] = ["dcp_optimized", "sequential"][number % 2]
        variant(root, f"v{number}", settings=settings)
    runs, samples, _ = report.read_records(report.record_files([str(root)]))
    result = report.build(runs, samples)
    text = report.render(result, "table", [], width=100)
    assert max(len(line) for line in text.splitlines()) <= 100, text
    header = next(line for line in text.splitlines() if line.startswith("op "))
    assert "agg MiB/s" in header, text  # the main figure (compact rank 0)
    dropped = [line for line in text.splitlines() if "left out:" in line]
    main = [c.header for c in columns.THROUGHPUT if c.compact is not None and c.compact <= 1]
    assert not any(name in line for line in dropped for name in main), dropped
    assert header.split()[:2] == ["op", "group"], header
    legend = text.split("Groups (the group column above)")[1]
    assert "g1: " in legend and "g6: " in legend and "thread_count" in legend


def test_settings_typos_found_by_the_trial():
    import pytest

    from dcp_fsdp.config.compose import compose
    from dcp_fsdp.errors import UserError

    for overrides, fragment in ((["integrity=2"], "integrity=2: give true or false"),
                                (["model=gpt4b"], "did you mean GPT-4B?"),
                                (["model=L7B"], "did you mean L7b?"),
                                (["results_dir=[a"], "brackets do not pair up"),
                                (["storage.path=~/x"], "storage.path='~/x'"),
                                (["model@pkg=L7b"], "model@pkg: package")):
        with pytest.raises(UserError) as refused:
            compose("save", overrides)
        assert fragment in str(refused.value), (overrides, str(refused.value))
    assert compose("save", ["integrity=0"]).integrity is False  # 0 and 1 stay booleans


@pytest.mark.parametrize(("uri", "fragment"), [
    ("s3://bucket/a/../b", "'..' part"), ("s3://bucket/./b", "'..' part"),
    ("s3://bucket/a//b", "'..' part"), ("s3://bucket/" + "p" * 1000, "at most 928 bytes")])
def test_a_uri_no_key_can_hold_is_refused_before_any_rank(uri, fragment):
    """The trial's URIs with '..' and a 1,000-byte prefix failed after the ranks started
    (HTTP 400 from the server, 17-35 s): refused by the settings check instead."""
    from dcp_fsdp.config.validate import parse_s3_uri
    from dcp_fsdp.errors import UserError

    with pytest.raises(UserError, match=fragment):
        parse_s3_uri(uri)
