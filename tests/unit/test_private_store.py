"""The compiled-step store is private (`runners/steps/step_store.py`): made with mode 0700, refused (a temporary private
folder used instead) when another user could have put files in it, since a start loads its pickles and libraries;
inductor's precompiled headers are kept inside it rather than at a fixed path in the system's temporary folder."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from transformers_openai.runners.steps.step_store import keep_compiler_cache, private_store, store_problem


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_store_is_made_private(tmp_path: Path) -> None:
    store = tmp_path / "cache" / "compiled-steps"
    assert private_store(store) == store
    assert mode(store) == 0o700
    assert store_problem(store) is None


@pytest.mark.parametrize("loose", [0o777, 0o770, 0o722])
def test_a_store_others_may_write_is_refused(tmp_path: Path, loose: int, caplog: pytest.LogCaptureFixture) -> None:
    store = tmp_path / "compiled-steps"
    store.mkdir()
    store.chmod(loose)
    with caplog.at_level(logging.WARNING):
        used = private_store(store)
    assert used != store
    assert mode(used) == 0o700 and store_problem(used) is None
    assert "may write it" in caplog.text


def test_a_store_under_a_folder_anyone_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could move the store aside and put their own in its place
    store = shared / "compiled-steps"
    problem_store = private_store(store)
    assert problem_store != store
    problem = store_problem(store)
    assert problem is not None and "any user may write" in problem


def test_a_sticky_shared_folder_above_is_accepted(tmp_path: Path) -> None:
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: others may add entries but not move ours
    store = shared / "compiled-steps"
    assert private_store(store) == store


def test_a_store_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    store = tmp_path / "compiled-steps"
    store.mkdir(mode=0o700)
    os.chown(store, 12345, 12345)
    problem = store_problem(store)
    assert problem is not None and "belongs to user 12345" in problem
    assert private_store(store) != store


def test_inductor_keeps_its_cache_and_headers_in_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    keep_compiler_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert Path(codecache._HEADER_DIR).is_relative_to(tmp_path)
    assert Path(codecache._HEADER_LOCK_DIR).is_relative_to(tmp_path)
