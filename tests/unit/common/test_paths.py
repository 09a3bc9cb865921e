"""Paths from the bus stay where the operator allows (services/common/paths.py): written ones under
the data dir, read ones under the allowed roots, links that lead out refused."""

from __future__ import annotations

import pytest

from tandem.services.common.paths import absolute_path, resolve_path, tree_under_roots, under_data_dir, under_roots
from tandem.shared.protocol.base import ErrorCode, ProtocolError


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


@pytest.fixture
def tree_of(tmp_path):
    """data/ (the data dir), extra/ (another allowed root), outside/; links from data/ to outside/."""
    data, extra, outside = tmp_path / "data", tmp_path / "extra", tmp_path / "outside"
    for folder in (data / "texts", extra, outside / "texts"):
        folder.mkdir(parents=True)
    (outside / "secret").write_text("s")
    (outside / "texts" / "a.txt").write_text("s")
    (data / "texts" / "a.txt").write_text("a")
    (extra / "notes.txt").write_text("n")
    (data / "link-out").symlink_to(outside / "secret")
    (data / "link-out-dir").symlink_to(outside / "texts")
    (data / "link-in").symlink_to(extra / "notes.txt")  # between two allowed roots
    return data, extra, outside


@pytest.mark.parametrize("given,inside", [
    ("texts/a.txt", True),  # relative: from the data dir
    ("{data}/texts/a.txt", True),
    ("{extra}/notes.txt", True),
    ("{data}/link-in", True),
    ("{data}/no-such-file", True),  # inside; whether it exists is the reader's business
    ("{outside}/secret", False),
    ("/etc/shadow", False),
    ("../outside/secret", False),
    ("texts/../../outside/secret", False),
    ("{data}/link-out", False),
    ("{data}/link-out-dir/a.txt", False),
    ("{extra}-sibling/x", False),
])
def test_only_paths_under_the_allowed_roots_pass(tree_of, given, inside):
    data, extra, outside = tree_of
    path = given.format(data=data, extra=extra, outside=outside)
    roots = [data, extra]
    if inside:
        resolved = under_roots(path, roots, data, "job.dataset", "--read-dirs")
        assert resolved.is_absolute() and resolved == resolve_path(path, data)
        assert resolved.is_relative_to(data.resolve()) or resolved.is_relative_to(extra.resolve())
    else:
        with pytest.raises(ProtocolError) as caught:
            under_roots(path, roots, data, "job.dataset", "--read-dirs")
        error = caught.value
        assert error.code == ErrorCode.INVALID_REQUEST and error.param == "job.dataset"
        assert error.message.startswith(f"job.dataset {path!r} leads outside the folders")
        assert "--read-dirs" in error.message
        assert str(data.resolve()) in error.message and str(extra.resolve()) in error.message


def test_no_roots_allow_nothing(tree_of):
    data, _, _ = tree_of
    with pytest.raises(ProtocolError, match=r"may read \(none\)"):
        under_roots("texts/a.txt", [], data, "job.model", "--read-dirs")


def test_absolute_path_keeps_the_name_and_resolves_to_the_same_place(tree_of):
    data, extra, _ = tree_of
    assert absolute_path("link-in", data) == data.resolve() / "link-in"
    assert absolute_path("link-in", data).resolve() == resolve_path("link-in", data) == (extra / "notes.txt").resolve()
    assert absolute_path(str(extra), data) == extra


@pytest.mark.parametrize("link,refused", [
    (None, None),
    ("{outside}/secret", "x.txt"),  # a file below leads out
    ("{outside}/texts", "x.txt"),  # a folder below leads out (refused before its files are walked)
    ("{extra}/notes.txt", None),  # a link into another allowed root
    (".", None),  # a loop: walked once
])
def test_every_entry_below_a_folder_stays_inside(tree_of, link, refused):
    data, extra, outside = tree_of
    top = data / "texts"
    if link is not None:
        (top / "x.txt").symlink_to(link.format(outside=outside, extra=extra) if link != "." else top)
    if refused is None:
        tree_under_roots(top, [data, extra], "job.model", "--read-dirs")
    else:
        with pytest.raises(ProtocolError) as caught:
            tree_under_roots(top, [data, extra], "job.model", "--read-dirs")
        assert caught.value.param == "job.model"
        assert f"job.model {str(top)!r}: its entry {refused!r} leads outside" in caught.value.message
        assert str(outside) not in caught.value.message  # where it leads is not told


def test_only_the_entries_named_are_checked(tree_of):
    data, _, outside = tree_of
    top = data / "texts"
    (top / "ignored.bin").symlink_to(outside / "secret")
    tree_under_roots(top, [data], "job.dataset", "--read-dirs", entries=[top / "a.txt"])
    with pytest.raises(ProtocolError, match="ignored.bin"):
        tree_under_roots(top, [data], "job.dataset", "--read-dirs")
