"""Rollout with HF `generate`: the fallback engine when vLLM is not installed.

The engine keeps its own unsharded copy of the policy (generation calls the model a different
number of times on each rank, which a sharded model cannot do), refreshed by `load_weights`. With
`lora` (adapter-only weight sync) the copy carries the same LoRA layers as the trainer and
`load_adapter` refreshes only their A and B.

Rows that carry a `sample_seed` (`rollout.seed_each_sample`, rlframe/rng.py) are sampled as vLLM samples
them: each from its own generator seeded by that number, so a response depends on its seed alone, not on
the other rows of the batch or on the process's torch RNG (`SeededSampling`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import (LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.engine.hf_model import build_causal_lm
from rlframe.protocol import build_rollout_batch
from rlframe.workers.settings import LoraSettings, SamplingSettings
from rlframe.workers.weight_broadcast import checksums_of


class SeededSampling(LogitsProcessor):
    """Sampling from temperature / top-k / top-p with one torch generator per row, run inside greedy decoding.

    Gumbel-max: argmax(log_softmax(z) + G), G = -log(-log(U)), U ~ uniform, is a draw from softmax(z); with
    U from the row's own generator (seeded by its `sample_seed`) the row's tokens depend on that seed alone.
    The warpers are transformers' own, in the order its sampling applies them. Returned scores are only
    the argmax's input: the recorded log-probs come from the raw logits (`output_logits`).
    """

    def __init__(self, sampling: SamplingSettings, seeds, device):
        self.warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        uniform = torch.stack([torch.rand(scores.size(-1), generator=g, device=scores.device, dtype=torch.float64)
                               for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-300)))
        return torch.log_softmax(scores.double(), dim=-1) + gumbel


class HFRollout:
    def __init__(self, model_path: str, profile: DeviceProfile, *, eos_token_ids: list[int], pad_token_id: int,
                 batch_size: int = 64, trust_remote_code: bool = False, lora: LoraSettings | None = None):
        self.profile = profile
        self.model_path = model_path
        self.model = build_causal_lm(model_path, profile, dtype=profile.dtype, trust_remote_code=trust_remote_code)
        if lora is not None:
            from rlframe.workers.engine.lora import apply_lora

            apply_lora(self.model, lora, model_path)  # B = 0: generates as the base until the first sync
        self.model.config.use_cache = True
        self.model.to(profile.device).eval().requires_grad_(False)
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> int:
        """Copy each (name, tensor) into this copy's parameter of that name (`checksum`: nothing to record here,
        weight_checksums reads the copy back)."""
        params = self.model.state_dict()
        loaded = 0
        for name, tensor in weights:
            if name in params:
                params[name].copy_(tensor)
                loaded += 1
        return loaded

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> int:
        """The adapter tensors (A, B) under the trainer's state-dict keys, which are this copy's too."""
        return self.load_weights(weights)

    @torch.no_grad()
    def weight_checksums(self, shapes: dict | None = None) -> dict[str, tuple[float, float]]:
        """The sampled checksums (workers/weight_broadcast.py) of the weights this copy holds, read back from its
        parameters, under the names load_weights takes (the trainer's)."""
        return checksums_of(self.model.state_dict().items())

    @torch.no_grad()
    def generate(self, prompts: DataProto, sampling: SamplingSettings) -> DataProto:
        responses, log_probs = [], []
        for part in prompts.split(self.batch_size):
            r, lp = self._generate_part(part, sampling)
            responses += r
            log_probs += lp
        return build_rollout_batch(prompts, responses, log_probs, sampling.max_new_tokens, self.pad_token_id)

    def _generate_part(self, part: DataProto, sampling: SamplingSettings) -> tuple[list, list]:
        device = self.profile.device
        input_ids = part.batch["input_ids"].to(device)
        attention_mask = part.batch["attention_mask"].to(device)
        kwargs = dict(do_sample=not sampling.greedy, max_new_tokens=sampling.max_new_tokens,
                      eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                      output_logits=True, return_dict_in_generate=True)
        seeds = part.non_tensor_batch.get("sample_seed")
        if not sampling.greedy and seeds is not None:  # one generator per row: greedy decoding of Gumbel-perturbed scores
            kwargs.update(do_sample=False, logits_processor=LogitsProcessorList([SeededSampling(sampling, seeds, device)]))
        elif not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else None)
        kwargs.update(self._image_inputs(part, input_ids))
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        new_tokens = out.sequences[:, input_ids.size(1):]
        # log-probs of the sampled tokens under the temperature-scaled distribution (what the trainer computes)
        logits = torch.stack(out.logits, dim=1).float()
        if not sampling.greedy and sampling.temperature != 1.0:
            logits = logits / sampling.temperature
        token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        responses, log_probs = [], []
        eos = set(self.eos_token_ids)
        for tokens, lps in zip(new_tokens.tolist(), token_log_probs.tolist()):
            length = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            responses.append(tokens[:length])
            log_probs.append(lps[:length])
        return responses, log_probs

    def tokenizer_vocab(self) -> dict:
        """The model folder's token -> id map (read once)."""
        if getattr(self, "_vocab", None) is None:
            from transformers import AutoTokenizer

            self._vocab = AutoTokenizer.from_pretrained(self.model_path).get_vocab()
        return self._vocab

    def _image_inputs(self, part: DataProto, input_ids: torch.Tensor) -> dict:
        """Prompts with images (vision-language models): the rows' pixel inputs in row order, and the
        token types (1 on `<|image_pad|>`) from which the model computes its 3-D rotary positions
        (without them Qwen2-VL's generate falls back to 1-D positions, and disagrees with the trainer)."""
        rows = part.non_tensor_batch.get("multi_modal_inputs")
        if rows is None or all(m is None for m in rows):
            return {}
        from rlframe.workers.engine.hf_model import _stack_pixel_inputs

        config = self.model.config
        if getattr(config, "audio_config", None) is not None and getattr(config, "vision_config", None) is None:
            # Qwen2-Audio: 1-D positions (generate's own), the audio features in row order; the audio tokens
            # (pad, begin, end) are never sampled, for the same reason as the vision tokens below.
            vocab = self.tokenizer_vocab()
            audio_tokens = [config.audio_token_id] + [vocab[t] for t in ("<|audio_bos|>", "<|audio_eos|>") if t in vocab]
            return {**_stack_pixel_inputs(rows, input_ids.device), "suppress_tokens": audio_tokens}
        token_type = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
        # A sampled vision token in a response would ask the trainer's forward for an image that is not
        # there (a random-init model samples them; a trained one gives them ~0 probability): never sample them.
        # The recorded log-probs stay those of the unmodified distribution, as the trainer computes them.
        vision_tokens = [getattr(config, key, None) for key in ("image_token_id", "video_token_id",
                                                                 "vision_start_token_id", "vision_end_token_id")]
        return {**_stack_pixel_inputs(rows, input_ids.device), "mm_token_type_ids": token_type,
                "suppress_tokens": [t for t in vision_tokens if t is not None]}
