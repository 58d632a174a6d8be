"""A model of Hopper's FP8 tensor-core accumulation, run on the shapes and data of Fp8CudaTest (tests/amp/fp8_test.cpp).

Where the test's GEMM tolerance comes from (Note [FP8 GEMM tolerance on Hopper]); nothing runs it at test time.
The products of two FP8 values are exact. Each block FMA adds `block` products to the running sum after aligning
all of them to the largest magnitude among them and truncating each to `bits` bits below it; every `promote`
products the running sum is added to an fp32 accumulator (cuBLASLt without fast accumulation; a `promote` of at
least K is fast accumulation). Prints, per GEMM, max |error| / max |exact| (the test's normwise measure) and that
divided by 2^-bits * sqrt(K).

    .venv/bin/python tests/amp/fp8_accumulation_model.py --bits 13 --block 32 --promote 128

About a minute per run on 2 cores. Measured (2026-12-02) on the test's shapes, bits 13, blocks of 32: ratio
0.10-0.46 (normwise 2e-4 to 6e-4) with promotion every 128; 0.25-0.85 (up to 3.1e-3) without promotion. Bits 14,
promotion every 128: normwise 1e-4 to 3.3e-4.
"""

import argparse
import math

import torch


def quantized(t, scale, dtype):
    """t * scale rounded to `dtype` (saturated as the layer's cast), exact in fp64."""
    limit = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    return (t.float() * scale).clamp(-limit, limit).to(dtype).double()


def tensor_core_mm(a, b, bits, block, promote):
    """a [M, K] @ b [K, N] of FP8 values (fp64, exact) under the accumulation model above."""
    m, k = a.shape
    out = torch.empty(m, b.shape[1], dtype=torch.float64)
    for r0 in range(0, m, 64):  # row blocks bound the memory of the [rows, block, N] products
        rows = a[r0:r0 + 64]
        fp32 = torch.zeros(rows.shape[0], b.shape[1], dtype=torch.float32)
        run = torch.zeros(rows.shape[0], b.shape[1], dtype=torch.float64)
        for k0 in range(0, k, block):
            addends = torch.cat([run[:, None, :], rows[:, k0:k0 + block, None] * b[None, k0:k0 + block, :]], 1)
            largest = addends.abs().amax(1)
            _, exponent = torch.frexp(largest)
            unit = torch.ldexp(torch.ones_like(largest), (exponent - bits).to(torch.int32))
            unit = torch.where(largest > 0, unit, torch.ones_like(unit))[:, None, :]
            run = (torch.trunc(addends / unit) * unit).sum(1).float().double()
            if (k0 + block) % promote == 0 or k0 + block >= k:
                fp32 += run.float()
                run.zero_()
        out[r0:r0 + 64] = fp32.double()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, default=13)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--promote", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(41)
    # Fp8CudaTest's cases: (rows, in, out), x ~ 20 N(0, 1), W as Linear's init, dy ~ 1e-3 N(0, 1); scales 0.5, 64,
    # 3e4; E4M3 for x and W, E5M2 for dy (the hybrid format).
    for rows, fan_in, fan_out in ((64, 256, 128), (37, 80, 48), (1000, 512, 1024)):
        x = torch.randn(rows, fan_in) * 20
        w = (torch.rand(fan_out, fan_in) * 2 - 1) / math.sqrt(fan_in)
        dy = torch.randn(rows, fan_out) * 1e-3
        qx = quantized(x, 0.5, torch.float8_e4m3fn)
        qw = quantized(w, 64.0, torch.float8_e4m3fn)
        qdy = quantized(dy, 3.0e4, torch.float8_e5m2)
        for name, a, b in (("forward", qx, qw.t()), ("input gradient", qdy, qw), ("weight gradient", qdy.t(), qx)):
            exact = a @ b
            error = (tensor_core_mm(a, b, args.bits, args.block, args.promote) - exact).abs().max().item()
            normwise = error / exact.abs().max().item()
            k = a.shape[1]
            print(f"{rows}x{fan_in}x{fan_out} {name:15s} K={k:5d}: normwise {normwise:.3g}, "
                  f"/ (2^-{args.bits} sqrt(K)) = {normwise / (2.0 ** -args.bits * math.sqrt(k)):.3g}", flush=True)


if __name__ == "__main__":
    main()
