"""What the C++ side of a benchmark hands its Python peer (benchmarks/common/peer_bundle.h): a dict str -> Tensor
written with torch::pickle_save, and the byte digest both sides compute the same way (Note [byte digest] in
benchmarks/common/peer_bundle.cpp), so the peer can prove it trained on exactly our weights and batches."""
import torch

WEIGHT_PERIOD = 65521
CHUNK_BYTES = 1 << 22
FOLD_MULTIPLIER = 1000003
FOLD_MODULUS = (1 << 61) - 1


def load_bundle(path):
    """The bundle's tensors (CPU), in the order the C++ side wrote them."""
    # torch::pickle_save's archive is not accepted by the weights_only unpickler; the file is the one our own
    # benchmark process just wrote, so it is trusted.
    bundle = torch.load(path, weights_only=False)
    if not isinstance(bundle, dict):
        raise ValueError(f"peer bundle {path} holds a {type(bundle).__name__}, not a dict of tensors")
    return bundle


def with_prefix(bundle, prefix):
    """{name: tensor} of the entries named prefix + name, in order."""
    return {k[len(prefix):]: v for k, v in bundle.items() if k.startswith(prefix)}


def _fold(h, x):
    return (h * FOLD_MULTIPLIER + x % FOLD_MODULUS) % FOLD_MODULUS


def byte_digest(tensors):
    """16 hex digits; equal to bench::byte_digest in C++ for the same bytes, shapes and element sizes."""
    h = 0
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous().flatten().view(torch.uint8)
        n = data.numel()
        total = weighted = 0
        for begin in range(0, n, CHUNK_BYTES):
            end = min(n, begin + CHUNK_BYTES)
            wide = data[begin:end].to(torch.int64)
            weights = torch.arange(begin, end, dtype=torch.int64).remainder_(WEIGHT_PERIOD).add_(1)
            total = (total + int(wide.sum())) % FOLD_MODULUS
            weighted = (weighted + int(wide.mul(weights).sum())) % FOLD_MODULUS
        h = _fold(h, tensor.numel())
        for size in tensor.shape:
            h = _fold(h, size)
        h = _fold(h, tensor.element_size())
        h = _fold(h, total)
        h = _fold(h, weighted)
    return f"{h:016x}"
