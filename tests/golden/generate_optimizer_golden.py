"""Golden trajectories of torch.optim.SGD / Adam / AdamW for tests/amp/optimizer_golden_test.cpp.

Run with the project's .venv (PyTorch 2.11):  .venv/bin/python tests/golden/generate_optimizer_golden.py
It writes optimizer_trajectory.csv next to this file. No Python runs at test time.

The model has a parameter that is not used at first: y = linear(x, W, b) + linear(x, S) where the side weight S
joins the loss only at steps 3, 4, 6 and 7 (0-based) of 8. With zero_grad(set_to_none=True), S has no gradient
at steps 0, 1, 2 and 5, so torch.optim does not step it and does not create or advance its state there: SGD's
momentum buffer starts as a copy of S's first gradient, Adam's bias correction counts S's own steps.

Rows (one value list per row, space-separated, each an fp32 value written exactly):
  init,-,<param>,<values>            initial parameter values
  data,<step>,x|t,<values>           inputs (5 x 4) and targets (5 x 3) of each step
  <config>,<step>,<param>,<values>   the parameter after that step
  <config>,<step>,<param>.<field>,<values or "absent">   its optimizer state after that step
"""
import csv
import os

import torch

SEED = 20261201
STEPS = 8
SIDE_STEPS = (3, 4, 6, 7)
BATCH, IN, OUT = 5, 4, 3
PARAMS = ("weight", "bias", "side")

# name -> (optimizer class, keyword arguments); foreach=False selects torch.optim's reference (single-tensor) path.
CONFIGS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_dampening_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=0.01)),
    "sgd_nesterov_wd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam_wd": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adam_amsgrad_wd": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True)),
    "adamw_wd": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01)),
    "adamw_amsgrad_wd": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.01, amsgrad=True, betas=(0.8, 0.95))),
}
STATE_FIELDS = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
}


def values(t: torch.Tensor) -> str:
    return " ".join(repr(v) for v in t.detach().reshape(-1).tolist())


def forward(params, x, step):
    y = torch.nn.functional.linear(x, params["weight"], params["bias"])
    if step in SIDE_STEPS:
        y = y + torch.nn.functional.linear(x, params["side"])
    return y


def main() -> None:
    torch.manual_seed(SEED)
    init = {
        "weight": torch.randn(OUT, IN) * 0.5,
        "bias": torch.randn(OUT) * 0.5,
        "side": torch.randn(OUT, IN) * 0.5,
    }
    data = [(torch.randn(BATCH, IN), torch.randn(BATCH, OUT)) for _ in range(STEPS)]
    rows = [["init", "-", name, values(init[name])] for name in PARAMS]
    for step, (x, t) in enumerate(data):
        rows.append(["data", str(step), "x", values(x)])
        rows.append(["data", str(step), "t", values(t)])
    for config, (cls, kwargs) in CONFIGS.items():
        params = {name: init[name].clone().requires_grad_(True) for name in PARAMS}
        opt = cls([params[name] for name in PARAMS], foreach=False, **kwargs)
        for step, (x, t) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            (forward(params, x, step) - t).pow(2).mean().backward()
            opt.step()
            for name in PARAMS:
                p = params[name]
                rows.append([config, str(step), name, values(p)])
                state = opt.state.get(p, {})
                for field in STATE_FIELDS[cls]:
                    value = state.get(field)
                    rows.append([config, str(step), f"{name}.{field}",
                                 "absent" if value is None else values(torch.as_tensor(value, dtype=torch.float32))])
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "optimizer_trajectory.csv")
    with open(path, "w", newline="") as out:
        csv.writer(out, lineterminator="\n").writerows([["config", "step", "name", "values"]] + rows)
    print(f"wrote {len(rows)} rows to {path} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
