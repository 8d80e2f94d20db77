"""Soak: 300+ RL steps on a tiny random model; RSS of every process and Ray's object store per step, then
the slope per 100 steps of each, so that a leak shows before a user's 3-day run finds it.

    python examples/benchmark/soak.py [--steps 300] [--engine hf|vllm] [--workdir DIR] [key=value ...]

This script is the driver: it runs `rlframe.main` in this process (as a user's script would) with a sampling
thread beside it. After each step appears in metrics.jsonl the thread records the RSS of this process (the
driver) and of every process under it (the worker actors, Ray's raylet / GCS / agents, reward workers) and
the bytes in Ray's object store (what `ray memory --stats-only` reads). At the end it prints, per process, the
RSS at the first and last sampled step and the least-squares slope per 100 steps after a warm-up (the first
10% of the steps), and the same for the object store and for the bytes glibc's malloc holds for the driver
(mallinfo2: RSS growing with these flat is fragmentation, not something kept); every sample goes to
<workdir>/soak.json (one line each to soak_samples.jsonl while it runs: the sampler keeps none in the driver it
measures). `--trace` adds tracemalloc snapshots of the driver at the warm-up's end and the last steps.

The model is the test suite's tiny random Llama (2 layers, hidden 128, its byte-level BPE tokenizer), the task
the generated arithmetic set at the test sizes (4 prompts x 2 samples of 16 tokens), a checkpoint every 100
steps with the default retention (so saving and pruning are part of the soak).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY = ["data.arithmetic.n_train=64", "data.arithmetic.n_val=8", "data.val_max_samples=8", "data.max_prompt_length=256",
        "data.max_response_length=16", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_device=4", "rollout.n=2", "trainer.num_cpus=4", "trainer.save_every=100",
        "trainer.val_before_train=false", "trainer.export_hf=false"]


def build_tiny_model(folder: Path) -> Path:
    """The tests' tiny random Llama (tests/conftest.py) with the tests' tokenizer (tests/helpers_tokenizer.py)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from helpers_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ sampling


def process_label(proc: psutil.Process) -> str:
    """A stable name for one process of the run: driver, worker <pid> (<actor class>), raylet, gcs_server, ..."""
    if proc.pid == os.getpid():
        return "driver"
    try:
        argv = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {proc.pid}"
    head = argv[0] if argv else proc.name()
    if head.startswith("ray::"):
        return f"worker {proc.pid} ({head[5:].split('.')[0]})"
    name = Path(head).name
    if name.startswith("python"):
        script = next((Path(a).name for a in argv[1:] if a.endswith(".py")), "")
        module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
        name = script or module or "python"
        if "multiprocessing" in " ".join(argv):
            name = "reward/multiprocessing worker"
    return f"{name} {proc.pid}"


def object_store_bytes() -> int | None:
    """Bytes in Ray's object store (primary copies and others), as `ray memory --stats-only` reports them."""
    try:
        import ray
        from ray._private.internal_api import (
            get_memory_info_reply,
            get_state_from_address,
        )

        if not ray.is_initialized():
            return None
        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        return int(reply.store_stats.object_store_bytes_used)
    except Exception:  # noqa: BLE001  (a sampling failure must not stop the soak)
        return None


