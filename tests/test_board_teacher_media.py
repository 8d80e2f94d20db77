"""The board's Train tab knows the teacher and the media columns (issues 40 and 41).

The teacher folder (teacher.path) and the distillation loss (distillation.loss_mode, the schema's own choices)
become overrides as the judge's fields do, and Preview validates them with main's checks; a teacher path from
outside the workspace (`../../etc`, a symbolic link out of it, a link inside the folder, one in the YAML) is
refused before anything reads it, as Chat's and Export's paths are. A data file's video and audio columns are
found (by name, else by what they hold), proposed in the Data box's drop-downs, and passed as data.video_key /
data.audio_key. The labels exist in English and Chinese. Real parts throughout: the loader reads the files, the
Board previews with main's checks, the page is served and driven in headless Chromium where it is installed.
"""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from rlframe.board import forms
from rlframe.board.actions import Board
from rlframe.board.datafiles import inspect_data
from rlframe.board.i18n import TEXT, text
from rlframe.board.security import BoardError

PROMPT = [{"role": "user", "content": "<video><audio>What moves, and what do you hear?"}]


def media_parquet(path):
    """The verl layout with one video and one audio per row, under the default column names."""
    frame = pd.DataFrame({"prompt": [PROMPT, PROMPT], "answer": ["a circle", "a square"],
                          "videos": [["clips/0.avi"], ["clips/1.mp4"]], "audios": [["tones/0.wav"], ["tones/1.wav"]],
                          "data_source": ["media", "media"]})
    frame.to_parquet(path)
    return path


# ------------------------------------------------------------------ the Data box: video and audio columns


