#!/usr/bin/env python3
"""PyTorch's own mixed precision (torch.autocast + torch.amp.GradScaler) on the models of
benchmarks/amp_vs_fp32.cpp: the same architecture, sizes, batch, steps and optimizer, timed the same way
(warmup steps untimed, then the median per-step time over rounds, device synchronized around each round). bench_amp_vs_fp32 runs it as a
subprocess and parses one line per dtype from stdout:

    dtype=bf16 samples_per_s=1234.5 step_ms=10.3 final_loss=0.4321 peak_mib=512.0
    dtype=fp16 error=<why this dtype could not run>

Inputs are random tensors of the C++ side's shapes (throughput does not depend on the values; the loss printed
is this run's, not comparable to the C++ rows). Exit status 3: this Python has no torch.
"""
import argparse
import statistics
import sys
import time

EXIT_NO_TORCH = 3
FINAL_LOSS_WINDOW_STEPS = 10  # as the C++ side: mean of the last steps' losses

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("torch_amp_peer: this Python has no torch", file=sys.stderr)
    sys.exit(EXIT_NO_TORCH)


class SmallCnn(nn.Module):
    """python_free_examples/common/small_cnn.cpp."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Block(nn.Module):
    """benchmarks/common/tiny_transformer.cpp: TransformerBlockImpl."""

    def __init__(self, d, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """benchmarks/common/tiny_transformer.cpp: TinyTransformerImpl."""

    def __init__(self, vocab, seq, d, heads, layers, mlp_ratio):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d)
        self.position_embedding = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_job(args, device):
    """Model, optimizer, batches (cycled) and loss of the requested model, seeded."""
    torch.manual_seed(args.seed)
    if args.model == "cnn":
        model = SmallCnn().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        inputs = torch.randn(args.steps, args.batch_size, 1, 28, 28, device=device)
        targets = torch.randint(0, 10, (args.steps, args.batch_size), device=device)

        def loss_fn(logits, target):
            return F.cross_entropy(logits.float(), target)
    else:
        model = TinyTransformer(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.mlp_ratio).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        tokens = torch.randint(0, args.vocab, (args.steps, args.batch_size, args.seq + 1), device=device)
        inputs, targets = tokens[..., :-1], tokens[..., 1:]

        def loss_fn(logits, target):
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    return model, optimizer, inputs, targets, loss_fn


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, device, dtype):
    model, optimizer, inputs, targets, loss_fn = make_job(args, device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    scaler = torch.amp.GradScaler(device.type)
    losses = torch.empty(args.steps, device=device)

    def train(begin, end):
        for step in range(begin, end):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype):
                logits = model(inputs[step])
            loss = loss_fn(logits, targets[step])
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses[step] = loss.detach()

    train(0, args.warmup)
    # As the C++ side: the timed steps in rounds, the median per-step time over rounds.
    per_round = -(-(args.steps - args.warmup) // args.rounds)
    seconds_per_step = []
    for begin in range(args.warmup, args.steps, per_round):
        end = min(args.steps, begin + per_round)
        synchronize(device)
        start = time.perf_counter()
        train(begin, end)
        synchronize(device)
        seconds_per_step.append((time.perf_counter() - start) / (end - begin))
    step_s = statistics.median(seconds_per_step)
    fields = {
        "samples_per_s": args.batch_size / step_s,
        "step_ms": 1e3 * step_s,
        "final_loss": losses[-min(FINAL_LOSS_WINDOW_STEPS, args.steps):].mean().item(),
    }
    if device.type == "cuda":
        fields["peak_mib"] = (torch.cuda.max_memory_allocated(device) - start_bytes) / 2**20
    return fields


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "transformer"], required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="intra-op CPU threads (0: torch's default)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    args = parser.parse_args()
    args.warmup = max(0, min(args.warmup, args.steps - 1))

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # Strict FP32 wherever an op stays fp32, as on the C++ side (PyTorch's default leaves cuDNN's TF32 on).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for name in args.dtypes.split(","):
        try:
            fields = run(args, device, dtypes[name])
            print(f"dtype={name} " + " ".join(f"{k}={v:.6g}" for k, v in fields.items()), flush=True)
        except Exception as e:  # noqa: BLE001 - one failing dtype must not hide the others
            print(f"dtype={name} error={str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)


if __name__ == "__main__":
    main()