class Sampler(threading.Thread):
    """Records one sample per step logged in metrics.jsonl: RSS of each process, object store bytes; with
    `trace_steps` (first, last), the driver's Python heap (tracemalloc) and live objects by type at those two steps."""

    def __init__(self, metrics: Path, out: Path, trace_steps: tuple[int, int] | None = None):
        super().__init__(daemon=True)
        self.metrics, self.out, self.done = metrics, out, threading.Event()
        self.trace_steps, self.traces = trace_steps, {}

    @property
    def samples(self) -> list[dict]:
        """Every sample so far (they go to `out`, one JSON line each, not to a list in the process they measure)."""
        return [json.loads(line) for line in self.out.read_text().splitlines()] if self.out.exists() else []

    def run(self) -> None:
        offset = 0
        while not self.done.is_set():
            steps, offset = self.logged_steps(offset)
            if steps:
                with open(self.out, "a") as f:
                    f.write(json.dumps(self.sample(steps[-1])) + "\n")
                if self.trace_steps and any(steps[-1] >= t and t not in self.traces for t in self.trace_steps):
                    self.traces[next(t for t in self.trace_steps if steps[-1] >= t and t not in self.traces)] = trace()
            time.sleep(0.05)

    def logged_steps(self, offset: int) -> tuple[list[int], int]:
        """The steps logged since byte `offset` of metrics.jsonl (the file is read from there on, not whole each
        time: the sampler itself must not grow with the run) and the offset after the last complete line."""
        if not self.metrics.exists():
            return [], offset
        with open(self.metrics, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        lines = chunk[:end].decode().splitlines()
        return [json.loads(line)["step"] for line in lines if line.endswith("}")], offset + end

    def sample(self, step: int) -> dict:
        driver = psutil.Process()
        rss = {}
        for proc in [driver, *driver.children(recursive=True)]:
            try:
                rss[process_label(proc)] = proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return {"step": step, "time": time.time(), "rss": rss, "object_store_bytes": object_store_bytes(),
                "driver_malloc": malloc_in_use(), "driver_rss_kinds": rss_kinds(), "driver_threads": threading.active_count()}


def rss_kinds() -> dict[str, int]:
    """This process's RSS split as Linux counts it (/proc/self/status): RssAnon (heap, stacks, anonymous mmaps),
    RssFile (mapped files: libraries), RssShmem (shared memory: Ray's object store pages this process touched)."""
    kinds = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                name, value = line.split(":")
                kinds[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return kinds


def malloc_in_use() -> dict | None:
    """glibc's own count for this process (mallinfo2): bytes handed out by malloc and not freed (`in_use`, the
    heap and its mmapped blocks) and the heap's free bytes (`free`): RSS growing with `in_use` flat is the heap
    fragmenting, not something kept. None off glibc."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return None
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


def trace() -> dict:
    """The driver's tracemalloc snapshot and its live objects counted by type (after a full collection)."""
    import gc
    import tracemalloc
    from collections import Counter

    gc.collect()
    counts = Counter(type(o).__qualname__ for o in gc.get_objects())
    return {"snapshot": tracemalloc.take_snapshot(), "objects": counts, "traced": tracemalloc.get_traced_memory()[0]}


def trace_report(first: dict, last: dict, steps: int, top: int = 25) -> list[str]:
    """What grew in the driver's Python heap between the two traced steps: by allocation site and by type."""
    mib = 1 << 20
    lines = [f"driver Python heap (tracemalloc): {first['traced'] / mib:.1f} -> {last['traced'] / mib:.1f} MiB over "
             f"{steps} steps ({100 * (last['traced'] - first['traced']) / steps / mib:+.3f} MiB per 100 steps)",
             "grown most, by allocation site (size change, count change):"]
    for stat in last["snapshot"].compare_to(first["snapshot"], "traceback")[:top]:
        frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback[:4])
        lines.append(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d}  {frames}")
    grown = (last["objects"] - first["objects"]).most_common(top)
    lines.append("live objects grown most, by type: " + ", ".join(f"{name} {n:+d}" for name, n in grown))
    return lines


# ------------------------------------------------------------------ the figures


def slope_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value against step, times 100."""
    n = len(points)
    if n < 2:
        return float("nan")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return 100 * sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else float("nan")


def segment_slopes(warm: list[dict], segments: int = 3) -> list[str]:
    """The driver's RSS slope in each third of the steps after the warm-up: a leak keeps its slope, a heap that
    is still settling (malloc arenas and Python's object arenas reaching their working size) loses it."""
    mib, size = 1 << 20, len(warm) // segments
    if size < 10:
        return []
    parts = [warm[i * size:(i + 1) * size] for i in range(segments)]
    slopes = [slope_per_100([(s["step"], s["rss"]["driver"] / mib) for s in part if "driver" in s["rss"]]) for part in parts]
    return [f"{'driver: slope by third of the steps':<44} " + "  ".join(
        f"{part[0]['step']}..{part[-1]['step']}: {slope:+.2f}" for part, slope in zip(parts, slopes)) + " MiB/100"]


def report(samples: list[dict], steps: int) -> list[str]:
    warm = [s for s in samples if s["step"] > max(1, steps // 10)]
    mib = 1 << 20
    lines = [f"{len(samples)} samples; slopes over steps {warm[0]['step']}..{warm[-1]['step']} (after the warm-up)",
             f"{'process':<44} {'RSS first':>10} {'RSS last':>10} {'slope/100 steps':>16}"]
    labels = sorted({label for s in warm for label in s["rss"]}, key=lambda k: (k != "driver", k))
    for label in labels:
        points = [(s["step"], s["rss"][label] / mib) for s in warm if label in s["rss"]]
        if len(points) < 0.5 * len(warm):  # a process that came and went (an idle Ray worker, a short helper)
            continue
        lines.append(f"{label:<44} {points[0][1]:>7.1f} MiB {points[-1][1]:>7.1f} MiB {slope_per_100(points):>+12.2f} MiB")
    malloc = [(s["step"], s["driver_malloc"]["in_use"] / mib) for s in warm if s.get("driver_malloc")]
    if malloc:
        lines.append(f"{'driver: malloc in use (glibc mallinfo2)':<44} {malloc[0][1]:>7.1f} MiB {malloc[-1][1]:>7.1f} MiB "
                     f"{slope_per_100(malloc):>+12.2f} MiB")
    for kind in ("RssAnon", "RssFile", "RssShmem"):
        points = [(s["step"], s["driver_rss_kinds"][kind] / mib) for s in warm if kind in s.get("driver_rss_kinds", {})]
        if points:
            lines.append(f"{'driver: ' + kind:<44} {points[0][1]:>7.1f} MiB {points[-1][1]:>7.1f} MiB "
                         f"{slope_per_100(points):>+12.2f} MiB")
    lines += segment_slopes(warm)
    threads = [s["driver_threads"] for s in warm if "driver_threads" in s]
    if threads:
        lines.append(f"{'driver: threads':<44} {threads[0]:>10} {threads[-1]:>10}")
    total = [(s["step"], sum(s["rss"].values()) / mib) for s in warm]
    lines.append(f"{'all processes':<44} {total[0][1]:>7.1f} MiB {total[-1][1]:>7.1f} MiB {slope_per_100(total):>+12.2f} MiB")
    store = [(s["step"], s["object_store_bytes"]) for s in warm if s["object_store_bytes"] is not None]
    if store:
        lines.append(f"{'Ray object store (bytes used)':<44} {store[0][1]:>10,} {store[-1][1]:>10,} "
                     f"{slope_per_100(store):>+12.0f} B   (max {max(v for _, v in store):,} B)")
    else:
        lines.append("Ray object store: not readable")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--trace", action="store_true",
                        help="also trace the driver's Python heap (tracemalloc, 8 frames) and print what grew between "
                             "the end of the warm-up and the last step (slower)")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for rlframe.main")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rlframe_soak_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(workdir / "tiny_model")
    run_dir = workdir / "run"
    argv = ["recipe=grpo_math", *TINY, f"model.path={model}", f"trainer.run_dir={run_dir}",
            f"rollout.engine={args.engine}", f"trainer.total_steps={args.steps}", *args.overrides]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    trace_steps = (max(1, args.steps // 10) + 1, args.steps - 5) if args.trace else None
    if args.trace:
        import tracemalloc

        tracemalloc.start(8)
    (workdir / "soak_samples.jsonl").unlink(missing_ok=True)
    sampler = Sampler(run_dir / "metrics.jsonl", workdir / "soak_samples.jsonl", trace_steps)
    sampler.start()
    start = time.perf_counter()
    from rlframe.main import main as rlframe_main

    sys.argv = ["rlframe.main", *argv]  # (the resume command a signal prints)
    try:
        rlframe_main(argv)
    finally:
        sampler.done.set()
        sampler.join(timeout=120 if args.trace else 5)  # (a snapshot of a large heap takes a while)
        samples = sampler.samples
        (workdir / "soak.json").write_text(json.dumps({"argv": argv, "samples": samples}))
    print(f"\nsoak: {args.steps} steps ({args.engine} rollout) in {time.perf_counter() - start:.0f} s; "
          f"samples in {workdir / 'soak.json'}")
    for line in report(samples, args.steps):
        print(line)
    if args.trace and len(sampler.traces) == 2:
        (first_step, first), (last_step, last) = sorted(sampler.traces.items())
        for line in trace_report(first, last, last_step - first_step):
            print(line)


if __name__ == "__main__":
    main()
