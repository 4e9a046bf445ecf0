"""Dependencies point one way: engine/ and runners/ know nothing of HTTP, and importing main has no side effects."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "transformers_openai"
FORBIDDEN = (
    "fastapi",
    "starlette",
    "sse_starlette",
    "transformers_openai.api",
    "transformers_openai.serving",
    "transformers_openai.protocol",
)
LOWER_LAYERS = sorted((PACKAGE / "engine").rglob("*.py")) + sorted((PACKAGE / "runners").rglob("*.py"))


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, with relative imports resolved against `package`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_of(path: Path) -> set[str]:
    package = ".".join(path.relative_to(ROOT).parts[:-1])
    return imported_modules(path.read_text(), package)


def is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def test_lower_layers_found() -> None:
    names = {p.name for p in LOWER_LAYERS}
    assert {"scheduler.py", "sampler.py", "causal_lm.py", "kv_cache.py"} <= names


def test_checker_catches_forbidden_imports() -> None:
    source = "import fastapi.responses\nfrom .. import protocol\nfrom ..api.sse import x\nimport transformers\n"
    found = sorted(m for m in imported_modules(source, "transformers_openai.engine") if is_forbidden(m))
    assert found == [
        "fastapi.responses",
        "transformers_openai.api.sse",
        "transformers_openai.api.sse.x",
        "transformers_openai.protocol",
    ]
    assert not is_forbidden("transformers_openai.protocolx")


@pytest.mark.parametrize("path", LOWER_LAYERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_engine_and_runners_do_not_import_http_layers(path: Path) -> None:
    bad = sorted(m for m in imports_of(path) if is_forbidden(m))
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


RUNNERS = sorted((PACKAGE / "runners").rglob("*.py"))


@pytest.mark.parametrize("path", RUNNERS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_runners_do_not_import_the_engine(path: Path) -> None:
    """The engine drives the runners, never the reverse: K/V blocks are handed out by the engine's K/V manager, and
    a runner that imported the block pool could allocate them itself."""
    bad = sorted(
        m for m in imports_of(path) if m == "transformers_openai.engine" or m.startswith("transformers_openai.engine.")
    )
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


# Wraps torch.cuda's entry points and records any call made from this project's code during the import.
IMPORT_MAIN = """
import sys, traceback, torch
calls = []
def spy(name, real):
    def wrapper(*args, **kwargs):
        if any("transformers_openai" in frame.filename for frame in traceback.extract_stack()[:-1]):
            calls.append(name)
        return real(*args, **kwargs)
    return wrapper
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device", "get_device_name"):
    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))
import transformers_openai.main
assert calls == [] and not torch.cuda.is_initialized(), calls
print("imported")
"""


def test_importing_main_parses_no_argv_and_touches_no_cuda() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_MAIN, "--bogus-flag", "--model", "/nonexistent", "--port", "notaport"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"


# What each part of the package may import of the others (besides itself): the layers point one way, api -> serving
# -> engine -> runners, with protocol beside serving and parallel below the loader. The loaders and main (the
# composition root) may import anything; a part not listed here must be added with its rule.
ALLOWED: dict[str, frozenset[str]] = {
    "api": frozenset({"engine", "logs", "metrics", "protocol", "serving", "settings"}),
    "serving": frozenset({"engine", "protocol"}),
    "protocol": frozenset({"engine"}),
    "engine": frozenset({"runners"}),
    "runners": frozenset({"int8_linear"}),
    "parallel": frozenset({"logs", "runners", "settings"}),
    "metrics": frozenset({"engine"}),
    "settings": frozenset({"quantization"}),
    "model_list": frozenset({"settings"}),
    "quantization": frozenset({"int8_linear"}),
    "int8_linear": frozenset(),
    "logs": frozenset(),
}
COMPOSITION_ROOT = frozenset({"main", "server", "step_compiler", "model_loader", "embedding_loader", "__init__"})
WEB = ("fastapi", "starlette", "sse_starlette", "uvicorn")


def part_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_part_imports_only_the_parts_below_it(path: Path) -> None:
    part = part_of(path)
    if part in COMPOSITION_ROOT:
        return
    assert part in ALLOWED, f"{part} has no layering rule: add it to ALLOWED"
    named = {m.split(".")[1] for m in imports_of(path) if m.startswith("transformers_openai.")}
    imported = {name for name in named if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()}
    bad = sorted(imported - ALLOWED[part] - {part})
    assert bad == [], f"{path.relative_to(ROOT)} ({part}) imports {bad}"
    if part != "api":  # HTTP lives in api/ alone
        web = sorted(m for m in imports_of(path) if m.split(".")[0] in WEB)
        assert web == [], f"{path.relative_to(ROOT)} imports {web}"
