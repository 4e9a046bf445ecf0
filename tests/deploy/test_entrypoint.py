"""deploy/entrypoint.py: the quick start's defaults only when no model is named, and the K/V share of replicas."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "entrypoint.py"


@pytest.fixture(scope="module")
def entrypoint() -> Any:
    spec = importlib.util.spec_from_file_location("entrypoint", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_model_gives_the_quick_start(entrypoint: Any) -> None:
    env = entrypoint.server_environment({"PORT": "7088"}, [])
    assert env["HF_MODEL"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert env["SERVED_MODEL_NAME"] == "SmolLM2-135M-Instruct"
    assert Path(env["CHAT_TEMPLATE"]).is_file()
    assert env["PORT"] == "7088"


def test_own_choices_within_the_quick_start_are_kept(entrypoint: Any) -> None:
    env = entrypoint.server_environment({"served_model_name": "mine", "HF_MODEL": ""}, [])
    assert env["served_model_name"] == "mine" and "SERVED_MODEL_NAME" not in env
    assert env["HF_MODEL"] == "HuggingFaceTB/SmolLM2-135M-Instruct", "an empty name is no model"


@pytest.mark.parametrize(
    ("env", "args"),
    [
        ({"MODEL": "org/m"}, []),
        ({"hf_model": "org/m"}, []),
        ({}, ["--model", "org/m"]),
        ({}, ["--hf-model=org/m"]),
    ],
)
def test_a_named_model_gets_no_quick_start_defaults(entrypoint: Any, env: dict[str, str], args: list[str]) -> None:
    result = entrypoint.server_environment(env, args)
    assert not {"HF_MODEL", "SERVED_MODEL_NAME", "CHAT_TEMPLATE"} & (set(result) - set(env))


def test_replicas_split_the_kv_share(entrypoint: Any) -> None:
    assert entrypoint.server_environment({"GPU_REPLICAS": "4"}, [])["KV_CACHE_MEMORY"] == "0.2125"
    assert (
        entrypoint.server_environment({"GPU_REPLICAS": "4", "KV_CACHE_MEMORY": "1GiB"}, [])["KV_CACHE_MEMORY"] == "1GiB"
    )
    assert "KV_CACHE_MEMORY" not in entrypoint.server_environment({}, [])
    with pytest.raises(SystemExit):
        entrypoint.server_environment({"GPU_REPLICAS": "0"}, [])
