"""`RewardModelWorker`: a model-based reward from an HF sequence-classification reward model.

The reward model (RM) is any ``AutoModelForSequenceClassification`` checkpoint with ``num_labels=1``
(e.g. a Skywork / InternLM / ArmoRM-style scalar RM). It runs in its own worker group::

    group = WorkerGroup(pool, {"rm": (RewardModelWorker, {"settings": RewardModelSettings(model_path=path)})})
    scores = group.rm.compute_rm_score(batch)          # DataProto with rm_scores [B]
    batch = batch.union(scores)

or as a plain object in one process (``RewardModelWorker(settings).compute_rm_score(batch)``).

Input contract (non-tensor fields of the ``DataProto``, one per row):

- ``raw_prompt``: the prompt as the user saw it: a ``str`` (taken as one user message) or a chat
  list ``[{"role": ..., "content": ...}, ...]``;
- ``responses_text``: the policy's response, decoded to text (without the policy's EOS/pad tokens).

The text is retokenized with the RM's OWN tokenizer (the policy's token ids mean nothing to a
different vocabulary): with its chat template when it has one (messages + the response as the
assistant turn), else ``prompt + response`` as plain text. Sequences longer than ``max_length``
keep their END (left truncation: the response is what is being judged).

Output: a ``DataProto`` with one tensor, ``rm_scores`` (float32 [B]), the RM's scalar per row.
Combine it with rule-based rewards on the driver (e.g. ``reward = rule + rm_weight * rm_scores``).

Settings (`RewardModelSettings`, from the config's ``reward_model`` section): ``max_length``,
``micro_batch_size``, ``dtype``, ``trust_remote_code``; the device from ``trainer.device``.
"""

from __future__ import annotations

import torch

from rlframe.controller import Dispatch, register
from rlframe.device import detect_profile
from rlframe.protocol import DataProto, render_for_scoring
from rlframe.workers.settings import RewardModelSettings


class RewardModelWorker:
    """Scores (prompt, response) texts with a scalar sequence-classification reward model."""

    def __init__(self, settings: RewardModelSettings):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_path, trust = settings.model_path, settings.trust_remote_code
        self.max_length = settings.max_length
        self.micro_batch_size = settings.micro_batch_size
        self.profile = detect_profile(settings.device.device, settings.dtype, "sdpa", rollout_engine="hf")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust)
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:  # many RMs ship without one: EOS pads
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=1, dtype=self.profile.dtype,
            attn_implementation=self.profile.attn_implementation, trust_remote_code=trust)
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {model_path} has num_labels={self.model.config.num_labels}; "
                             f"a scalar reward model needs num_labels=1")
        # The model finds each row's last real token through pad_token_id: it must be set.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.profile.device).eval()

    def render(self, prompt, response: str) -> str:
        """The text the RM scores (protocol.render_for_scoring: its chat template, else the concatenation)."""
        return render_for_scoring(self.tokenizer, prompt, response)

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """The RM's scalar for each full text, float32 [N] on the CPU."""
        scores = []
        for start in range(0, len(texts), self.micro_batch_size):
            chunk = texts[start:start + self.micro_batch_size]
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_length, add_special_tokens=False)
            enc = {k: v.to(self.profile.device) for k, v in enc.items()}
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        missing = [k for k in ("raw_prompt", "responses_text") if k not in data.non_tensor_batch]
        if missing:
            raise KeyError(f"compute_rm_score needs the non-tensor fields raw_prompt and responses_text; "
                           f"missing: {missing} (have: {sorted(data.non_tensor_batch)})")
        texts = [self.render(p, r) for p, r in zip(data.non_tensor_batch["raw_prompt"],
                                                   data.non_tensor_batch["responses_text"])]
        return DataProto.from_dict(tensors={"rm_scores": self.score_texts(texts)})
