"""Write-read-back check of the patched nvidia-uvm, for every page size.

Run it once after installing the patched module, before any benchmark:

    python driver_patch/verify.py            # device cuda:0
    python driver_patch/verify.py --device cuda:1

For each page size the module serves (64 KiB, 128 KiB, 256 KiB, 2 MiB) it
builds a cache with backend='cuda_uvm' and checks, with GPU reads and writes:

1. fresh pages read as zero (the module zeroes every allocation);
2. a pattern written into every mapped page reads back;
3. after unmapping part of a request and mapping it again, the page that
   stayed keeps its data and the remapped ones read back what is written;
4. a page mapped at two addresses (a forked request) shows one memory:
   a write through either address is read through the other.

Exit status 0 when every check passed, 1 when one failed (each failure is
printed), 2 when the cuda_uvm backend cannot run here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

import vattn

KiB = 1024
# a uint8 view of one request's slice of one buffer: (manager, buffer, reqid) -> 1-D tensor
SliceView = Callable[[vattn.KVCacheManager, int, int], torch.Tensor]


def device_slice(kv: vattn.KVCacheManager, buffer: int, reqid: int) -> torch.Tensor:
    """The slice as the GPU sees it (reads and writes are GPU copies)."""
    return kv.buffers()[buffer][reqid].view(torch.uint8).flatten()


def pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    """Bytes that differ from page to page and from zero: no two pages of one
    check share a pattern, so data read from the wrong page is noticed."""
    return ((torch.arange(nbytes, device=device, dtype=torch.int64) * 7 + seed) % 251 + 1).to(torch.uint8)


def check_page_size(page_size: int, device: str = "cuda", view: SliceView = device_slice) -> list[str]:
    """Runs checks 1-4 for one page size; returns the failures (empty: passed)."""
    problems: list[str] = []
    token_bytes = 4 * 128 * 2  # 4 KV heads x 128 x fp16, per buffer
    tokens_per_page = page_size // token_bytes
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.float16, max_batch_size=2,
                              max_context_len=4 * tokens_per_page, device=device, page_size=page_size,
                              physical_memory=16 * page_size * 2, backend="cuda_uvm", policy={"background": False})
    try:
        a = kv.alloc_reqid()
        if not kv.step([3 * tokens_per_page if r == a else 0 for r in range(2)]):
            return [f"{page_size}: could not map 3 pages per buffer"]
        pages = [(b, p) for b in range(kv.config.num_buffers) for p in range(3)]
        where = view(kv, 0, a).device  # where the bytes are read and written

        def page(b: int, r: int, p: int) -> torch.Tensor:
            return view(kv, b, r)[p * page_size:(p + 1) * page_size]

        def expect(b: int, r: int, p: int, want: torch.Tensor, what: str) -> None:
            got = page(b, r, p)
            if not torch.equal(got.cpu(), want.cpu()):
                wrong = int((got.cpu() != want.cpu()).sum())
                problems.append(f"{page_size}: {what}: buffer {b} page {p}: {wrong} of {page_size} bytes differ")

        zeros = torch.zeros(page_size, dtype=torch.uint8)
        for b, p in pages:  # 1. fresh memory
            expect(b, a, p, zeros, "fresh page is not zero")
        written = {}
        for i, (b, p) in enumerate(pages):  # 2. write, read back
            written[b, p] = pattern(page_size, i, where)
            page(b, a, p).copy_(written[b, p])
        sync(where)
        for b, p in pages:
            expect(b, a, p, written[b, p], "write did not read back")
        kv.unmap_pages([a], [1])  # 3. unmap pages 1-2, map them again
        if not kv.step([3 * tokens_per_page if r == a else 0 for r in range(2)]):
            return problems + [f"{page_size}: could not map the pages again"]
        for b in range(kv.config.num_buffers):
            expect(b, a, 0, written[b, 0], "page that stayed mapped lost its data")
            for p in (1, 2):
                written[b, p] = pattern(page_size, 100 + 3 * b + p, where)
                page(b, a, p).copy_(written[b, p])
        sync(where)
        for b, p in pages:
            expect(b, a, p, written[b, p], "write after remap did not read back")
        c = kv.fork(a, 2 * tokens_per_page)  # 4. pages 0-1 shared by a and c
        for b in range(kv.config.num_buffers):
            for p in (0, 1):
                expect(b, c, p, written[b, p], "shared page differs between its two addresses")
            fresh = pattern(page_size, 200 + b, where)
            page(b, c, 0).copy_(fresh)
            sync(where)
            expect(b, a, 0, fresh, "write through one address of a shared page not seen through the other")
    finally:
        kv.cleanup()
    return problems


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="CUDA device, e.g. cuda:1 (default cuda)")
    args = parser.parse_args(argv)
    failures: list[str] = []
    for page_size in vattn.backends.UVM_PAGE_SIZES:
        print(f"page size {page_size // KiB} KiB: ", end="", flush=True)
        try:
            problems = check_page_size(page_size, args.device)
        except vattn.BackendUnavailable as e:
            print(f"cuda_uvm unavailable: {e}")
            return 2
        print("ok" if not problems else f"{len(problems)} failure(s)")
        failures += problems
    for line in failures:
        print("FAIL", line)
    print("all checks passed" if not failures else "the patched module does not keep data: do not benchmark it")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
