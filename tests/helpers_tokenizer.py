"""A tiny real tokenizer for tests: byte-level BPE trained in-process, ChatML chat template.

No hub access: ``build_tokenizer()`` trains a ~300-token BPE on a few strings (byte-level, so any
text tokenizes) and wraps it in ``transformers.PreTrainedTokenizerFast`` with the special tokens
and chat template of SmolLM2-style ChatML models.
"""

from __future__ import annotations

from functools import lru_cache

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "Tom has 7 apples and buys 5 more. How many apples does Tom have now?",
    "Put your final answer as a number inside \\boxed{}, for example \\boxed{5}.",
    "What is 12 plus 7? The answer is 19. #### 19",
    "user assistant system 0 1 2 3 4 5 6 7 8 9",
] * 20


@lru_cache(maxsize=None)
def build_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>",
                                        eos_token="<|im_end|>", bos_token=None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
