"""Golden byte digests for tests/benchmarks/peer_bundle_test.cpp: what benchmarks/peers/peer_bundle.py (the digest
the Python peers print) gives for a few fixed tensors, so the C++ bench::byte_digest is checked against it.

Run with the project's .venv (PyTorch 2.11):  .venv/bin/python tests/golden/generate_peer_digest_golden.py
It writes peer_digest.csv next to this file. No Python runs at test time. The C++ test builds the same tensors
(keep the two lists in step).
"""
import csv
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks", "peers"))
from peer_bundle import byte_digest  # noqa: E402


def cases():
    images = torch.arange(0, 1000, dtype=torch.float32).reshape(10, 1, 10, 10).mul(0.37)
    labels = torch.arange(0, 777, dtype=torch.int64).remainder(10)
    half = torch.linspace(-3.0, 3.0, 301).to(torch.bfloat16)
    large = torch.arange(0, 5_000_000, dtype=torch.int32)  # 20 MB: crosses the 4 MiB chunks of the digest
    return [
        ("images_f32", [images]),
        ("labels_i64", [labels]),
        ("bf16", [half]),
        ("scalar_f64", [torch.tensor(2.5, dtype=torch.float64)]),
        ("large_i32", [large]),
        ("list", [images, labels, half]),
        ("list_reordered", [labels, images, half]),
        ("reshaped", [images.reshape(100, 10)]),
    ]


def main() -> None:
    path = os.path.join(HERE, "peer_digest.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["case", "digest"])
        for name, tensors in cases():
            writer.writerow([name, byte_digest(tensors)])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
