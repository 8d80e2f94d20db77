"""RewardModelWorker: a tiny random-init Llama reward model, as a plain object and in a WorkerGroup."""

import numpy as np
import pytest
import torch

from rlframe.controller import ResourcePool, WorkerGroup
from rlframe.protocol import DataProto
from rlframe.workers.roles.reward_model import RewardModelWorker
from rlframe.workers.settings import DeviceRequest, RewardModelSettings
from tests.helpers_tokenizer import build_tokenizer



def rm_settings(path, max_length: int = 128, micro_batch_size: int = 2) -> RewardModelSettings:
    return RewardModelSettings(model_path=str(path), device=DeviceRequest(device="cpu"), max_length=max_length,
                               micro_batch_size=micro_batch_size)

PROMPTS = ["What is 12 plus 7?", "Tom has 7 apples.", [{"role": "user", "content": "What is 3 + 4?"}]]
RESPONSES = ["The answer is 19. #### 19", "He has 12 apples.", "7"]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def batch(prompts=PROMPTS, responses=RESPONSES) -> DataProto:
    return DataProto.from_dict(tensors={"uid": torch.arange(len(prompts))},
                               non_tensors={"raw_prompt": prompts, "responses_text": responses})


def reference_scores(rm_path, texts):
    """The RM on each text alone, no padding: what batching must reproduce."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for t in texts]


def test_plain_object(rm_path):
    worker = RewardModelWorker(rm_settings(rm_path))
    text = worker.render(PROMPTS[0], RESPONSES[0])
    assert text == ("<|im_start|>user\nWhat is 12 plus 7?<|im_end|>\n"
                    "<|im_start|>assistant\nThe answer is 19. #### 19<|im_end|>\n")
    assert worker.render(PROMPTS[2], "7") == worker.render("What is 3 + 4?", "7")
    out = worker.compute_rm_score(batch())
    scores = out.batch["rm_scores"]
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    expected = reference_scores(rm_path, [worker.render(p, r) for p, r in zip(PROMPTS, RESPONSES)])
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-5)  # padding is inert
    assert len(set(np.round(expected, 6))) == 3  # the scores do depend on the text


def test_missing_fields_are_named(rm_path):
    worker = RewardModelWorker(rm_settings(rm_path))
    data = DataProto.from_dict(non_tensors={"raw_prompt": ["hi"]})
    with pytest.raises(KeyError, match="responses_text"):
        worker.compute_rm_score(data)


def test_long_inputs_keep_their_end(rm_path):
    worker = RewardModelWorker(rm_settings(rm_path, max_length=16, micro_batch_size=8))
    long_prompt = "apples " * 200
    a = worker.compute_rm_score(batch([long_prompt], ["#### 19"])).batch["rm_scores"]
    b = worker.compute_rm_score(batch(["x " + long_prompt], ["#### 19"])).batch["rm_scores"]
    torch.testing.assert_close(a, b)  # the differing start was cut off, the end kept


def test_plain_text_without_chat_template(rm_path, tmp_path):
    import shutil

    shutil.copytree(rm_path, tmp_path / "rm", dirs_exist_ok=True)
    tokenizer = build_tokenizer()
    saved = tokenizer.chat_template
    try:
        tokenizer.chat_template = None
        tokenizer.save_pretrained(tmp_path / "rm")
    finally:
        tokenizer.chat_template = saved
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / "rm" / name).unlink(missing_ok=True)
    worker = RewardModelWorker(rm_settings(tmp_path / "rm"))
    assert worker.render("Q: 1+1? ", "2") == "Q: 1+1? 2"


def test_in_a_worker_group(ray_session, rm_path):
    pool = ResourcePool([2], cpus_per_bundle=1, name="rm")
    try:
        with WorkerGroup(pool, {"rm": (RewardModelWorker, {"settings": rm_settings(rm_path)})},
                         name="rm", default_timeout_s=300) as group:
            out = group.rm.compute_rm_score(batch())  # 3 rows over 2 ranks: padded, then unpadded
    finally:
        pool.remove()
    assert out.batch["rm_scores"].shape == (3,)
    local = RewardModelWorker(rm_settings(rm_path)).compute_rm_score(batch()).batch["rm_scores"]
    torch.testing.assert_close(out.batch["rm_scores"], local, rtol=1e-4, atol=1e-5)
