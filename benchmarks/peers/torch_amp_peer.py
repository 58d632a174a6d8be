#!/usr/bin/env python3
"""PyTorch's own mixed precision (torch.autocast + torch.amp.GradScaler) on the models of
benchmarks/amp_vs_fp32.cpp, trained on exactly what the C++ side trains on: its initial weights, its data and its
batch order, read from the bundle it writes (benchmarks/common/peer_bundle.h), with its thread count.

bench_amp_vs_fp32 starts this script once per model and drives it over stdin/stdout, one line each way, so the
peer's timed steps run in the same interleaved rounds as ours (Note [interleaved rounds] in amp_vs_fp32.cpp):

    (start)                      -> ready batches=<digest of every step's input and target bytes>
    create <dtype>               -> ok weights=<digest of the model's state after loading ours>
    train <dtype> <begin> <end>  -> ok seconds=<wall time of steps [begin, end), device synchronized> [peak_mib=...]
    finish <dtype>               -> ok final_loss=... accuracy=... skipped=... scale=... losses=l0,l1,...
    quit
Any command can answer "error <one line>". Exit status 3: this Python has no torch.
"""
import argparse
import sys
import time

EXIT_NO_TORCH = 3
FINAL_LOSS_WINDOW_STEPS = 10  # as the C++ side: mean of the last steps' losses
CNN_EVAL_BATCH = 1000  # as benchmarks/common/training_tasks.cpp

try:
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint
    import torch.nn.functional as F
except ImportError:
    print("torch_amp_peer: this Python has no torch", file=sys.stderr)
    sys.exit(EXIT_NO_TORCH)

from peer_bundle import byte_digest, load_bundle, with_prefix  # noqa: E402  (after the torch check)


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

    def __init__(self, vocab, seq, d, heads, layers, mlp_ratio, activation_checkpointing=False):
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.token_embedding = nn.Embedding(vocab, d)
        self.position_embedding = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # The reentrant form, as amp::activation_checkpoint: the block keeps its input only, and its forward
                # runs again in backward with the stashed random state.
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


class CnnTask:
    """benchmarks/common/training_tasks.cpp: CnnTask, on the bundle's data and order."""

    def __init__(self, bundle, args, device):
        self.args = args
        self.train_images = bundle["train_images"].to(device)
        self.train_labels = bundle["train_labels"].to(device)
        self.test_images = bundle["test_images"].to(device)
        self.test_labels = bundle["test_labels"].to(device)
        self.order = bundle["order"].to(device)
        self.num_steps = self.order.numel() // args.batch_size

    def make_model(self):
        return SmallCnn()

    def make_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.args.lr, momentum=0.9)

    def batch(self, step):
        idx = self.order[step * self.args.batch_size:(step + 1) * self.args.batch_size]
        return self.train_images.index_select(0, idx), self.train_labels.index_select(0, idx)

    def loss(self, logits, target):
        return F.cross_entropy(logits, target)

    def accuracy(self, forward):
        n = self.test_images.shape[0]
        correct = torch.zeros((), dtype=torch.int64, device=self.test_images.device)
        for begin in range(0, n, CNN_EVAL_BATCH):
            end = min(n, begin + CNN_EVAL_BATCH)
            correct += forward(self.test_images[begin:end]).argmax(1).eq(self.test_labels[begin:end]).sum()
        return int(correct) / n


