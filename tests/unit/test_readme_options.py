"""The options table in docs/options.md names every setting, so the documentation cannot drift from Settings."""

from __future__ import annotations

from pathlib import Path

from transformers_openai.settings import Settings

OPTIONS = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_every_setting_is_in_the_options_table() -> None:
    rows = [line for line in OPTIONS.read_text().splitlines() if line.startswith("| `--")]
    flags = {line.split("`")[1] for line in rows}
    expected = {"--" + name.replace("_", "-") for name in Settings.model_fields}
    expected = {flag if flag != "--api-keys" else "--api-key" for flag in expected}  # listed by its short alias
    assert expected <= flags, f"missing from docs/options.md: {sorted(expected - flags)}"
