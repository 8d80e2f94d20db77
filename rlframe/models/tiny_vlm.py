"""A tiny random-init Qwen2.5-VL with its processor, built locally (no hub): the vision-language test model.

`model.path=tiny-qwen2.5-vl` names it (rlframe/models/provision.py): the folder is written once into
the cache (`$RLFRAME_CACHE/models/tiny-qwen2.5-vl-v2`) with `build_tiny_vlm_dir`, atomically. It is
the same architecture as Qwen/Qwen2.5-VL-3B-Instruct (`Qwen2_5_VLForConditionalGeneration`: a ViT with
2x2 patch merging, M-RoPE in the language model) at toy size: 2 vision blocks, 2 decoder layers,
hidden 64. Its weights are random (seeded), so it learns nothing useful; it exists so that the
multimodal dataflow (processor -> pixel_values / image_grid_thw -> 3-D rotary positions -> log-probs,
update, rollout, weight sync) runs and is tested on a CPU in seconds.

The tokenizer is a byte-level BPE trained in-process on a small corpus, with Qwen's special tokens
(`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`)
and a Qwen2-VL chat template (a message's content may be a list of {"type": "image"} / {"type":
"text", "text": ...} / {"type": "video"} entries; an image entry renders as
`<|vision_start|><|image_pad|><|vision_end|>`, which the processor expands to one `<|image_pad|>` per
merged patch; a video entry as `<|vision_start|><|video_pad|><|vision_end|>`, one `<|video_pad|>` per
merged patch of each temporal patch of 2 frames). The image processor is
transformers' PIL backend (`Qwen2VLImageProcessorPil`): torchvision is not needed.
"""

from __future__ import annotations

from pathlib import Path

NAME = "tiny-qwen2.5-vl"
FOLDER = "tiny-qwen2.5-vl-v2"  # bump the suffix when the builder changes what it writes

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
_CORPUS = [
    "How many red circles are in the image? How many blue squares? What colour is the triangle?",
    "Put your final answer inside \\boxed{}. The answer is \\boxed{3}. red green blue yellow",
    "circle circles square squares triangle triangles shape shapes colour color count",
    "user assistant system 0 1 2 3 4 5 6 7 8 9 There are I see the picture",
] * 20
# Small enough that every image of the shapes data (112 x 112 px -> 8 x 8 patches) costs 16 tokens.
IMAGE_MIN_PIXELS = 28 * 28
IMAGE_MAX_PIXELS = 224 * 224


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        bos_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor(min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS):
    """Qwen2-VL's image processor, PIL backend. (transformers' `Qwen2_5_VLProcessor` also wants a video
    processor, which needs torchvision; rlframe expands the image placeholders itself, see
    rlframe/data/multimodal.py, so the image processor and the tokenizer are all it needs.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def tiny_vlm_config(tokenizer, *, hidden_size: int = 64, layers: int = 2, vision_depth: int = 2):
    from transformers import Qwen2_5_VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    heads = 2
    half_head_dim = hidden_size // heads // 2
    # M-RoPE: the rotary frequencies of a head are split between time, height and width positions.
    mrope_section = [half_head_dim - 2 * (half_head_dim * 3 // 8), half_head_dim * 3 // 8, half_head_dim * 3 // 8]
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": mrope_section},
                bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                tie_word_embeddings=True)
    vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=hidden_size,
                  fullatt_block_indexes=[vision_depth - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)


def build_tiny_vlm_dir(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL (fp32 safetensors), its tokenizer and processor into `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_vlm_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_image_processor().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
