"""Golden trajectory of torch.amp.GradScaler for tests/amp/grad_scaler_test.cpp.

Run with the project's .venv (PyTorch 2.11):  .venv/bin/python tests/golden/generate_grad_scaler_golden.py
It writes grad_scaler_trajectory.csv next to this file; the C++ test replays the same scripted sequence of
finite and non-finite gradients through amp::GradScaler and compares every row. No Python runs at test time.
"""
import csv
import os
import random

import torch

STEPS = 300
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 5
OVERFLOW_PROBABILITY = 0.15
LR = 0.125
SEED = 20261130


def main() -> None:
    rng = random.Random(SEED)
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = torch.optim.SGD([weight], lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    rows = []
    for step in range(STEPS):
        overflow = rng.random() < OVERFLOW_PROBABILITY
        grad_value = rng.uniform(-1.0, 1.0)
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
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grad_scaler_trajectory.csv")
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
