"""What the board shows (issue 44): the plots name their series (a legend the user can see: which line is train,
which validation), and Try it shows the user's own frames of a reward's traceback, not rlframe's reward worker.

Through the real served board: the legend in headless Chromium (the Watch tab over a run folder with train and
validation points), the traceback over HTTP (the page's `on_try` call with a reward file that raises in a helper).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from test_board_security import call, form, free_port

RAISING = '''def helper(x):
    return 1 / 0


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return helper(solution_str)
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from rlframe.board.__main__ import parse, serve

    root = tmp_path_factory.mktemp("board-display")
    ws, port = root / "ws", free_port()
    run = ws / "runs" / "curves"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: {total_steps: 4}\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(5):
            m = {"step": step, "val/reward_mean": 0.1 * step + 0.05, "val/accuracy": 0.1 * step}
            if step:
                m.update({"critic/score/mean": 0.1 * step, "critic/accuracy": 0.08 * step, "timing/step": 1.0})
            f.write(json.dumps(m) + "\n")
    app, url = serve(parse(["--port", str(port), "--workspace", str(ws)]), block=False)
    token = url.split("?token=", 1)[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"token {token}"},
                      timeout=300) as client:
        yield {"url": url, "ws": ws, "client": client}
    app.close()


def test_plots_show_which_line_is_which(served, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(served["url"])
    page.wait_for_selector("#preview")
    page.get_by_role("tab", name="Watch").click()
    box = page.locator("#watch_run input").first
    box.fill("curves")
    box.press("Enter")
    labels = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(labels) < 2:
        # each legend label the user can see: the plot's svg is what lies at the label's centre (a label
        # clipped by the svg's box, as gradio drew it, lies over whatever is below the plot instead)
        labels = page.evaluate("""() => {
            const out = {};
            const svg = document.querySelector('#plot_reward svg');
            for (const t of document.querySelectorAll('#plot_reward svg text')) {
                const r = t.getBoundingClientRect();
                const hit = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
                if (['train', 'validation'].includes(t.textContent) && hit && (hit === svg || svg.contains(hit)))
                    out[t.textContent] = true;
            }
            return out; }""")
        time.sleep(0.5)
    assert labels == {"train": True, "validation": True}, labels


def test_try_it_shows_the_users_own_frames(served, tiny_model_dir):
    reward = served["ws"] / "uploads" / "raising.py"
    reward.write_text(RAISING)
    values = form(model_source="folder", model_path=str(tiny_model_dir), reward_path=str(reward))
    _, message = call(served["client"], "on_try", values)
    assert "error: the reward function raised on" in message and "ZeroDivisionError: division by zero" in message
    assert f'File "{reward}", line 6, in compute_score' in message and "in helper" in message
    assert "worker_process.py" not in message and "loader.py" not in message and "rlframe's own frames left out" in message
