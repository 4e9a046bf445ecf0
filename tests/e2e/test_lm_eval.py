"""lm-evaluation-harness through the server (`local-completions`) scores as lm-eval's own `hf` backend does.

Two small local tasks (tests/data/lm_eval_tasks): multiple choice (loglikelihood of each choice after the question)
and perplexity (loglikelihood_rolling over short paragraphs, in windows short enough that most paragraphs take
two or three, so the later windows' one-token context is exercised too). The per-document loglikelihoods of the
two backends must agree, not only the aggregate scores.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

from tests.e2e.server import ServerProcess

TASKS_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval_tasks"
CHOICE, PERPLEXITY = "toa_general_knowledge", "toa_prose_perplexity"
# Rolling windows of 32 tokens. `hf` uses max_length as the window; the API models keep one token back for the
# generated one and one more for the window's context, so they get max_length + 2 for the same windows.
WINDOW = 32


def evaluate(model: str, model_args: dict[str, Any]) -> dict[str, Any]:
    # The two local tasks only: indexing lm-eval's thousands of own task files took 6-8 s of a core each time.
    tasks = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[CHOICE, PERPLEXITY],
        task_manager=tasks,
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,  # no standard errors: bootstrapping them takes longer than the model
    )
    assert result is not None
    return result


def by_doc(result: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(result["samples"][task], key=lambda sample: sample["doc_id"])


@pytest.mark.slow
def test_local_completions_scores_equal_the_hf_backend(
    smollm2_server: ServerProcess, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS_DIR)  # the YAMLs' data_files are relative to their folder
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = evaluate("hf", {"pretrained": str(smollm2_dir), "dtype": "float32", "device": "cpu", "max_length": WINDOW})
    finally:
        torch.set_num_threads(threads)
    served = evaluate(
        "local-completions",
        {
            "model": smollm2_server.model,
            "base_url": f"{smollm2_server.base_url}/completions",
            "tokenizer": str(smollm2_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "num_concurrent": 4,  # four requests at a time: the server batches them (and each is still its own)
            "max_retries": 1,
            "max_length": WINDOW + 2,
        },
    )

    # Multiple choice: every choice's loglikelihood (and whether it is the greedy continuation), then the scores.
    hf_docs, served_docs = by_doc(hf, CHOICE), by_doc(served, CHOICE)
    assert len(hf_docs) == len(served_docs) == 20
    for own, ours in zip(hf_docs, served_docs, strict=True):
        assert ours["arguments"] == own["arguments"]
        assert len(ours["filtered_resps"]) == len(own["filtered_resps"]) >= 3
        pairs = zip(own["filtered_resps"], ours["filtered_resps"], strict=True)
        for (own_ll, own_greedy), (our_ll, our_greedy) in pairs:
            assert our_ll == pytest.approx(own_ll, abs=1e-3), own["arguments"]
            assert our_greedy == own_greedy, own["arguments"]
        assert (ours["acc"], ours["acc_norm"]) == (own["acc"], own["acc_norm"]), own["doc"]
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"][CHOICE][metric] == hf["results"][CHOICE][metric]

    # Perplexity: each paragraph's summed loglikelihood, then the three aggregates.
    hf_docs, served_docs = by_doc(hf, PERPLEXITY), by_doc(served, PERPLEXITY)
    assert len(hf_docs) == len(served_docs) == 10
    for own, ours in zip(hf_docs, served_docs, strict=True):
        assert ours["filtered_resps"] == pytest.approx(own["filtered_resps"], abs=1e-3)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        own_score, our_score = hf["results"][PERPLEXITY][metric], served["results"][PERPLEXITY][metric]
        assert math.isfinite(own_score) and our_score == pytest.approx(own_score, rel=1e-4), metric
    assert smollm2_server.engine_state()["rows_in_use"] == 0
