"""The engine's place and settings: keep-alive values, the owner-only directory, the identity an engine is checked
against."""

from __future__ import annotations

import os

import pytest

from refusion.engine import place


@pytest.mark.parametrize("text, seconds", [("300", 300.0), ("90s", 90.0), ("5m", 300.0), ("1h", 3600.0),
                                           ("0", 0.0), ("1.5m", 90.0)])
def test_keep_alive_durations(text, seconds):
    assert place.parse_keep_alive(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-1", "5x", "", "inf", "nan"])
def test_a_bad_keep_alive_is_one_line_naming_it(text):
    with pytest.raises(ValueError, match="--keep-alive=.* is invalid"):
        place.parse_keep_alive(text)


def test_keep_alive_from_the_environment_else_the_default(monkeypatch):
    monkeypatch.setenv(place.KEEP_ALIVE_ENV, "2m")
    assert place.parse_keep_alive(None) == 120.0
    monkeypatch.delenv(place.KEEP_ALIVE_ENV)
    assert place.parse_keep_alive(None) == place.DEFAULT_KEEP_ALIVE
    monkeypatch.setenv(place.KEEP_ALIVE_ENV, "never")
    with pytest.raises(ValueError, match=place.KEEP_ALIVE_ENV):
        place.parse_keep_alive(None)


def test_the_directory_is_created_owner_only_and_an_open_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(place.DIR_ENV, str(tmp_path / "engine"))
    made = place.engine_dir()
    assert made.stat().st_mode & 0o777 == 0o700
    made.chmod(0o755)
    with pytest.raises(ValueError, match="closed to others"):
        place.engine_dir()


def test_the_identity_follows_the_environment_that_changes_answers(monkeypatch):
    base = place.identity()
    monkeypatch.setenv(place.KEEP_ALIVE_ENV, "17")  # how long it stays is not who it is
    assert place.identity() == base
    monkeypatch.setenv("OMP_NUM_THREADS", "937")
    assert place.identity() != base


def test_the_source_digest_changes_when_a_file_changes(tmp_path, monkeypatch):
    before = place.source_digest()
    target = os.path.join(os.path.dirname(place.__file__), "__init__.py")
    stat = os.stat(target)
    try:
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert place.source_digest() != before
    finally:
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
