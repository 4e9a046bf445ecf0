"""The project tree in the README's Development section matches the files.

How the tree is read: the first fenced block after "## Development". Each line is an indentation (two spaces a
level), then either entries, comma-separated, then two or more spaces and a description, or (a line whose first
words are not entries) the continuation of the description above. An entry is a folder (`name/`) or a file (a name
with an extension). An entry's parent is the nearest folder above it with less indentation.

The rule:
- every entry names a path that exists;
- every top-level folder of the repository that git tracks is an entry;
- every module (but `__init__.py`) and every subpackage directly in `transformers_openai/` is an entry, and so is
  every subpackage deeper down (a new folder shows in the tree); the modules inside a subpackage are summed up in
  its description, not listed, so they are not checked one by one;
- every folder directly in `tests/` is an entry.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PACKAGE = "transformers_openai"
_ENTRY = re.compile(r"[\w.-]+/|[\w-]+(?:\.[\w-]+)+")


def tree_block(readme: str) -> list[str]:
    section = readme.split("\n## Development\n", 1)
    assert len(section) == 2, "the README has no Development section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section[1], re.DOTALL | re.MULTILINE)
    assert block, "the Development section has no fenced project tree"
    return [line for line in block.group(1).splitlines() if line.strip()]


def tree_entries(lines: list[str]) -> set[str]:
    """Every path the tree names, relative to the repository root (folders end with '/')."""
    entries: set[str] = set()
    parents: list[tuple[int, str]] = []  # (indentation, folder path) of the open folders
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        names = [name.strip() for name in re.split(r" {2,}", line.strip(), maxsplit=1)[0].split(",")]
        if not all(_ENTRY.fullmatch(name) for name in names):
            continue  # a description carried over from the line above
        while parents and parents[-1][0] >= indent:
            parents.pop()
        prefix = parents[-1][1] if parents else ""
        for name in names:
            entries.add(prefix + name)
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, prefix + names[0]))
    return entries


def package_paths() -> set[str]:
    """The modules directly in the package and every subpackage at any depth, as tree entries."""
    package = ROOT / PACKAGE
    paths = {f"{PACKAGE}/{path.name}" for path in package.glob("*.py") if path.name != "__init__.py"}
    for init in package.rglob("__init__.py"):
        if init.parent != package:
            paths.add(init.parent.relative_to(ROOT).as_posix() + "/")
    return paths


def tracked_top_level_folders() -> set[str]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked folders are unknown")
    return {path.split("/", 1)[0] + "/" for path in listed.splitlines() if "/" in path and not path.startswith(".")}


@pytest.fixture(scope="module")
def entries() -> set[str]:
    return tree_entries(tree_block(README.read_text()))


def test_every_entry_exists(entries: set[str]) -> None:
    missing = sorted(entry for entry in entries if not (ROOT / entry).exists())
    assert not missing, f"the README's tree names paths that do not exist: {missing}"


def test_every_top_level_folder_is_shown(entries: set[str]) -> None:
    absent = sorted(tracked_top_level_folders() - entries)
    assert not absent, f"the README's tree lacks these top-level folders: {absent}"


def test_every_package_module_and_subpackage_is_shown(entries: set[str]) -> None:
    absent = sorted(package_paths() - entries)
    assert not absent, f"the README's tree lacks: {absent}"


def test_every_test_folder_is_shown(entries: set[str]) -> None:
    folders = {f"tests/{path.name}/" for path in (ROOT / "tests").iterdir() if path.is_dir()}
    absent = sorted(folder for folder in folders - entries if "__pycache__" not in folder)
    assert not absent, f"the README's tree lacks: {absent}"


def test_the_reader_follows_indentation() -> None:
    lines = ["pkg/", "  a.py, b.py   two modules", "  sub/     a subpackage", "           (carried over)", "docs/  x"]
    assert tree_entries(lines) == {"pkg/", "pkg/a.py", "pkg/b.py", "pkg/sub/", "docs/"}
