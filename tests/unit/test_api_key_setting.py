"""An API key setting that names no key is refused at start: `API_KEY=","` would otherwise leave the server open
without a word. A blank or absent setting still means an open server, as documented."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from transformers_openai.settings import Settings


@pytest.mark.parametrize("value", [",", " , ", ",,,", [",", " "]])
def test_a_key_setting_of_only_commas_is_a_start_up_error(value: str | list[str]) -> None:
    with pytest.raises(ValidationError, match="names no key"):
        Settings(api_keys=value)  # type: ignore[arg-type]  # the raw text a flag or the environment gives


def test_the_environment_variable_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEY", ",")
    with pytest.raises(ValidationError, match="names no key"):
        Settings()


@pytest.mark.parametrize(
    ("value", "keys"), [("", []), ([], []), ("a", ["a"]), (" a , b,", ["a", "b"]), (["a,b"], ["a", "b"])]
)
def test_blank_means_open_and_keys_are_split(value: str | list[str], keys: list[str]) -> None:
    assert Settings(api_keys=value).api_keys == keys  # type: ignore[arg-type]  # raw text, as from a flag
