"""--model, --models and --models-config expanded into one Settings per served model, and their mistakes refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transformers_openai.model_list import memory_budget, served_models, weights_bytes
from transformers_openai.settings import Settings


def test_models_flags_and_config_in_order_with_their_own_settings(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("- model: ./t5\n  served_model_name: t5\n  max_model_len: 128\n- model: ./whisper\n")
    settings = Settings(model="./llama", models=["minilm=./minilm"], models_config=config, port=9000, max_queue=7)
    listed = served_models(settings)
    assert [(m.model, m.model_name) for m in listed] == [
        ("./llama", "./llama"),
        ("./minilm", "minilm"),
        ("./t5", "t5"),
        ("./whisper", "./whisper"),
    ]
    assert listed[2].max_model_len == 128 and listed[1].max_model_len is None
    assert {m.port for m in listed} == {9000} and {m.max_queue for m in listed} == {7}  # the server's settings


def test_model_alone_and_models_without_model() -> None:
    assert [m.model for m in served_models(Settings(model="./one"))] == ["./one"]
    assert [m.model for m in served_models(Settings.model_validate({"models": "./a,./b"}))] == [
        "./a",
        "./b",
    ]  # the default not added


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"model": "x"}', "must hold a list of objects"),
        ('[{"served_model_name": "x"}]', "entry 0 has no `model`"),
        ('[{"model": "x", "port": 1}]', "sets port, which are not per-model settings"),
        ('[{"model": "x", "max_model_len": "long"}]', "the settings of model x are not valid: max_model_len"),
        ("[{", "is not valid JSON"),
        ('[{"model": "./x", "served_model_name": "a"}, {"model": "./y", "served_model_name": "a"}]', "served as a"),
    ],
)
def test_config_mistakes_are_refused_with_the_reason(tmp_path: Path, text: str, problem: str) -> None:
    config = tmp_path / "models.json"
    config.write_text(text)
    with pytest.raises(ValueError) as caught:
        served_models(Settings(models_config=config))
    assert problem in str(caught.value)


def test_a_missing_config_and_tensor_parallelism_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        served_models(Settings(models_config=tmp_path / "none.json"))
    with pytest.raises(ValueError, match="serves one model"):
        served_models(Settings(model="./a", models=["./b"], tensor_parallel_size=2))


def test_weights_size_and_budget(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"0" * 1000)
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert weights_bytes(str(tmp_path)) == 1000
    assert weights_bytes("no-such/model-here") == 0
    assert memory_budget(Settings.model_validate({"models_memory_budget": "2GiB"}), 1) == 2 * 2**30
    assert memory_budget(Settings(), 1) is None  # one model loaded at start: unbounded, as before
    default = memory_budget(Settings(), 2)
    assert default is None or default > 0
