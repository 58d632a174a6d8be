"""Golden trajectories of FP8 delayed scaling for tests/amp/fp8_test.cpp, written from Transformer Engine's
documented formulas (DelayedScaling; transformer_engine/common/recipe/delayed_scaling.cu):

  at each step the casts max |x| into history[0]; then
  amax      = max(history)  ("max")  or  history[0]  ("most_recent")
  history   = roll(history, -1); history[0] = 0
  scale     = (fp8_max * 2^-margin) / amax   if amax is finite and > 0, else the previous scale
              (an fp32 overflow gives the largest finite float)
  scale_inv = 1 / scale
plus amp's rule for a skipped step (a non-finite amax or gradient): history and scale stay, history[0] is cleared.
All arithmetic in float32 with torch, as the kernels do it.

Run with the project's .venv (PyTorch 2.11):  .venv/bin/python tests/golden/generate_fp8_scaling_golden.py
It writes fp8_scaling.csv next to this file: one row per (case, step) with the amax recorded that step, whether the
step was skipped, and the scale and scale_inv after the update, as float32 hex bit patterns. No Python runs at test
time.
"""
import csv
import math
import os
import random
import struct

import torch

SEED = 20261202
STEPS = 40
FLT_MAX = torch.finfo(torch.float32).max

# (name, fp8_max, history length, margin, algo)
CASES = [
    ("e4m3_len1_max", 448.0, 1, 0, "max"),
    ("e4m3_len4_max", 448.0, 4, 0, "max"),
    ("e5m2_len16_max_margin2", 57344.0, 16, 2, "max"),
    ("e4m3_len8_most_recent", 448.0, 8, 0, "most_recent"),
    ("e4m3_len1024_max", 448.0, 1024, 1, "max"),
]


def bits(x):
    return "%08x" % struct.unpack("<I", struct.pack("<f", float(x)))[0]


def f32(x):
    return torch.tensor(x, dtype=torch.float32)


def trajectory(rng, fp8_max, length, margin, algo):
    history = torch.zeros(length, dtype=torch.float32)
    scale = f32(1.0)
    scale_inv = f32(1.0)
    scaled_max = f32(fp8_max) * f32(2.0 ** -margin)
    rows = []
    for step in range(STEPS):
        r = rng.random()
        if r < 0.08:
            amax = math.inf
        elif r < 0.12:
            amax = math.nan
        elif r < 0.17:
            amax = 0.0
        elif r < 0.20:
            amax = 1e-39  # subnormal: the scale overflows fp32
        else:
            amax = 10.0 ** rng.uniform(-4, 3)
        amax_t = f32(amax)
        history[0] = torch.maximum(history[0], amax_t) if not math.isnan(amax) else amax_t
        skip = not math.isfinite(amax)
        if skip:
            history[0] = 0.0
        else:
            current = history[0].clone()
            a = history.max() if algo == "max" else current
            history = torch.roll(history, -1, 0)
            history[0] = 0.0
            if torch.isfinite(a) and a > 0:
                s = scaled_max / a
                if torch.isinf(s):
                    s = f32(FLT_MAX)
                scale = s
                scale_inv = f32(1.0) / s
        rows.append({"step": step, "amax": bits(amax_t), "skip": int(skip), "scale": bits(scale),
                     "scale_inv": bits(scale_inv)})
    return rows


def main():
    rng = random.Random(SEED)
    rows = []
    for name, fp8_max, length, margin, algo in CASES:
        for row in trajectory(rng, fp8_max, length, margin, algo):
            rows.append({"case": name, "fp8_max": fp8_max, "length": length, "margin": margin, "algo": algo, **row})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_scaling.csv")
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
