"""A tiny random-init Qwen2-Audio with its processor, built locally (no hub): the audio-language test model.

`model.path=tiny-qwen2-audio` names it (rlframe/models/provision.py): the folder is written once into
the cache (`$RLFRAME_CACHE/models/tiny-qwen2-audio-v2`) with `build_tiny_audio_dir`, atomically. It is
the same architecture as Qwen/Qwen2-Audio-7B-Instruct (`Qwen2AudioForConditionalGeneration`: a Whisper-
style encoder, two convolutions (the second stride 2) then average pooling by 2, a linear projector,
and a Qwen2 language model with 1-D rotary positions, its LM head apart from the embedding) at toy size:
2 encoder layers of width 32, 2 decoder layers, hidden 64. Its window is Qwen2-Audio's 30 s: the Whisper
feature extractor pads every audio to 30 s = 3000 mel frames (hop 160 at 16000 Hz), the encoder's
`max_source_positions` is 1500. vLLM's Qwen2-Audio takes no other window (its input schema fixes 3000
frames), so a shorter one would run on HF generate only. An audio of n samples fills ceil(n / 160) frames
and takes ((f - 1) // 2 + 1 - 2) // 2 + 1 tokens (1 s = 100 frames: 25 tokens), whatever the window.
Its weights are random (seeded: seed 1, whose first GRPO steps at the test sizes draw responses of
different length-rewards, so that step 1 updates on both engines), so it learns nothing useful; it exists
so that the audio dataflow (decode -> resample -> Whisper features -> <|AUDIO|> tokens -> log-probs, update,
rollout, weight sync) runs and is tested on a CPU in seconds.

The tokenizer is the tiny VLM's byte-level BPE (rlframe/models/tiny_vlm.py) with Qwen2-Audio's special
tokens (`<|audio_bos|>`, `<|AUDIO|>`, `<|audio_eos|>`) and a chat template that renders an
{"type": "audio"} content entry as `<|audio_bos|><|AUDIO|><|audio_eos|>` (Qwen2-Audio-Instruct's own
template adds "Audio 1: " before it); rlframe/data/audio.py expands each `<|AUDIO|>` to the audio's
token count. The folder also holds transformers' `Qwen2AudioProcessor` (processor_config.json), which
vLLM's qwen2_audio model reads.
"""

from __future__ import annotations

from pathlib import Path

NAME = "tiny-qwen2-audio"
FOLDER = "tiny-qwen2-audio-v2"  # bump the suffix when the builder changes what it writes

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'audio' or 'audio' in item %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "How many beeps do you hear? Which tone is higher, the first or the second? Answer 1 or 2.",
    "Put your final answer inside \\boxed{}. The answer is \\boxed{3}. beep beeps tone tones sound audio",
    "first second higher lower pitch count listen",
    "user assistant system 0 1 2 3 4 5 6 7 8 9 There are I hear the",
] * 20
WINDOW_SECONDS = 30  # Qwen2-Audio's (the only window vLLM's Qwen2-Audio takes)
SAMPLING_RATE = 16000
MEL_BINS = 128


def build_tokenizer(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlframe.models.tiny_vlm import SPECIAL_TOKENS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + AUDIO_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        bos_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_feature_extractor(window_seconds: int = WINDOW_SECONDS):
    """Whisper's log-mel features (128 bins, hop 160, 16000 Hz) over a window of `window_seconds`."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, hop_length=160,
                                   chunk_length=window_seconds, n_fft=400)


def tiny_audio_config(tokenizer, *, hidden_size: int = 64, layers: int = 2, encoder_layers: int = 2,
                      window_seconds: int = WINDOW_SECONDS):
    """The toy Qwen2-Audio config. The LM head is its own matrix (tie_word_embeddings false): transformers 5
    keeps Qwen2-Audio's head apart from the embedding even when the config says tied (the v1 folder held two
    different matrices), while vLLM ties them, so a tied config made the two engines run different models."""
    from transformers import Qwen2AudioConfig

    heads = 2
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=hidden_size,
                intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=MEL_BINS, encoder_layers=encoder_layers,
                 encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 max_source_positions=window_seconds * SAMPLING_RATE // 160 // 2)
    return Qwen2AudioConfig(audio_config=audio, text_config=text,
                            audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"), tie_word_embeddings=False)


def build_tiny_audio_dir(out_dir: str | Path, seed: int = 1, window_seconds: int = WINDOW_SECONDS) -> Path:
    """Write the tiny Qwen2-Audio (fp32 safetensors), its tokenizer, feature extractor and processor into `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_audio_config(tokenizer, window_seconds=window_seconds)
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    Qwen2AudioProcessor(feature_extractor=build_feature_extractor(window_seconds), tokenizer=tokenizer,
                        chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
