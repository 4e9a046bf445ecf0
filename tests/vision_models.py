"""Tiny random vision-language checkpoints built locally (no hub): LLaVA, LLaVA-NeXT and Idefics3 (SmolVLM's family),
each with its real processor (SmolLM2's tokenizer with the family's image tokens, the family's PIL image processor at
a small size, a chat template that renders image parts), saved so that `AutoProcessor.from_pretrained(dir)` and
`AutoModelForImageTextToText.from_pretrained(dir)` load them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.model_factory import build_tiny_llama, built_once, cache_root

# Renders string or list content; an image part is the processor's image marker, which it expands to the family's
# image tokens.
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FAMILIES = ("llava", "llava-next", "idefics3")
REVISION = "r2"  # part of the cached directory's name: a change to the builders builds anew
TEXT_WIDTH = 64


def _tokenizer(extra: list[str]) -> Any:
    """SmolLM2's tokenizer (as the tiny Llama saved it) with the family's image tokens added as special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_llama(cache_root() / "tiny-llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE  # a text-only chat renders as the processor renders it
    return tokenizer


def _text_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=TEXT_WIDTH,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )


def _clip_config(image_size: int, patch_size: int) -> Any:
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )


def _save(dest: Path, model: Any, processor: Any) -> Path:
    import torch

    # Spread the logits so that greedy choices are not near-ties (random init gives tiny logits).
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


@built_once
def build_tiny_llava(dest: Path, seed: int = 0) -> Path:
    """LLaVA-1.5's shape: a CLIP tower on 30 px images (patches of 6 px: 25 image tokens per image, CLS dropped)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    config = LlavaConfig(
        vision_config=_clip_config(30, 6),
        text_config=_text_config(tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=6,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    torch.manual_seed(seed)
    return _save(dest, LlavaForConditionalGeneration(config), processor)


@built_once
def build_tiny_llava_next(dest: Path, seed: int = 0) -> Path:
    """LLaVA-NeXT's shape: any-resolution tiles of 30 px (grid 30x30 to 60x60) plus the base image, packed with
    newline embeddings, so the image token count follows the image's size."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = _tokenizer(["<image>"])
    pinpoints = [[30, 60], [60, 30], [60, 60]]
    config = LlavaNextConfig(
        vision_config=_clip_config(30, 6),
        text_config=_text_config(tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
    )
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}, image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=6,
        vision_feature_select_strategy="default",
        chat_template=VISION_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    torch.manual_seed(seed)
    return _save(dest, LlavaNextForConditionalGeneration(config), processor)


@built_once
def build_tiny_idefics3(dest: Path, seed: int = 0) -> Path:
    """Idefics3's (SmolVLM's) shape: a SigLIP-style tower on 32 px tiles (patches of 8 px, pixel-shuffled by 2: 4
    image tokens a tile); an image is split into tiles of 32 px after resizing to at most 64 px, plus a global one."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _tokenizer(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"])
    vision = Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=_text_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=False,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=VISION_CHAT_TEMPLATE
    )
    torch.manual_seed(seed)
    return _save(dest, Idefics3ForConditionalGeneration(config), processor)


@built_once
def build_tiny_qwen2_vl(dest: Path, seed: int = 0) -> Path:
    """Qwen2-VL's shape (multimodal rotary positions, M-RoPE): a 2-layer tower on patches of 14 px merged 2x2, images
    resized to 56-112 px. Saved with its tokenizer and image processor but no processor: transformers' Qwen2-VL
    processor needs a video processor, which needs torchvision (`qwen2_vl_inputs` does the processor's work)."""
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    text = _text_config(tokenizer).to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": TEXT_WIDTH,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    image_processor.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def qwen2_vl_inputs(tokenizer: Any, image_processor: Any, images: list[Any], text: str) -> dict[str, Any]:
    """What Qwen2-VL's processor makes of one user message of `images` then `text`: the image processor's tensors,
    the prompt with each image's pad token repeated once per merged patch, and the tokens' types (1: image)."""
    import torch

    pads = []
    tensors: dict[str, Any] = {}
    if images:
        tensors = dict(image_processor(images=images, return_tensors="pt"))
        pads = (tensors["image_grid_thw"].prod(-1) // 4).tolist()
    vision = "".join("<|vision_start|>" + "<|image_pad|>" * count + "<|vision_end|>" for count in pads)
    prompt = f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    types = (ids == image_token).to(torch.int)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types, **tensors}


BUILDERS = {"llava": build_tiny_llava, "llava-next": build_tiny_llava_next, "idefics3": build_tiny_idefics3}


def tiny_vlm(family: str) -> Path:
    """The directory of the tiny checkpoint of `family` (one of `FAMILIES`), built on first use."""
    return BUILDERS[family](cache_root() / f"tiny-{family}-{REVISION}")


def tiny_qwen2_vl() -> Path:
    """The directory of the tiny Qwen2-VL (model, tokenizer and image processor: see `build_tiny_qwen2_vl`)."""
    return build_tiny_qwen2_vl(cache_root() / f"tiny-qwen2-vl-{REVISION}")


if __name__ == "__main__":
    import json

    print(json.dumps({family: str(tiny_vlm(family)) for family in FAMILIES}))
