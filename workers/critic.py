"""The critic for PPO: a value head on an HF causal-LM backbone, trained with the clipped value loss.

The model is the checkpoint's backbone (`AutoModel`, which loads a `...ForCausalLM` checkpoint
without its LM head) plus our own `Linear(hidden, 1)` value head. We do not use
`AutoModelForTokenClassification(num_labels=1)`: not every causal-LM architecture registers a
token-classification class, and those that do add a dropout layer and name the head differently
per architecture. `AutoModel` exists for every HF LM, and one head we own is one thing to read.
The head starts at zero, so the first values are exactly 0 (a neutral guess for rewards near 0-1);
the backbone starts from `critic.model_path` (default: the actor's model).

V[i, t] is the value of the state *before* response token t (the hidden state of the previous
column), aligned with the log-probs of the actor: values and log-probs share one [B, R] layout.

`CriticModel` does the work on one rank (usable as a plain object, without Ray); `CriticWorker` is
the role class the driver calls through the worker group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlframe.algos import compute_value_loss
from rlframe.controller import Dispatch, register
from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.actor import MetricSums, _all_reduce_sum, _world_size, global_agg_kwargs
from rlframe.workers.model import needs_sharding, shard_model, trim_padding_columns


@dataclass
class CriticSettings:
    """What `CriticModel.update` needs from the config."""

    lr: float = 1e-5
    head_lr: float | None = 1e-3  # the value head's own LR (None: lr)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    mini_batch_size: int = 8  # sequences per optimiser step, on this rank
    micro_batch_size: int = 4  # sequences per forward/backward
    forward_micro_batch_size: int = 16  # sequences per forward in compute_values
    epochs: int = 1
    shuffle: bool = True
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


class ValueModel(nn.Module):
    """backbone (HF `AutoModel`) -> hidden states [B, S, H] -> value head -> values [B, S]."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone  # named like the causal LM's backbone, so decoder_layers() finds model.layers
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def build_value_model(path: str, profile: DeviceProfile, *, gradient_checkpointing: bool = False,
                      trust_remote_code: bool = False) -> ValueModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation=profile.attn_implementation,
                                         trust_remote_code=trust_remote_code)
    backbone.config.use_cache = False
    if gradient_checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ValueModel(backbone, backbone.config.hidden_size)


def forward_response_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            position_ids: torch.Tensor, response_width: int) -> torch.Tensor:
    """V of each response position, [B, response_width]; shared padding columns trimmed, zero-padded back."""
    start, end = trim_padding_columns(attention_mask, response_width)
    prompt_width = input_ids.size(1) - response_width
    values = model(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, start:end],
                   position_ids=position_ids[:, start:end])
    response_values = values[:, prompt_width - start - 1: end - start - 1]
    pad = response_width - (end - prompt_width)
    return torch.nn.functional.pad(response_values, (0, pad)) if pad else response_values


