"""Paths from the bus stay under the data dir (services/common/paths.py)."""

from __future__ import annotations

import pytest

from tandem.services.common.paths import under_data_dir
from tandem.shared.protocol.base import ProtocolError


@pytest.mark.parametrize("given,inside", [
    ("train/job-1", True),
    ("{data}/train/job-1", True),
    ("{data}", True),
    ("{data}/../elsewhere", False),
    ("train/../../elsewhere", False),
    ("/etc/tandem", False),
    ("{data}-sibling/x", False),  # a prefix of the name is not a parent
    ("{data}/link-out/x", False),  # a symlink inside pointing out
])
def test_only_paths_under_the_data_dir_pass(tmp_path, given, inside):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (data / "link-out").symlink_to(tmp_path / "outside")
    path = given.replace("{data}", str(data))
    if inside:
        assert under_data_dir(path, data, "job.output_dir").is_relative_to(data.resolve())
    else:
        with pytest.raises(ProtocolError) as caught:
            under_data_dir(path, data, "job.output_dir")
        assert caught.value.param == "job.output_dir" and "outside the data dir" in caught.value.message