class TransformerTask:
    """benchmarks/common/training_tasks.cpp: TransformerTask, on the bundle's token sequences."""

    def __init__(self, bundle, args, device):
        self.args = args
        self.train_tokens = bundle["train_tokens"].to(device)
        self.eval_tokens = bundle["eval_tokens"].to(device)
        self.num_steps = self.train_tokens.shape[0] // args.batch_size

    def make_model(self):
        a = self.args
        return TinyTransformer(a.vocab, a.seq, a.d_model, a.heads, a.layers, a.mlp_ratio, a.activation_checkpointing)

    def make_optimizer(self, model):
        return torch.optim.AdamW(model.parameters(), lr=self.args.lr)  # torch::optim::AdamW's defaults are these

    def batch(self, step):
        rows = self.train_tokens[step * self.args.batch_size:(step + 1) * self.args.batch_size]
        return rows[:, :self.args.seq], rows[:, 1:self.args.seq + 1]

    def loss(self, logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def accuracy(self, forward):
        seq, n = self.args.seq, self.eval_tokens.shape[0]
        correct = torch.zeros((), dtype=torch.int64, device=self.eval_tokens.device)
        for begin in range(0, n, self.args.batch_size):
            rows = self.eval_tokens[begin:min(n, begin + self.args.batch_size)]
            correct += forward(rows[:, :seq]).argmax(-1).eq(rows[:, 1:seq + 1]).sum()
        return int(correct) / (n * seq)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Contender:
    """One dtype: torch.autocast + torch.amp.GradScaler (defaults), the loop torch.amp's documentation shows."""

    def __init__(self, task, weights, device, dtype):
        self.task, self.device, self.dtype = task, device, dtype
        if device.type == "cuda":
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.start_bytes = torch.cuda.memory_allocated(device)
        self.model = task.make_model()
        self.model.load_state_dict(weights, strict=True)
        self.model.to(device).train()
        self.optimizer = task.make_optimizer(self.model)
        self.scaler = torch.amp.GradScaler(device.type)
        self.losses = torch.empty(task.num_steps, device=device)
        self.skipped = torch.zeros((), device=device)
        state = self.model.state_dict()
        self.weights_digest = byte_digest([state[name] for name in weights])

    def forward(self, x):
        with torch.autocast(self.device.type, dtype=self.dtype):
            logits = self.model(x)
        return logits.float()  # as amp's Model: floating outputs come back as fp32

    def train(self, begin, end):
        for step in range(begin, end):
            inputs, target = self.task.batch(step)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task.loss(self.forward(inputs), target)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.count_skipped()
            self.scaler.update()
            self.losses[step] = loss.detach()

    def count_skipped(self):
        """Adds this step's found_inf on the device (no host read: GradScaler.step already paid its one). The
        flags are GradScaler's private per-optimizer state, read between step() and update() as update() does."""
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found_inf in state["found_inf_per_device"].values():
            self.skipped += found_inf.to(self.skipped.device)

    def peak_mib(self):
        synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - self.start_bytes) / 2**20

    def finish(self):
        steps = self.task.num_steps
        losses = self.losses.cpu()
        self.model.eval()
        with torch.no_grad():
            accuracy = self.task.accuracy(self.forward)
        return {
            "final_loss": f"{losses[-min(FINAL_LOSS_WINDOW_STEPS, steps):].mean().item():.9g}",
            "accuracy": f"{accuracy:.9g}",
            "skipped": str(int(self.skipped)),
            "scale": f"{self.scaler.get_scale():.9g}",
            "losses": ",".join(f"{v:.9g}" for v in losses.tolist()),
        }


def serve(args, device):
    bundle = load_bundle(args.bundle)
    task = (CnnTask if args.model == "cnn" else TransformerTask)(bundle, args, device)
    weights = with_prefix(bundle, "weights/")
    batch_tensors = []
    for step in range(task.num_steps):
        batch_tensors.extend(task.batch(step))
    print(f"ready batches={byte_digest(batch_tensors)} steps={task.num_steps}", flush=True)
    del batch_tensors
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    contenders = {}
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "quit":
                break
            name = words[1]
            if words[0] == "create":
                contenders[name] = Contender(task, weights, device, dtypes[name])
                reply = f"weights={contenders[name].weights_digest}"
            elif words[0] == "train":
                c = contenders[name]
                synchronize(device)
                start = time.perf_counter()
                c.train(int(words[2]), int(words[3]))
                synchronize(device)
                reply = f"seconds={time.perf_counter() - start:.9g}"
                if device.type == "cuda":
                    reply += f" peak_mib={c.peak_mib():.6g}"
            elif words[0] == "finish":
                reply = " ".join(f"{k}={v}" for k, v in contenders.pop(name).finish().items())
            else:
                raise ValueError(f"unknown command {words[0]!r}")
            print(f"ok {reply}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failing dtype must not end the others
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"error {message}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True, help="weights, data and order written by bench_amp_vs_fp32")
    parser.add_argument("--model", choices=["cnn", "transformer"], required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="intra-op CPU threads (0: torch's default)")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--mlp-ratio", type=int, default=4)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="each block under torch.utils.checkpoint (reentrant), as the C++ side's flag")
    args = parser.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # Strict FP32 wherever an op stays fp32, as on the C++ side (PyTorch's default leaves cuDNN's TF32 on).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        serve(args, device)
    except Exception as e:  # noqa: BLE001 - report in one line, the C++ side prints it
        print(f"error {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        raise


if __name__ == "__main__":
    main()
