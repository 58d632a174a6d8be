#!/usr/bin/env python3
"""PyTorch's own full sharding (FSDP2, torch.distributed.fsdp.fully_shard) and DistributedDataParallel on the model,
data, loss, optimizer and threads of bench_fsdp's iteration-time table: the peer of ddp::FullyShardedDataParallel.

Started by torchrun --nproc-per-node 2 (Gloo on the CPU): each block a unit (fully_shard per block, then the root),
FP32, AdamW(lr 1e-4, weight decay 1e-2), loss y.pow(2).mean() of a [tokens, d] input per rank, one intra-op thread.
DDP and FSDP2 interleaved round by round, as bench_fsdp interleaves its setups; rank 0 prints one line per setup:
"peer <setup>: median <ms> ms per iteration" and the peak resident size, MiB.
"""
import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    """bench::Block (benchmarks/common/block_stack.h)."""

    def __init__(self, d):
        super().__init__()
        self.d = d
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.qkv(self.ln1(x))
        d = self.d
        x = x + self.out(h[..., 0:d] * torch.sigmoid(h[..., d:2 * d]) + h[..., 2 * d:3 * d])
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def stack(d, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    ddp_model = stack(args.d, args.layers)
    ddp = DistributedDataParallel(ddp_model)
    fsdp_model = stack(args.d, args.layers)
    for block in fsdp_model:
        fully_shard(block)
    fully_shard(fsdp_model)
    setups = {
        "DDP": (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=1e-2)),
        "FSDP2": (fsdp_model, torch.optim.AdamW(fsdp_model.parameters(), lr=1e-4, weight_decay=1e-2)),
    }
    torch.manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.d)

    def iteration(model, optimizer):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()

    for model, optimizer in setups.values():  # warm-up
        iteration(model, optimizer)
    seconds = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (model, optimizer) in setups.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iterations):
                iteration(model, optimizer)
            seconds[name].append((time.perf_counter() - start) / args.iterations)
    if rank == 0:
        for name, samples in seconds.items():
            print(f"peer {name}: median {statistics.median(samples) * 1e3:.2f} ms per iteration")
        print(f"peer peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
