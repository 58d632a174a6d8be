"""Golden trajectories of torch.amp.GradScaler for tests/amp/grad_scaler_test.cpp.

Run with the project's .venv (PyTorch 2.11):  .venv/bin/python tests/golden/generate_grad_scaler_golden.py
It writes two CSV files next to this file; the C++ tests replay the same scripted sequences of finite and
non-finite gradients through amp::GradScaler (with its default floor and ceiling, which must be torch.amp's: none)
and compare every row. No Python runs at test time.

- grad_scaler_trajectory.csv: 300 steps with random overflows around the default range.
- grad_scaler_unbounded_trajectory.csv: the scale is driven down to 2^-37 (below any floor of 1) by a run of
  overflows, then up through 2^24 to the largest power of two a float holds (2^127, where torch.amp refuses the
  growth to inf), then random overflows.
"""
import csv
import os
import random

import torch

LR = 0.125
SEED = 20261130


def write(rows, name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {path} (torch {torch.__version__})")


def replay(init_scale, growth_interval, overflows, grads):
    """Replays scripted overflows and gradients through torch.amp.GradScaler and SGD on one weight."""
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = torch.optim.SGD([weight], lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    rows = []
    for step, (overflow, grad_value) in enumerate(zip(overflows, grads)):
        scaler.scale(torch.tensor(0.0))  # creates the state on the first step, as scale(loss) would
        scale_before = scaler.get_scale()
        # What backward would leave: the gradient of a scaled loss, or an overflow.
        weight.grad = torch.tensor([float("inf") if overflow else grad_value]) * scale_before
        scaler.step(optimizer)
        scaler.update()
        rows.append({
            "step": step,
            "overflow": int(overflow),
            "grad": repr(grad_value),
            "scale_after": repr(scaler.get_scale()),
            "growth_tracker_after": int(scaler._growth_tracker.item()),
            "weight_after": repr(weight.item()),
        })
    return rows


def main() -> None:
    # One generator draws each step's overflow, then its gradient (the order the first file has always used).
    rng = random.Random(SEED)
    overflows, grads = [], []
    for _ in range(300):
        overflows.append(rng.random() < 0.15)
        grads.append(rng.uniform(-1.0, 1.0))
    write(replay(2.0**10, 5, overflows, grads), "grad_scaler_trajectory.csv")

    rng = random.Random(SEED + 1)
    down = [True] * 40  # 2^3 -> 2^-37
    up = [False] * 175  # 2^-37 -> 2^127 after 164 growths, then 11 refused growths (2^128 is inf)
    mixed = [rng.random() < 0.3 for _ in range(60)]
    overflows = down + up + mixed
    grads = [rng.uniform(-1.0, 1.0) for _ in overflows]
    write(replay(2.0**3, 1, overflows, grads), "grad_scaler_unbounded_trajectory.csv")


if __name__ == "__main__":
    main()
