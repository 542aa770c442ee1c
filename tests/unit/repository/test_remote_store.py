"""The object-storage sync layer (pdserve.repository.remote_store) on a file:// store."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from pdserve.repository import remote_store as rs
from pdserve.repository.remote_store import RemoteRepository, StoreUnavailable


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    write(root / "m" / "config.pbtxt", b'name: "m"\n')
    write(root / "m" / "1" / "model.bin", b"a" * 100)
    write(root / "m" / "2" / "model.bin", b"b" * 200)
    write(root / "m" / "2" / "extra.txt", b"x")
    write(root / "README", b"not a model")
    return root


def remote(store: Path, tmp_path: Path, **kw: object) -> RemoteRepository:
    return RemoteRepository(f"file://{store}", tmp_path / "cache", **kw)  # type: ignore[arg-type]


def test_url_detection_and_default_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    assert rs.is_remote_url("s3://bucket/prefix")
    assert rs.is_remote_url("gs://b") and rs.is_remote_url("file:///tmp/x")
    assert not rs.is_remote_url("/tmp/repo") and not rs.is_remote_url("repo")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    d = rs.default_cache_dir("s3://bucket/prefix")
    assert d.parent == Path("/xdg/pdserve/repositories") and len(d.name) == 16
    assert d != rs.default_cache_dir("s3://bucket/other")


def test_initial_sync_mirrors_models_and_ignores_root_files(store: Path, tmp_path: Path) -> None:
    r = remote(store, tmp_path)
    report = r.sync()
    assert report.files == 5 and report.downloaded == 4 and report.bytes == 10 + 100 + 200 + 1
    assert sorted(report.published) == ["m", "m/1", "m/2"]
    local = r.local_path
    assert (local / "m" / "2" / "model.bin").read_bytes() == b"b" * 200
    assert (local / "m" / "config.pbtxt").read_bytes() == b'name: "m"\n'
    assert not (local / "README").exists()
    assert not (r.cache_dir / "staging").exists()
    # Nothing changed: nothing fetched.
    again = r.sync()
    assert again.downloaded == 0 and again.published == [] and again.removed == []


def test_only_changed_files_are_fetched_and_versions_swap_whole(
    store: Path, tmp_path: Path
) -> None:
    r = remote(store, tmp_path)
    r.sync()
    old_inode = os.stat(r.local_path / "m" / "2" / "extra.txt").st_ino
    write(store / "m" / "2" / "model.bin", b"c" * 300)
    write(store / "m" / "3" / "model.bin", b"d" * 10)
    report = r.sync()
    assert report.downloaded == 2 and report.bytes == 310
    assert sorted(report.published) == ["m/2", "m/3"]
    assert (r.local_path / "m" / "2" / "model.bin").read_bytes() == b"c" * 300
    # The unchanged file of the changed version was linked, not fetched again.
    assert os.stat(r.local_path / "m" / "2" / "extra.txt").st_ino == old_inode
    # A state that survives a restart: a new instance fetches nothing.
    assert remote(store, tmp_path).sync().downloaded == 0


def test_removed_files_versions_and_models_leave_the_cache(store: Path, tmp_path: Path) -> None:
    r = remote(store, tmp_path)
    r.sync()
    (store / "m" / "2" / "extra.txt").unlink()
    report = r.sync()
    assert report.published == ["m/2"] and not (r.local_path / "m" / "2" / "extra.txt").exists()
    for f in (store / "m" / "1").iterdir():
        f.unlink()
    (store / "m" / "1").rmdir()
    assert r.sync().removed == ["m/1"]
    assert not (r.local_path / "m" / "1").exists() and (r.local_path / "m" / "2").is_dir()
    write(store / "n" / "config.pbtxt", b"n")
    r.sync()
    assert (r.local_path / "n" / "config.pbtxt").exists()
    (store / "n" / "config.pbtxt").unlink()
    assert "n" in r.sync().removed
    assert not (r.local_path / "n").exists()


def test_ready_marker_defers_a_version_until_it_is_uploaded(store: Path, tmp_path: Path) -> None:
    for v in ("1", "2"):
        write(store / "m" / v / "READY", b"")
    r = remote(store, tmp_path, ready_marker="READY")
    r.sync()
    write(store / "m" / "3" / "model.bin", b"new")
    report = r.sync()
    assert report.deferred == ["m/3"] and not (r.local_path / "m" / "3").exists()
    write(store / "m" / "3" / "READY", b"")
    assert r.sync().published == ["m/3"]
    assert (r.local_path / "m" / "3" / "model.bin").read_bytes() == b"new"


def test_a_version_that_changes_while_downloading_waits(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = remote(store, tmp_path)
    r.sync()
    write(store / "m" / "3" / "a.bin", b"1")
    real = r._download

    def download_then_upload_more(rel: str, info: dict, dest: Path) -> int:
        n = real(rel, info, dest)
        write(store / "m" / "3" / "b.bin", b"22")  # the uploader is still at work
        return n

    monkeypatch.setattr(r, "_download", download_then_upload_more)
    assert r.sync().deferred == ["m/3"]
    assert not (r.local_path / "m" / "3").exists()
    monkeypatch.setattr(r, "_download", real)
    assert r.sync().published == ["m/3"]
    assert (r.local_path / "m" / "3" / "b.bin").read_bytes() == b"22"


def test_integrity_failure_keeps_the_old_version(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = remote(store, tmp_path)
    r.sync()
    write(store / "m" / "2" / "model.bin", b"e" * 200)
    real = r._list

    def lying_list(prefix: str = "") -> dict:
        out = real(prefix)
        for rel, info in out.items():
            if rel == "m/2/model.bin":
                out[rel] = dict(info, size=999)
        return out

    r._list = lying_list  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, "pdserve.repository.remote"):
        report = r.sync()
    assert report.failed == ["m/2"]
    assert "999" in caplog.text and "m/2 left as it was" in caplog.text
    assert (r.local_path / "m" / "2" / "model.bin").read_bytes() == b"b" * 200


def test_md5_from_the_store_is_checked(tmp_path: Path) -> None:
    assert rs._expected_md5({"ETag": '"0cc175b9c0f1b6a831c399e269772661"'}) == (
        "0cc175b9c0f1b6a831c399e269772661"
    )
    assert rs._expected_md5({"ETag": '"abc-3"'}) is None  # multi-part: size only
    assert rs._expected_md5({"md5Hash": "DMF1ucDxtqgxw5niaXcmYQ=="}) == (
        "0cc175b9c0f1b6a831c399e269772661"
    )
    f = tmp_path / "a"
    f.write_bytes(b"a")
    assert rs._md5_of(f) == "0cc175b9c0f1b6a831c399e269772661"


def test_unreachable_store_logs_once_per_outage(
    store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    r = remote(store, tmp_path)
    r.sync()
    moved = store.with_name("away")
    store.rename(moved)
    with caplog.at_level(logging.INFO, "pdserve.repository.remote"):
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                r.sync()
        assert caplog.text.count("is unreachable") == 1
        assert (r.local_path / "m" / "2" / "model.bin").exists()  # the cache is untouched
        moved.rename(store)
        assert r.sync().downloaded == 0
    assert caplog.text.count("is reachable again") == 1
    assert r.outages == 1 and r.outage is None


def test_pdserve_check_accepts_a_repository_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.app import cli
    from tests.conftest import EXAMPLE_REPO, require_examples

    require_examples()
    store = tmp_path / "store"
    store.mkdir()
    import shutil

    shutil.copytree(EXAMPLE_REPO / "tiny", store / "tiny")
    assert cli.main(["check", f"file://{store}"]) == 0
    assert "tiny" in capsys.readouterr().out
    assert cli.main(["check", f"file://{tmp_path / 'nothing'}"]) == 2
    assert "no files under" in capsys.readouterr().err


def test_a_cached_file_deleted_by_hand_is_fetched_again(store: Path, tmp_path: Path) -> None:
    r = remote(store, tmp_path)
    r.sync()
    (r.local_path / "m" / "2" / "extra.txt").unlink()
    write(store / "m" / "2" / "model.bin", b"f" * 20)
    report = r.sync()
    assert report.published == ["m/2"] and report.downloaded == 2
    assert (r.local_path / "m" / "2" / "extra.txt").read_bytes() == b"x"
