"""Claims in the README that a command can check: the paths it names exist, its examples use the names and port the
serve scripts serve, and the limits it states are the server's defaults."""

from __future__ import annotations

import re
from pathlib import Path

from transformers_openai.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# Repository paths as the README writes them; .cache/ is made by the scripts, so it is not checked.
_PATH = re.compile(r"(?<![\w./-])((?:scripts|stress-test|tests|deploy|docs|transformers_openai)/[\w./-]*[\w/])")


def served_name(script: str) -> str:
    found = re.search(r"--served-model-name (\S+)", (ROOT / "scripts" / script).read_text())
    assert found, script
    return found.group(1)


def test_every_path_the_readme_names_exists() -> None:
    named = set(_PATH.findall(README))
    assert len(named) > 10, "the pattern finds the README's paths"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_examples_use_the_names_the_serve_scripts_serve() -> None:
    names = set(re.findall(r'model="([^"]+)"', README))
    scripts = ("serve-smollm2.sh", "serve-whisper-tiny-en.sh", "serve-minilm.sh")
    assert names == {served_name(script) for script in scripts}


def test_examples_use_the_default_port() -> None:
    port = Settings.model_fields["port"].default
    assert set(re.findall(r"http://127\.0\.0\.1:(\d+)/v1", README)) == {str(port)}
    assert f"on :{port}" in README


def test_audio_limits_are_the_defaults() -> None:
    seconds = re.search(r"`--max-audio-seconds` \(([\d,]+) s", README)
    size = re.search(r"`--max-audio-bytes` \((\d+) MB", README)
    assert seconds and size
    assert float(seconds.group(1).replace(",", "")) == Settings.model_fields["max_audio_seconds"].default
    assert int(size.group(1)) * 1024 * 1024 == Settings.model_fields["max_audio_bytes"].default