def test_video_and_audio_columns_are_proposed(tmp_path):
    info = inspect_data(media_parquet(tmp_path / "media.parquet"))
    assert info.columns == ["prompt", "answer", "videos", "audios", "data_source"]
    assert (info.prompt, info.answer, info.images, info.videos, info.audios) == ("prompt", "answer", "", "videos",
                                                                                   "audios")
    # singular names, beside images
    rows = [{"question": "<image><video><audio>?", "image": ["a.png"], "video": ["b.avi"], "audio": ["c.wav"],
             "solution": "x"}]
    (tmp_path / "singular.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = inspect_data(tmp_path / "singular.jsonl")
    assert (info.prompt, info.answer, info.images, info.videos, info.audios) == ("question", "solution", "image",
                                                                                   "video", "audio")
    # other names: found by what the rows hold (verl's {"video": ...} items, {"array", "sampling_rate"} audios);
    # a datasets Image ({"bytes", "path": x.png}) is neither, and no media column is proposed as the answer
    rows = [{"prompt": "<video><audio>?", "clips": [{"video": "a.avi", "fps": 2.0}],
             "sound": [{"array": [0.0, 0.1], "sampling_rate": 8000}], "pics": [{"bytes": None, "path": "p.png"}]},
            {"prompt": "<video><audio>?", "clips": ["b.MP4"], "sound": ["d.wav"], "pics": [{"bytes": None, "path": "q.png"}]}]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = inspect_data(tmp_path / "other.jsonl")
    assert (info.videos, info.audios, info.images) == ("clips", "sound", "")
    assert info.answer == "pics"  # (the only column left: the user changes it in the drop-down)
    # a text file has no media columns
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2", "notes": ["x.txt"]}) + "\n")
    info = inspect_data(tmp_path / "plain.jsonl")
    assert (info.images, info.videos, info.audios, info.answer) == ("", "", "", "answer")


# ------------------------------------------------------------------ the form: overrides


def test_teacher_loss_mode_video_and_audio_become_overrides():
    from rlframe.algos.distillation import DISTILLATION_LOSSES
    from rlframe.config.teacher import LOSS_MODES

    form = forms.TrainForm(recipe="opd_math", teacher_path="/ws/runs/sft/hf_model", distillation_loss_mode="jsd",
                           video_key="clips", audio_key="sound", image_key="frames", judge_model="judge")
    assert forms.form_overrides(form) == ["recipe=opd_math", "data.image_key=frames", "data.video_key=clips",
                                          "data.audio_key=sound", "reward.judge.model=judge",
                                          "teacher.path=/ws/runs/sft/hf_model", "distillation.loss_mode=jsd"]
    owned = forms.owned_keys(form)
    assert {"teacher.path", "distillation.loss_mode", "data.video_key", "data.audio_key"} <= owned
    # empty (or blank) fields add nothing: the recipe's values stand
    blank = forms.TrainForm(teacher_path="  ", distillation_loss_mode="", video_key="", audio_key="")
    assert forms.form_overrides(blank) == ["recipe=grpo_math"]
    assert not {"teacher.path", "distillation.loss_mode", "data.video_key"} & forms.owned_keys(blank)
    # the YAML's teacher.path is the form's when the box is set (skipped), its own otherwise
    composed = {"teacher": {"path": None}, "distillation": {"loss_mode": "k1"}}
    text_yaml = "teacher:\n  path: /elsewhere\ndistillation:\n  loss_mode: k3\n"
    assert forms.yaml_overrides(text_yaml, composed, owned) == []
    assert forms.yaml_overrides(text_yaml, composed, forms.owned_keys(blank)) == ["teacher.path=/elsewhere",
                                                                                  "distillation.loss_mode=k3"]
    # the loss modes are the schema's list (k1 and the registered loss terms), not a copy
    assert forms.loss_modes() == tuple(LOSS_MODES) and "k1" in forms.loss_modes()
    assert set(DISTILLATION_LOSSES) == set(forms.loss_modes()) - {"k1"}
    # the teacher folders the board confines: the box, else the YAML's teacher.path, and every routed teacher
    routed = "teachers:\n  geo: {path: /t/geo, data_sources: [geo]}\nteacher: {path: /t/yaml}\n"
    assert forms.teacher_paths(forms.TrainForm(extra_yaml=routed)) == [("teachers.geo.path", "/t/geo"),
                                                                       ("teacher.path", "/t/yaml")]
    assert forms.teacher_paths(forms.TrainForm(teacher_path="/t/box", extra_yaml=routed)) == [
        ("teacher.path", "/t/box"), ("teachers.geo.path", "/t/geo")]
    assert forms.teacher_paths(forms.TrainForm(extra_yaml="a: [")) == []  # (the YAML's error is the preview's)


def test_the_page_round_trips_the_new_fields():
    from rlframe.board.app import FORM_FIELDS, form_of, page_values

    form = forms.TrainForm(teacher_path="sft", distillation_loss_mode="k3", video_key="videos", audio_key="audios")
    values = page_values(form)
    assert len(values) == len(FORM_FIELDS) and form_of(values) == form
    empty = dict(zip(FORM_FIELDS, values)) | {"teacher_path": None, "distillation_loss_mode": None,
                                               "video_key": None, "audio_key": None}
    again = form_of([empty[name] for name in FORM_FIELDS])
    assert (again.teacher_path, again.distillation_loss_mode, again.video_key, again.audio_key) == ("", "", "", "")


def test_labels_in_both_languages():
    for key, zh_has in (("teacher", "教师"), ("teacher_path", "教师"), ("distillation_loss_mode", "蒸馏"),
                        ("video_col", "视频"), ("audio_col", "音频")):
        en, zh = TEXT[key]
        assert en and en.isascii() and zh_has in zh and text(key, "zh") == zh and text(key) == en
    # every label of the table: an English and a Chinese text
    for key, (en, zh) in TEXT.items():
        assert en.strip() and zh.strip(), key
        assert any("\u4e00" <= ch <= "\u9fff" for ch in zh) or zh == en, key  # (codes such as k in pass@k)


# ------------------------------------------------------------------ Preview: validated, and confined


@pytest.fixture()
def board(tmp_path, monkeypatch):
    ws = tmp_path / "ws"
    monkeypatch.chdir(tmp_path)  # relative paths are read from where the board was started
    return Board(ws)


def refused(board: Board, form: forms.TrainForm, needle: str) -> str:
    preview, _ = board.preview(form, "teacher-run")
    assert not preview.ok and needle in preview.error, preview.error
    assert preview.error.startswith("error: ") and preview.composed is None  # refused before composing
    assert not (board.workspace / "runs" / "teacher-run").exists()
    return preview.error


def test_a_teacher_outside_the_workspace_is_refused(board, tiny_model_dir, tmp_path):
    ws = board.workspace
    student = {"model_source": "folder", "model_path": str(tiny_model_dir)}
    # an attacker's paths: up and out, absolute, through the workspace's own name
    for path in ("../../etc", "/etc", f"{ws}/../../etc", "ws/../../../etc", str(tiny_model_dir)):
        error = refused(board, forms.TrainForm(**student, teacher_path=path), "outside the folders the board reads")
        assert f"the teacher folder '{path}'" in error and "Fix:" in error
    # a symbolic link in the workspace that leads out of it
    (ws / "exports" / "linked").symlink_to(tiny_model_dir)
    error = refused(board, forms.TrainForm(**student, teacher_path=str(ws / "exports" / "linked")), "symbolic link")
    assert "which the board does not follow" in error and "Fix: copy the files into the workspace" in error
    # a real folder in the workspace holding a link out (its config.json)
    inner = ws / "exports" / "inner"
    inner.mkdir()
    (inner / "config.json").symlink_to(tiny_model_dir / "config.json")
    refused(board, forms.TrainForm(**student, teacher_path=str(inner)), "config.json is a symbolic link")
    # the YAML's teachers too (the box empty)
    routed = "teachers:\n  geo: {path: /etc, data_sources: [geo]}\n"
    error = refused(board, forms.TrainForm(**student, extra_yaml=routed), "outside the folders the board reads")
    assert "the YAML's teachers.geo.path '/etc'" in error
    refused(board, forms.TrainForm(**student, extra_yaml="teacher:\n  path: ../../etc\n"), "teacher.path '../../etc'")
    # Launch starts nothing, Try it scores nothing, Show YAML shows the refusal
    preview, _, message = board.launch(forms.TrainForm(**student, teacher_path="/etc"), "teacher-run")
    assert not preview.ok and message.startswith("not started") and not (ws / "runs" / "teacher-run").exists()
    result = board.try_reward(forms.TrainForm(**student, teacher_path="/etc"))
    assert "outside the folders the board reads" in result.error and result.table.empty
    with pytest.raises(BoardError, match="outside the folders the board reads"):
        board.full_yaml(forms.TrainForm(**student, teacher_path="/etc"), "")


def test_a_teacher_in_the_workspace_is_previewed_with_mains_checks(board, tiny_model_dir):
    ws = board.workspace
    shutil.copytree(tiny_model_dir, ws / "runs" / "sft" / "hf_model")
    student = {"model_source": "folder", "model_path": str(tiny_model_dir)}
    # a run name means its final model; the override carries the folder's full path
    preview, _ = board.preview(forms.TrainForm(**student, teacher_path="sft", distillation_loss_mode="k3"), "opd")
    assert preview.ok, preview.error
    teacher = ws / "runs" / "sft" / "hf_model"
    assert f"teacher.path={teacher}" in preview.args and "distillation.loss_mode=k3" in preview.args
    assert preview.composed["teacher"]["path"] == str(teacher)
    assert preview.composed["distillation"]["loss_mode"] == "k3"
    assert "memory plan" in preview.plan_table
    # main's checks name the key: a loss the schema lacks, a folder that holds no model
    preview, _ = board.preview(forms.TrainForm(**student, teacher_path="sft", distillation_loss_mode="kl9"), "opd",
                               deep=False)
    assert not preview.ok and "distillation.loss_mode" in preview.error and "kl9" in preview.error
    (ws / "uploads" / "empty").mkdir()
    preview, _ = board.preview(forms.TrainForm(**student, teacher_path=str(ws / "uploads" / "empty")), "opd",
                               deep=False)
    assert not preview.ok and "teacher.path" in preview.error and "not a model folder" in preview.error
    # the video and audio columns reach the configuration
    preview, _ = board.preview(forms.TrainForm(**student, video_key="clips", audio_key="sound"), "media", deep=False)
    assert preview.ok, preview.error
    assert (preview.composed["data"]["video_key"], preview.composed["data"]["audio_key"]) == ("clips", "sound")


# ------------------------------------------------------------------ the page in a browser


def test_the_page_proposes_media_columns_and_refuses_an_outside_teacher(browser, tmp_path, monkeypatch):
    from test_board import board_page, free_port, set_value, text_of, upload, wait_text

    from rlframe.board.__main__ import parse, serve

    monkeypatch.chdir(tmp_path)
    ws, port = tmp_path / "ws", free_port()
    media_parquet(tmp_path / "media.parquet")
    app, url = serve(parse(["--port", str(port), "--workspace", str(ws)]), block=False)
    with board_page(browser, app, tmp_path) as page:
        page.goto(url)
        page.wait_for_selector("#preview")
        page.click("#data_box")
        upload(page, "#train_upload", tmp_path / "media.parquet")
        wait_text(page, "#data_message", "media.parquet: 2 rows, columns prompt, answer, videos, audios, data_source")
        assert (text_of(page, "#video_key"), text_of(page, "#audio_key")) == ("videos", "audios")
        page.click("#teacher_box")
        set_value(page, "#teacher_path", "../../etc")
        page.click("#preview")
        error = wait_text(page, "#validation", "error: the teacher folder '../../etc' is outside the folders")
        assert "data.video_key=videos" in text_of(page, "#command") and "teacher.path=" in text_of(page, "#command")
        assert not error.startswith("valid")
        page.click("#language input")
        page.get_by_role("option", name="zh").click()
        page.get_by_text("视频列").first.wait_for(timeout=10000)
        page.get_by_text("教师模型目录").first.wait_for(timeout=10000)
