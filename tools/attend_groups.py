"""
One decode step's attention of one layer, in isolation: the chunk calls a step makes, timed (issue
33, docs/performance.md). q [1, G, R, D] (SmolLM2-135M's shape: 3 kv heads, 3 query rows, 64)
against L positions in chunks of 512, fp32 and bf16:

    12 flash calls      one call of the CPU flash kernel per chunk (before)
    flash1              one call over the L positions as one [G, L, D] span
    flashbatch          one call, the chunks as the kernel's batch (kvcache.attend_sealed)
    flashbatch+merge    the same and the merge of its partials
    mm qKt              matmul, softmax, matmul over the span

    python tools/attend_groups.py THREADS L[,L...]     e.g. 2 2048,6144

Fastest and median of 9 interleaved rounds of 20 calls; prints whether the batched call's
partials equal the per-chunk calls' bit for bit.
"""
import statistics
import sys
import time

import torch

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
G, R, D, C = 3, 3, 64, 512


def bench(fns, reps=20, rounds=9):
    res = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(5):
            f()
    for _ in range(rounds):
        for k, f in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                f()
            res[k].append((time.perf_counter() - start) / reps * 1e6)
    return res


def merge(o, lse):
    w = torch.softmax(lse, 0).unsqueeze(-1)  # [n, 1, G, R, 1]
    return (o * w).sum(0)


def main():
    if len(sys.argv) != 3 or not sys.argv[1].isdigit():
        print("usage: python tools/attend_groups.py THREADS L[,L...]     e.g. 2 2048,6144",
              file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(int(sys.argv[1]))
    for L in [int(x) for x in sys.argv[2].split(",")]:
        n = L // C
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, G, R, D, dtype=dtype) * 0.125
            arena = torch.randn(n, 2, 1, G, C, D, dtype=dtype)  # a layer's chunks side by side
            chunks = [arena[j] for j in range(n)]
            span = torch.randn(2, G, L, D, dtype=dtype)         # head-major: one span per head
            K, V = arena[:, 0, 0], arena[:, 1, 0]                # [n, G, C, D]
            qn = q.expand(n, G, R, D)
            o, lse = FLASH(qn, K, V, scale=1.0)[:2]
            same = all(torch.equal(o[j:j + 1], FLASH(q, c[0], c[1], scale=1.0)[0])
                       for j, c in enumerate(chunks))

            def mm():
                s = torch.bmm(q[0],
                              span[0].transpose(1, 2)).float()  # [G, R, L]
                m = s.amax(-1, keepdim=True)
                p = torch.exp(s - m)
                return torch.bmm(p.to(dtype), span[1]).float() / p.sum(-1, keepdim=True)

            fns = {"12 flash calls": lambda: [FLASH(q, c[0], c[1], scale=1.0) for c in chunks],
                   "flash1": lambda: FLASH(q, span[0:1], span[1:2], scale=1.0),
                   "flashbatch": lambda: FLASH(qn, K, V, scale=1.0),
                   "flashbatch+merge": lambda: merge(*FLASH(qn, K, V, scale=1.0)[:2]),
                   "mm qKt": mm}
            kv_bytes = 2 * G * L * D * q.element_size()
            print(f"{str(dtype)[6:]} L={L}: batched partials equal per-chunk ones: {same}")
            for k, v in bench(fns).items():
                print(f"  {k:18s} fastest {min(v):8.1f} us  median {statistics.median(v):8.1f} us"
                      f"  {kv_bytes / min(v) / 1e3:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
