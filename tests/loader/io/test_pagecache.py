"""Page-cache residency: which files count as cold (the choice of O_DIRECT reads), without a GPU."""

from __future__ import annotations

import pytest
from gdsload.loader.io import iomode, pagecache


def _fs(monkeypatch, kinds: dict[str, str]) -> None:
    monkeypatch.setattr(iomode, "mount_of", lambda p: ("/m", kinds[p]))


def test_files_on_memory_file_systems_are_never_cold_and_are_not_probed(monkeypatch):
    _fs(monkeypatch, {"a": "tmpfs", "b": "ramfs"})

    def probe(*a, **k):
        raise AssertionError("mincore probe ran for files in memory")

    monkeypatch.setattr(pagecache, "resident_fraction", probe)
    assert pagecache.is_cold("a", "b") is False


@pytest.mark.parametrize("resident, cold", [(0.0, True), (0.49, True), (0.5, False), (1.0, False)])
def test_a_rank_with_a_file_on_disk_is_probed(monkeypatch, resident, cold):
    _fs(monkeypatch, {"a": "tmpfs", "b": "ext4"})
    seen = []

    def probe(paths, *, samples):
        seen.append(tuple(paths))
        return resident

    monkeypatch.setattr(pagecache, "resident_fraction", probe)
    assert pagecache.is_cold("a", "b") is cold
    assert seen == [("a", "b")]


def test_real_files_on_disk_after_eviction_and_after_reading(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"\1" * (4 << 20))
    if iomode.mount_of(str(f))[1] in pagecache.MEMORY_FILESYSTEMS:
        pytest.skip("the test directory is on a memory file system")
    f.read_bytes()
    assert pagecache.is_cold(str(f)) is False
    pagecache.evict([str(f)])
    if pagecache.resident_fraction([str(f)]) > 0.1:
        pytest.skip("this host kept the pages (fadvise is advisory)")
    assert pagecache.is_cold(str(f)) is True
