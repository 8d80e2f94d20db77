"""A quiet console (workers/log_capture.py): library chatter goes to the run's log files, our warnings stay."""

import subprocess
import sys
import textwrap


def test_worker_output_goes_to_its_log_file_and_our_warnings_to_the_console(tmp_path):
    script = textwrap.dedent(f"""
        import logging, os, sys, warnings
        os.environ["RLFRAME_WORKER_LOG_DIR"] = {str(tmp_path / "logs")!r}
        from rlframe.workers.log_capture import capture_worker_output
        capture_worker_output()                                   # what Ray runs at a worker's start
        print("INFO vllm: Initializing a V1 LLM engine")          # a library's print
        os.write(2, b"[W1201 utils.cpp:68] Warning: NUMA binding\\n")  # C++ writing to fd 2
        logging.getLogger("vllm").warning("theirs")
        warnings.warn("a FutureWarning", FutureWarning)
        logging.getLogger("rlframe.workers.x").warning("ours: a non-finite update was skipped")
        logging.getLogger("rlframe.workers.x").info("our info")
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    assert "ours: a non-finite update was skipped" in console
    for chatter in ("Initializing a V1 LLM engine", "NUMA binding", "theirs", "FutureWarning", "our info"):
        assert chatter not in console, console
    [log] = (tmp_path / "logs").glob("worker-*.log")
    text = log.read_text()
    for chatter in ("Initializing a V1 LLM engine", "NUMA binding", "theirs", "FutureWarning"):
        assert chatter in text, text


def test_driver_console_keeps_our_warnings_and_errors_and_the_file_gets_everything(tmp_path):
    script = textwrap.dedent(f"""
        import logging, warnings
        logging.basicConfig(level=logging.INFO)
        from rlframe.workers.log_capture import route_driver_logs
        quiet = {str(tmp_path / "quiet")!r}
        route_driver_logs(quiet, verbose=False)
        logging.getLogger("rlframe.data.dataset").info("RLDataset: 2000 rows")
        logging.getLogger("rlframe.trainer").warning("our warning")
        logging.getLogger("transformers").warning("their warning")
        logging.getLogger("ray").info("Started a local Ray instance.")
        logging.getLogger("torch").error("their error")
        warnings.warn("deprecated thing", DeprecationWarning)
        print("step    1/2  [##########..........]  50%")
        """)
    done = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    assert "our warning" in console and "their error" in console and "step    1/2" in console
    for chatter in ("RLDataset", "their warning", "Started a local Ray", "deprecated thing"):
        assert chatter not in console, console
    text = (tmp_path / "quiet" / "logs" / "driver.log").read_text()
    for line in ("RLDataset", "our warning", "their warning", "Started a local Ray", "their error", "deprecated thing"):
        assert line in text, text
