"""xdist's `loadscope` (a module at a time), with every module that uses one of the costliest shared servers as a
single unit of work: they run on one worker, one after the other, so that the server starts once instead of once on
each worker (session-scoped fixtures are per worker). tests/conftest.py installs it for `--dist loadscope`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

# Session-scoped servers of tests/e2e/conftest.py, costliest first (a module naming several goes with the first): the
# SmolLM2 server (a real 135M model) and Whisper tiny.en. The tiny random models' servers start in seconds.
SHARED_SERVERS = ("smollm2_server", "whisper_server")


def shared_server_of(module: Path) -> str | None:
    """The first of SHARED_SERVERS that the module's source names (a fixture argument, or getfixturevalue)."""
    if module.suffix != ".py" or not module.is_file():
        return None
    text = module.read_text(errors="replace")
    return next((name for name in SHARED_SERVERS if re.search(rf"\b{name}\b", text)), None)


class SharedServerScheduling(LoadScopeScheduling):  # type: ignore[misc]  # mypy sees it as Any
    """Scopes as `loadscope` makes them (a module, or a class), except that the modules sharing a server form one;
    the unit takes the place of its first module in the collection order."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self._root = config.rootpath
        self._groups: dict[str, str | None] = {}

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module not in self._groups:
            self._groups[module] = shared_server_of(self._root / module)
        server = self._groups[module]
        return f"shared server: {server}" if server else super()._split_scope(nodeid)
