"""The README's options table names every setting, so the documentation cannot drift from Settings."""

from __future__ import annotations

from pathlib import Path

from transformers_openai.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_in_the_readme_options_table() -> None:
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    flags = {line.split("`")[1] for line in rows}
    expected = {"--" + name.replace("_", "-") for name in Settings.model_fields}
    expected = {flag if flag != "--api-keys" else "--api-key" for flag in expected}  # listed by its short alias
    assert expected <= flags, f"missing from README: {sorted(expected - flags)}"
