"""What the model itself generates for one request alone: the ground truth that batching must match."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer


@lru_cache(maxsize=3)
def load(model_dir: str, int8_dynamic: bool = False):  # unannotated: the Auto* class is chosen at run time
    """The model as the server loads it (a quantized checkpoint by its own quantizer); `int8_dynamic`: with the
    linear layers `--quantization int8-dynamic` swaps on a CPU."""
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seq2seq = AutoConfig.from_pretrained(model_dir).is_encoder_decoder
    model_class = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    if int8_dynamic:
        from transformers_openai.int8_linear import quantize_linear_layers

        quantize_linear_layers(model)
    return model, tokenizer


@dataclass
class Reference:
    text: str
    completion_tokens: int
    logprobs: list[float]  # of each generated token (EOS included), from the raw logits
    token_ids: list[int] = field(default_factory=list)  # the generated tokens (EOS included)
    margins: list[float] = field(default_factory=list)  # each step's best logprob less its second best


def greedy(model_dir: Path, prompt_ids: list[int], max_tokens: int, int8_dynamic: bool = False) -> Reference:
    """model.generate on this request alone, greedy."""
    model, tokenizer = load(str(model_dir), int8_dynamic)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    start = 1 if model.config.is_encoder_decoder else len(prompt_ids)  # seq2seq outputs begin with the start token
    new = out.sequences[0, start:].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token]) for step, token in zip(out.logits, new, strict=False)
    ]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    count = next((i + 1 for i, token in enumerate(new) if token in eos_ids), len(new))
    text_ids = new[: count - 1] if new[count - 1] in eos_ids else new[:count]
    top2 = [torch.log_softmax(step[0].float(), dim=-1).topk(2).values for step in out.logits[:count]]
    margins = [float(best[0] - best[1]) for best in top2]
    text = tokenizer.decode(text_ids, skip_special_tokens=True)
    return Reference(text, count, logprobs[:count], new[:count], margins)


def greedy_text(model_dir: Path, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    ref = greedy(model_dir, prompt_ids, max_tokens)
    return ref.text, ref.completion_tokens


def chat_prompt_ids(model_dir: Path, messages: list[dict[str, str]]) -> list[int]:
    _, tokenizer = load(str(model_dir))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def text_prompt_ids(model_dir: Path, text: str) -> list[int]:
    _, tokenizer = load(str(model_dir))
    return list(tokenizer.encode(text))
