"""A generated vision-language dataset: pictures of coloured shapes and exact-answer questions about them.

Each row is one image (``size`` x ``size`` px, white background) with 1-6 shapes (circle, square,
triangle) in 3 colours (red, green, blue), drawn with PIL on a grid of cells so that shapes never
overlap, and one question with an integer answer, e.g.

    <image>How many red circles are in the picture?      -> 2
    <image>How many shapes are blue?                      -> 3
    <image>How many triangles are in the picture?         -> 1

written in verl's / EasyR1's multimodal parquet layout (the images as PNG bytes, one ``<image>``
placeholder per image in the prompt)::

    data_source   "shapes"
    prompt        [{"role": "user", "content": "<image>" + question + " " + INSTRUCTION}]
    images        [{"bytes": <png>, "path": None}]
    ability       "vision"
    reward_model  {"style": "rule", "ground_truth": "2"}
    extra_info    {"split": "train", "index": 0, "question": ..., "shapes": [[shape, colour, cell], ...]}

The answer is scored by the ordinary math reward (reward_fns/math.py: ``\\boxed{N}`` against the
ground truth). Generation is seeded and deterministic (the same seed gives the same bytes); the
validation split uses a different seed stream and no (picture, question) pair of it is in train.

CLI::

    python -m rlframe.data.shapes --out data/shapes [--n-train 256 --n-val 32 --seed 0]
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

from rlframe.data.parquet_rows import write_rows

DATA_SOURCE = "shapes"
INSTRUCTION = "End your reply with: The answer is \\boxed{your number}."
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 60, 220)}
GRID = 3  # cells per side: at most 9 shapes, never overlapping


def draw_shape(draw, shape: str, colour: str, cx: float, cy: float, r: float) -> None:
    """One shape of radius r centred at (cx, cy) on a PIL ImageDraw (the scenes' and the clips' frames)."""
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def draw_scene(shapes: list[tuple[str, str, int]], size: int) -> bytes:
    """PNG bytes of the shapes [(shape, colour, cell)], each centred in its cell of a GRID x GRID grid."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size / GRID
    for shape, colour, position in shapes:
        cx, cy = (position % GRID + 0.5) * cell, (position // GRID + 0.5) * cell
        draw_shape(draw, shape, colour, cx, cy, cell * 0.35)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


def make_problem(rng: random.Random) -> tuple[list[tuple[str, str, int]], str, int]:
    """A random scene and one question about it with its exact integer answer."""
    count = rng.randint(1, 6)
    cells = rng.sample(range(GRID * GRID), count)
    shapes = [(rng.choice(SHAPES), rng.choice(list(COLOURS)), cell) for cell in cells]
    kind = rng.choice(("shape_colour", "colour", "shape", "total"))
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    if kind == "shape_colour":
        question = f"How many {colour} {shape}s are in the picture?"
        answer = sum(s == shape and c == colour for s, c, _ in shapes)
    elif kind == "colour":
        question = f"How many shapes are {colour}?"
        answer = sum(c == colour for _, c, _ in shapes)
    elif kind == "shape":
        question = f"How many {shape}s are in the picture?"
        answer = sum(s == shape for s, _, _ in shapes)
    else:
        question = "How many shapes are in the picture?"
        answer = len(shapes)
    return shapes, question, answer


def shapes_rows(n: int, seed: int, split: str, size: int) -> list[dict]:
    rng = random.Random(f"shapes-{split}-{seed}")
    rows = []
    for index in range(n):
        shapes, question, answer = make_problem(rng)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"<image>{question} {INSTRUCTION}"}],
            "images": [{"bytes": draw_scene(shapes, size), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "question": question,
                           "shapes": [[s, c, str(cell)] for s, c, cell in shapes]},
        })
    return rows


def generate_shapes_dataset(out_dir: str | Path, n_train: int = 256, n_val: int = 32, seed: int = 0,
                            size: int = 112) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet into `out_dir`; returns their paths.

    Validation rows whose (picture, question) also occurs in train are redrawn, so the splits are disjoint.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train = shapes_rows(n_train, seed, "train", size)
    seen = {(row["images"][0]["bytes"], row["extra_info"]["question"]) for row in train}
    val, rng_seed = [], seed
    while len(val) < n_val:
        for row in shapes_rows(n_val, rng_seed, "val", size):
            if (row["images"][0]["bytes"], row["extra_info"]["question"]) not in seen and len(val) < n_val:
                row["extra_info"]["index"] = len(val)
                val.append(row)
        rng_seed += 1_000_003
    return write_rows(train, out_dir / "train.parquet"), write_rows(val, out_dir / "val.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data/shapes")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=112)
    args = parser.parse_args()
    train, val = generate_shapes_dataset(args.out, args.n_train, args.n_val, args.seed, args.size)
    print(f"wrote {train} and {val}")


if __name__ == "__main__":
    main()
