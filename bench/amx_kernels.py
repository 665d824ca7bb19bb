"""AMX tiles against VNNI for the int-activation kernels (platform/kernels/cpu_a8.c), side by side.

For SmolLM2's linear shapes (qkv/gate_up-like 1536x576, down-like 576x1536) and a 8192-row slice
of an LM head, at several row counts: microseconds per call of the 4-bit `w4a16` linear and of
the int8 head, with the tiles allowed and not (`CpuOps.set_amx`), arms interleaved, best of
`--repeats`, timed by the calling thread's CPU clock (so a busy machine's waiting is not counted;
use `--threads 1`). Every pair must give the same bits; the script exits 1 if not.

    python bench/amx_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.quant import a8, formats

SHAPES = ((1536, 576), (576, 1536), (8192, 576))
ROWS = (1, 8, 16, 20, 32, 33, 47)


def per_call_us(fn, x, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn(x)
    return (time.thread_time() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.set_amx(True):
        print("no AMX tiles here (the CPU lacks AMX-INT8, the kernels are not built, or Linux refused them)")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; us per call, best of {args.repeats}; speed-up = VNNI / AMX\n")
    print("| out x in | rows | w4a16 VNNI | w4a16 AMX | speed-up | head VNNI | head AMX | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    same = True
    for n, k in SHAPES:
        kernel = a8.Int4A8Kernel(torch.randn(n, k) * 0.05, None, ops, 2)
        table = formats.int8_groups(torch.randn(n, k))[0]
        head = a8.Int8A8Head(table.codes, table.scale, ops)
        for m in ROWS:
            x = torch.randn(m, k)
            best = {}
            for _ in range(args.repeats):
                for amx in (False, True):
                    ops.set_amx(amx)
                    out = (kernel(x), head(x))
                    times = (per_call_us(kernel, x, 100), per_call_us(head, x, 40))
                    prev = best.get(amx)
                    best[amx] = out, tuple(min(a, b) for a, b in zip(times, prev[1])) if prev else times
            ops.set_amx(True)
            same &= all(torch.equal(a, b) for a, b in zip(best[False][0], best[True][0]))
            (qv, hv), (qa, ha) = best[False][1], best[True][1]
            print(f"| {n} x {k} | {m} | {qv:.0f} | {qa:.0f} | {qv / qa:.2f}x | {hv:.0f} | {ha:.0f} | {hv / ha:.2f}x |")
    print(f"\nsame bits on both paths: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
