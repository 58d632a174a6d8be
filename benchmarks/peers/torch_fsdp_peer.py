#!/usr/bin/env python3
"""PyTorch's own full sharding (FSDP2, torch.distributed.fsdp.fully_shard) and DistributedDataParallel on the model,
data, loss, optimizer and threads of bench_fsdp's iteration-time table: the peer of ddp::FullyShardedDataParallel.

Started by torchrun --nproc-per-node 2 (Gloo on the CPU): each block a unit (fully_shard per block, then the root),
FP32, AdamW(lr 1e-4, weight decay 1e-2), loss y.pow(2).mean() of a [tokens, d] input per rank, one intra-op thread.
DDP and FSDP2 interleaved round by round, as bench_fsdp interleaves its setups; rank 0 prints one line per setup:
"peer <setup>: median <ms> ms per iteration" and the peak resident size, MiB.

--memory ddp|fsdp2 instead builds that one model (bench_fsdp's and bench_fsdp_amp's memory runs: --d-model 1024
--layers 8, a [2, 8, d] input), trains two iterations and prints rank 0's tensor bytes after the first (parameters or their
shards, gradients, AdamW's state) and the peak resident size, the most over the ranks, with what it rose by since the
rank started. --bf16: FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) (fp32 shards, bf16 gathered and
reduced: the peer of amp O2 over full sharding).
"""
import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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


def current_rss():
    """This process's resident size now, bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def storage_bytes(tensors):
    """Bytes of the distinct storages under `tensors` (a DTensor's local shard; a view counts its storage once)."""
    storages = {}
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory(args, rank):
    """One model of args.memory, two iterations: rank 0 prints the bytes and the peaks."""
    start_rss = current_rss()
    model = stack(args.d, args.layers)
    if args.memory == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if args.bf16 else MixedPrecisionPolicy()
        for block in model:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    else:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2)
    x = torch.randn(2, 8, args.d)
    counted = None
    for _ in range(2):
        optimizer.zero_grad()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        if counted is None:
            params = storage_bytes(model.parameters())
            grads = storage_bytes(p.grad for p in model.parameters())
            state = storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
            counted = (params, grads, state)
    peaks = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0 - start_rss],
                         dtype=torch.double)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if rank == 0:
        mib = 1024.0 * 1024.0
        params, grads, state = counted
        name = f"{args.memory}{' bf16' if args.bf16 else ''}"
        print(f"peer memory {name}, {dist.get_world_size()} ranks: params {params / mib:.1f} | grads {grads / mib:.1f} "
              f"| AdamW state {state / mib:.1f} | total {(params + grads + state) / mib:.1f} MiB | peak RSS "
              f"{peaks[0].item() / mib:.0f} MiB, {peaks[1].item() / mib:.0f} MiB above the rank's start")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", dest="d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", choices=["ddp", "fsdp2"], help="only the memory of this one model")
    parser.add_argument("--bf16", action="store_true", help="with --memory fsdp2: bf16 param_dtype")
    args = parser.parse_args()
    if args.bf16 and args.memory != "fsdp2":
        parser.error("--bf16 needs --memory fsdp2 (it sets FSDP2's MixedPrecisionPolicy)")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.memory:
        memory(args, rank)
        dist.destroy_process_group()
        return

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
