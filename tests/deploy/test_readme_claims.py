"""Claims in the README and in docs/ that a command can check: the paths they name exist, the README's examples use
the names and port the serve scripts serve, the limits docs/speech.md states are the server's defaults, and the
README's performance table is the current one of docs/performance.md."""

from __future__ import annotations

import re
from pathlib import Path

from transformers_openai.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.md"))}
# Repository paths as the README and the docs write them; .cache/ is made by the scripts, so it is not checked.
_PATH = re.compile(r"(?<![\w./-])((?:scripts|stress-test|tests|deploy|docs|transformers_openai)/[\w./-]*[\w/])")


def served_name(script: str) -> str:
    found = re.search(r"--served-model-name (\S+)", (ROOT / "scripts" / script).read_text())
    assert found, script
    return found.group(1)


def section(text: str, heading: str) -> str:
    parts = text.split(f"\n{heading}\n", 1)
    assert len(parts) == 2, f"no {heading!r}"
    level = heading.index(" ")
    return re.split(rf"\n#{{1,{level}}} ", parts[1], maxsplit=1)[0]


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| |")]


def test_every_path_the_readme_names_exists() -> None:
    named = set(_PATH.findall(README))
    assert len(named) > 10, "the pattern finds the README's paths"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_every_path_the_docs_name_exists() -> None:
    named = {(page, path) for page, text in DOCS.items() for path in _PATH.findall(text)}
    assert len(named) > 30, "the pattern finds the docs' paths"
    missing = sorted(f"{page}: {path}" for page, path in named if not (ROOT / path).exists())
    assert not missing, f"docs/ names paths that do not exist: {missing}"


def test_examples_use_the_names_the_serve_scripts_serve() -> None:
    names = set(re.findall(r'model="([^"]+)"', README))
    scripts = ("serve-smollm2.sh", "serve-whisper-tiny-en.sh", "serve-minilm.sh")
    assert names == {served_name(script) for script in scripts}
    for page in ("usage.md", "speech.md", "embeddings.md"):
        assert set(re.findall(r'model="([^"]+)"', DOCS[page])) <= names, page


def test_examples_use_the_default_port() -> None:
    port = Settings.model_fields["port"].default
    for name, text in {"README.md": README, **DOCS}.items():
        assert set(re.findall(r"http://127\.0\.0\.1:(\d+)/v1", text)) <= {str(port)}, name
    assert set(re.findall(r"http://127\.0\.0\.1:(\d+)/v1", README)) == {str(port)}
    assert f"on :{port}" in README


def test_audio_limits_are_the_defaults() -> None:
    speech = DOCS["speech.md"]
    seconds = re.search(r"`--max-audio-seconds` \(([\d,]+) s", speech)
    size = re.search(r"`--max-audio-bytes` \((\d+) MB", speech)
    assert seconds and size
    assert float(seconds.group(1).replace(",", "")) == Settings.model_fields["max_audio_seconds"].default
    assert int(size.group(1)) * 1024 * 1024 == Settings.model_fields["max_audio_bytes"].default


def test_the_readme_performance_table_is_the_current_one() -> None:
    readme_rows = table_rows(section(README, "## Performance"))
    current_rows = table_rows(section(DOCS["performance.md"], "## Current figures"))
    assert len(readme_rows) >= 4, "the README keeps one performance table"
    assert set(readme_rows) <= set(current_rows), sorted(set(readme_rows) - set(current_rows))


def test_the_readme_keeps_one_performance_table_and_docs_keep_the_history() -> None:
    assert README.count("\n|---") == 1, "the README's only table is the current performance table"
    assert "\n## History\n" in DOCS["performance.md"]
    assert re.search(r"\d{4}-\d{2}-\d{2}", section(README, "## Performance")), "the current table says its date"