class CriticModel:
    """One rank's (possibly FSDP-sharded) value model and its optimiser."""

    def __init__(self, model_path: str, profile: DeviceProfile, settings: CriticSettings, *,
                 gradient_checkpointing: bool = False, trust_remote_code: bool = False):
        self.profile = profile
        self.device = torch.device(profile.device)
        self.settings = settings
        self.model = build_value_model(model_path, profile, gradient_checkpointing=gradient_checkpointing,
                                       trust_remote_code=trust_remote_code)
        if profile.is_gpu:
            self.model.to(self.device)
        self.sharded = needs_sharding(profile)
        if self.sharded:
            shard_model(self.model, profile)
        self.model.train()
        head = list(self.model.value_head.parameters())
        head_ids = {id(p) for p in head}
        groups = [{"params": [p for p in self.model.parameters() if id(p) not in head_ids], "lr": settings.lr},
                  {"params": head, "lr": settings.head_lr or settings.lr}]
        self.optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=tuple(settings.betas),
                                           weight_decay=settings.weight_decay)
        warmup = max(settings.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.optimizer_steps = 0  # these two, with model/optimizer/scheduler, are what checkpoints save
        self.consecutive_skips = 0

    def _inputs(self, micro: DataProto) -> dict[str, torch.Tensor]:
        return {k: micro.batch[k].to(self.device) for k in ("input_ids", "attention_mask", "position_ids")}

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        self.model.eval()
        width = data.batch["responses"].size(1)
        values = [forward_response_values(self.model, **self._inputs(micro), response_width=width).cpu()
                  for micro in data.split(self.settings.forward_micro_batch_size)]
        self.model.train()
        return torch.cat(values) * data.batch["response_mask"].to(torch.float32)

    def update(self, data: DataProto, seed: int = 0) -> dict[str, float]:
        """Epochs x mini-batches of clipped value regression onto `returns`.

        Normalisers are counted over the whole mini-batch on all ranks (as in the actor), so the
        summed micro-batch losses equal the global mini-batch loss; the loss is scaled by the world
        size because FSDP averages gradients over ranks.
        """
        cfg = self.settings
        world = _world_size()
        width = data.batch["responses"].size(1)
        recorded = MetricSums()
        record = recorded.record

        start = time.perf_counter()
        for epoch in range(cfg.epochs):
            for mini in data.mini_batches(cfg.mini_batch_size, shuffle=cfg.shuffle, seed=seed * 1000 + epoch):
                agg = global_agg_kwargs(mini, cfg.loss_agg_mode, width)
                self.optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for micro in mini.split(cfg.micro_batch_size):
                    values = forward_response_values(self.model, **self._inputs(micro), response_width=width)
                    loss, metrics = compute_value_loss(
                        values, micro.batch["values"].to(self.device), micro.batch["returns"].to(self.device),
                        micro.batch["response_mask"].to(self.device), cfg.cliprange_value, agg=agg)
                    (loss * world).backward()
                    loss_sum += float(loss.detach())
                    for key, value in metrics.items():
                        record(f"critic/{key}", value)
                record("critic/vf_loss", _all_reduce_sum(loss_sum))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                record("critic/grad_norm", grad_norm)
                if torch.isfinite(torch.tensor(grad_norm)):
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer_steps += 1
                    self.consecutive_skips = 0
                else:  # skip rather than poison the critic (the actor stops after too many in a row)
                    self.optimizer.zero_grad(set_to_none=True)
                    self.consecutive_skips += 1
        metrics = recorded.means()
        for key in ("critic/vf_clipfrac", "critic/vpred_mean"):
            metrics[key] = _all_reduce_sum(metrics[key]) / world
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        metrics["timing/critic_update_rank0"] = time.perf_counter() - start
        return metrics


class CriticWorker:
    """The critic role: `compute_values` and `update_critic`, data-parallel over the group's ranks."""

    def __init__(self, cfg: dict, model_path: str):
        from rlframe.workers.fsdp_workers import _profile

        self.cfg = cfg
        critic, rollout = cfg["critic"], cfg["rollout"]
        world = _world_size()
        self.profile = _profile(cfg)
        optim = critic["optim"]
        mini = critic["ppo_mini_batch_size"] or cfg["actor"]["ppo_mini_batch_size"]
        self.settings = CriticSettings(
            lr=optim["lr"], head_lr=critic["head_lr"], weight_decay=optim["weight_decay"], betas=tuple(optim["betas"]),
            warmup_steps=optim["warmup_steps"], grad_clip=optim["grad_clip"],
            mini_batch_size=mini * rollout["n"] // world,
            micro_batch_size=critic["ppo_micro_batch_size_per_device"],
            forward_micro_batch_size=critic["forward_micro_batch_size_per_device"], epochs=critic["ppo_epochs"],
            shuffle=cfg["actor"]["shuffle"], cliprange_value=critic["cliprange_value"],
            loss_agg_mode=critic["loss_agg_mode"])
        # model_path: the critic's own checkpoint when critic.model_path is set, else the actor's
        # (the driver resolves embedded names before the workers start)
        self.critic = CriticModel(model_path, self.profile, self.settings,
                                  gradient_checkpointing=cfg["model"]["gradient_checkpointing"],
                                  trust_remote_code=cfg["model"]["trust_remote_code"])

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"values": self.critic.compute_values(data)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        metrics = self.critic.update(data, seed=self.cfg["trainer"]["seed"] + int(data.meta_info.get("step", 0)))
        return DataProto(batch=None, non_tensor_batch={}, meta_info={"metrics": metrics})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> dict:
        """Value model (backbone + head), optimizer, scheduler and counters into `out_dir` (a collective)."""
        from rlframe.workers.checkpointing import save_policy

        start = time.perf_counter()
        save_policy(self.critic, out_dir)
        return {"seconds": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, in_dir: str) -> dict:
        from rlframe.workers.checkpointing import load_policy

        start = time.perf_counter()
        info = load_policy(self.critic, in_dir)
        return {**info, "seconds": time.perf_counter() - start}
