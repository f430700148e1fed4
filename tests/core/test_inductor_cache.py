from __future__ import annotations

from eyrie.core.inductor_cache import ENVIRONMENT_KEY, use_inductor_cache


def test_the_benchmarks_inductor_cache_is_the_workspaces_unless_the_environment_names_one(tmp_path, monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_KEY, raising=False)
    monkeypatch.chdir(tmp_path)
    assert use_inductor_cache(".cache/inductor") == str(tmp_path / ".cache" / "inductor")  # made absolute: jobs change directory
    assert (tmp_path / ".cache" / "inductor").is_dir()
    monkeypatch.setenv(ENVIRONMENT_KEY, str(tmp_path / "mine"))
    assert use_inductor_cache(".cache/inductor") == str(tmp_path / "mine")  # the user's own setting wins


def test_no_directory_leaves_inductors_default(monkeypatch):
    monkeypatch.delenv(ENVIRONMENT_KEY, raising=False)
    assert use_inductor_cache(None) is None
    import os

    assert ENVIRONMENT_KEY not in os.environ
