"""Concurrency stress for the background mapper, run by test_mapper.py in a
subprocess so a deadlock fails the test by timeout instead of hanging it.

Random schedules of alloc / step / free with the mapper running; two writer
threads stamp every new row of every active request and re-verify all rows
after every step. Checks each step against the minimum pages every active
request must have. Prints "OK <steps> steps <schedules> schedules".
"""

from __future__ import annotations

import math
import random
import sys
import threading

import torch

import vattn

B, L, PAGE, LAYERS = 6, 256, 4096, 2


def run_schedule(seed: int) -> int:
    rng = random.Random(seed)
    layout = rng.choice(["per_layer", "all_layers"])
    head_dim = rng.choice([16, 32])
    pool_pages = rng.randint(8, 60)
    kv = vattn.KVCacheManager(num_layers=LAYERS, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32,
                              max_batch_size=B, max_context_len=L, page_size=PAGE, layout=layout,
                              physical_memory=max(pool_pages, 4) * PAGE,
                              policy={"background": True, "deferred_reclaim": rng.random() < 0.8,
                                      "eager": rng.random() < 0.7, "lookahead_tokens": rng.choice([1, 4, 16]),
                                      "eager_tokens": rng.choice([0, 32, 100]),
                                      "reclaim_threshold": rng.choice([0.0, 0.1, 0.5])})
    nb, tok = kv.config.num_buffers, kv.config.token_bytes_per_buffer
    total_pages = kv.stats()["pages_total"]
    lens = [0] * B
    written = [0] * B
    serial = [0] * B
    next_serial = 1
    steps = 0

    def expected(s: int, n: int) -> torch.Tensor:
        return (serial[s] * 1000 + torch.arange(n, dtype=torch.float32)).view(-1, 1, 1)

    def writer(slots: list[int], errors: list[str]) -> None:
        try:
            for s in slots:
                for layer in range(LAYERS):
                    k, v = kv.layer(layer)
                    n0, n1 = written[s], lens[s]
                    k[s, n0:n1] = expected(s, n1)[n0:] + layer
                    v[s, n0:n1] = -expected(s, n1)[n0:] - layer
                    for t, sign in ((k, 1), (v, -1)):
                        want = sign * (expected(s, n1) + layer)
                        if not torch.equal(t[s, :n1], want.expand(-1, *t.shape[2:])):
                            errors.append(f"seed {seed}: reqid {s} layer {layer} corrupted")
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(f"seed {seed}: writer failed: {e!r}")

    try:
        for _ in range(60):
            op = rng.random()
            active = [s for s in range(B) if kv.is_allocated(s)]
            if op < 0.25 and len(active) < B:
                s = kv.alloc_reqid(rng.choice([None, rng.randint(0, L)]))
                serial[s], written[s], lens[s] = next_serial, 0, 0
                next_serial += 1
            elif op < 0.4 and active:
                s = rng.choice(active)
                kv.free_reqid(s)
                lens[s] = written[s] = 0
            else:
                want = list(lens)
                for s in active:
                    want[s] = min(L, want[s] + rng.choice([0, 1, 1, 1, 7, 40]))
                ok = kv.step(want)
                steps += 1
                need = [math.ceil(n * tok / PAGE) for n in want]
                if ok:
                    for s in active:
                        assert kv._pages.mapped_pages(s) >= need[s], (seed, s)
                    lens = want
                else:
                    held = sum(max(need[s], kv._pages.mapped_pages(s)) for s in active) * nb
                    assert held > total_pages, f"seed {seed}: step failed with {held} <= {total_pages} pages"
                    continue
                errors: list[str] = []
                halves = [active[0::2], active[1::2]]
                threads = [threading.Thread(target=writer, args=(h, errors)) for h in halves]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                if errors:
                    raise AssertionError("; ".join(errors[:3]))
                for s in active:
                    written[s] = lens[s]
        assert kv.stats()["mapper_errors"] == 0
    finally:
        kv.cleanup()
    return steps


def main() -> int:
    first, count = int(sys.argv[1]), int(sys.argv[2])
    steps = sum(run_schedule(seed) for seed in range(first, first + count))
    print(f"OK {steps} steps {count} schedules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
