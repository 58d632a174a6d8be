#!/usr/bin/env python3
"""PyTorch's data parallel training with mixed precision (DistributedDataParallel + torch.autocast +
torch.amp.GradScaler + torch.optim.SGD), the peer of python_free_examples/amp_ddp.cpp under ddp-launch.

Started by torchrun (one process per rank) from bench_ddp_vs_torch_ddp, which writes the bundle: amp_ddp's initial
weights (weights/<name>), its training and test splits, and every rank's sample order per epoch (order/e<E>/r<R>,
from the same torch::data::samplers::DistributedRandomSampler amp_ddp uses). Its output mirrors amp_ddp's: rank 0's
progress line "... | N samples/s" per epoch (all ranks' samples over the epoch's wall time, one loss.item() per
step, as amp_ddp) and "epoch E/N: mean loss X | test accuracy Y%"; before training every rank prints
"peer rank R: weights=<digest> batches=<digest>" (benchmarks/peers/peer_bundle.py) for the C++ side to check.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from peer_bundle import byte_digest, load_bundle, with_prefix
from torch_amp_peer import SmallCnn

EVAL_BATCH = 1000  # as python_free_examples/common/training.cpp
PROGRESS_UPDATES = 20
PROGRESS_WIDTH = 30


def batches(images, labels, order, batch_size, device):
    for begin in range(0, order.numel(), batch_size):
        idx = order[begin:begin + batch_size]
        yield images.index_select(0, idx).to(device, non_blocking=True), labels.index_select(0, idx).to(
            device, non_blocking=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=128, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:LOCAL_RANK)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}") if args.device.startswith("cuda") else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    bundle = load_bundle(args.bundle)
    weights = with_prefix(bundle, "weights/")
    train_images, train_labels = bundle["train_images"], bundle["train_labels"]
    test_images, test_labels = bundle["test_images"], bundle["test_labels"]
    orders = [bundle[f"order/e{epoch}/r{rank}"] for epoch in range(1, args.epochs + 1)]

    model = SmallCnn()
    model.load_state_dict(weights, strict=True)
    model.to(device).train()
    state = model.state_dict()
    seen = [t for order in orders for b in batches(train_images, train_labels, order, args.batch_size, "cpu") for t in b]
    print(f"peer rank {rank}: weights={byte_digest([state[n] for n in weights])} batches={byte_digest(seen)}",
          flush=True)
    del seen
    # PyTorch's defaults, which are ddp::DistributedDataParallel's too: buffers broadcast from rank 0 before each
    # forward, a 1 MB first bucket then 25 MB buckets.
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    for epoch in range(1, args.epochs + 1):
        order = orders[epoch - 1]
        local = order.numel()
        steps = -(-local // args.batch_size)
        redraw_every = max(1, steps // PROGRESS_UPDATES)
        start = time.perf_counter()
        loss_sum = 0.0
        for s, (images, labels) in enumerate(batches(train_images, train_labels, order, args.batch_size, device)):
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=dtype):
                out = ddp(images)
            loss = F.cross_entropy(out.float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.item()
            if rank == 0 and ((s + 1) % redraw_every == 0 or s + 1 == steps):
                seconds = time.perf_counter() - start
                seen = min(local, (s + 1) * args.batch_size) * world
                filled = PROGRESS_WIDTH * (s + 1) // steps
                print(f"\repoch {epoch}/{args.epochs} [{'#' * filled}{'.' * (PROGRESS_WIDTH - filled)}] {s + 1}/{steps} "
                      f"loss {loss_sum / (s + 1):.4f} | {seen / seconds:.0f} samples/s", end="", flush=True)
        if rank == 0:
            print()
            model.eval()
            correct = 0
            with torch.no_grad():
                for begin in range(0, test_images.shape[0], EVAL_BATCH):
                    x = test_images[begin:begin + EVAL_BATCH].to(device)
                    with torch.autocast(device.type, dtype=dtype):
                        logits = model(x)
                    y = test_labels[begin:begin + EVAL_BATCH].to(device)
                    correct += int(logits.float().argmax(1).eq(y).sum())
            model.train()
            print(f"epoch {epoch}/{args.epochs}: mean loss {loss_sum / steps:.4f} | test accuracy "
                  f"{100.0 * correct / test_images.shape[0]:.2f}%", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
