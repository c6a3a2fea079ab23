"""Per-call latency of each VMM operation per page size and backend, plus
allocation bandwidth (the analog of the vAttention paper's Tables 3 and 7).

    python benchmarks/vmm_latency.py [--pages N] [--backends host,cuda]

Writes benchmarks/results/vmm_latency_<machine>.json and a .png plot. Each
backend's map and unmap costs are shown next to a floor measured in the same
run and timed in C++: the raw mmap syscall (host), the raw driver calls
cuMemCreate / cuMemMap + cuMemSetAccess / cuMemUnmap / cuMemRelease, one page
per call (cuda; the goal is vattn's batched map within 1.1x of it).

Page sizes: host 64 KiB, 256 KiB, 2 MiB; cuda 64 KiB where the driver's
granularity allows it (the stock driver's is 2 MiB: then it is listed under
"not_measured"), the granularity, and 3x and 4x it (all-layers pages hold
one page's tokens of every layer, so their sizes are multiples of the
granularity, not necessarily powers of two). The cuda results also record
what the backend learned about the driver at start-up ("facts": whether one
cuMemUnmap may cover adjacent pages mapped separately, the reservation
alignment).

What each figure is:
  reserve / free   one address-range reservation of 1 GiB (per call)
  create / release one physical page (per call)
  map / unmap      one page per call through the Python binding (per call), and
                   batched: `--pages` pages in one call, cost per page
  bandwidth        page_size / (batched map time per page): GB/s of pages mapped;
                   with create: page_size / (create + batched map) per page
  first touch      (host) one byte written per OS page right after a batched map,
                   per page: what a forward writing into new pages pays on top
  populate         (host) the page-table entries made in one call after the map
                   (VmmBackend::populate, which map_pages calls for a framework's
                   blocks), per page; first touch after it

The host map leaves page-table entries to first touch (a fault per OS page).
In alternated rounds (the order reversed every other round) the host's map +
first touch runs three ways: as step maps (map, then touch), as map_pages maps
(map, populate, then touch), and the first again (the A/A pair); the ratio of
the first to the second per round, its median and 95% interval. Beside them the
raw mmap call, timed in C++, with the first touch after it.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time
from pathlib import Path

import numpy as np
from harness import (describe_ratio, git_revision, machine, machine_slug, pyplot, ratio_summary, save_plot,
                     summarize, write_json)

from vattn import _C, _testing
from vattn.backends import cuda_driver_path, cuda_info
from vattn.common.errors import VAttnError

ROOT = Path(__file__).resolve().parents[1]

KiB, MiB, GiB = 1024, 1024**2, 1024**3
ROUNDS = 9  # alternated rounds of the host's map + first touch comparison
HOST_PAGE_SIZES = [64 * KiB, 256 * KiB, 2 * MiB]


def page_sizes(backend_name: str, not_measured: list[str]) -> list[int]:
    if backend_name == "host":
        return HOST_PAGE_SIZES
    g = cuda_info(0)["granularity"]
    sizes = [g, 3 * g, 4 * g]
    if g <= 64 * KiB:
        sizes.insert(0, 64 * KiB)
    else:
        not_measured.append(f"cuda 64 KiB pages: the driver's granularity is {g // KiB} KiB")
    return sorted(set(sizes))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def touch_pages(addr: int, nbytes: int) -> None:
    """Writes one byte into every OS page of [addr, addr + nbytes)."""
    view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    view[::mmap.PAGESIZE] = 1


def measure_first_touch(backend, base: int, addrs: list[int], scattered: list[tuple[int, int]], page_size: int,
                        pages: int, out: dict) -> None:
    """The host's map + first touch in alternated rounds (the order reversed every other round): the
    backend's batched map of ``scattered`` (created pages) then one byte written per OS page, as step
    maps; the same with ``populate`` between them, as map_pages maps; the first again (the A/A pair).
    Adds ``first_touch_per_page``, ``populate_per_page`` and ``first_touch_after_populate_per_page`` to
    ``out["ops"]`` and the per-round ratios to ``out``."""

    def round_trip(populate: bool) -> tuple[float, float, float]:
        mapped = timed(lambda: backend.map(scattered)) / pages
        populated = timed(lambda: backend.populate(addrs)) / pages if populate else 0.0
        touched = timed(lambda: touch_pages(base, pages * page_size)) / pages
        backend.unmap(addrs)
        return mapped, populated, touched

    sides = {"lazy": lambda: round_trip(False), "populate": lambda: round_trip(True),
             "lazy-again": lambda: round_trip(False)}
    times: dict[str, list] = {side: [] for side in sides}
    for i in range(ROUNDS):
        for side in (list(sides) if i % 2 == 0 else list(reversed(sides))):
            times[side].append(sides[side]())
    ops = out["ops"]
    ops["first_touch_per_page"] = summarize([t for _, _, t in times["lazy"]])
    ops["populate_per_page"] = summarize([p for _, p, _ in times["populate"]])
    ops["first_touch_after_populate_per_page"] = summarize([t for _, _, t in times["populate"]])
    # map + first touch as step maps / as map_pages maps (above 1: populating takes less)
    out["map_and_touch_populate_gain"] = ratio_summary([sum(a) / sum(b) for a, b in zip(times["lazy"],
                                                                                      times["populate"])])
    out["map_and_touch_aa"] = ratio_summary([sum(a) / sum(b) for a, b in zip(times["lazy"], times["lazy-again"])])


def measure(backend_name: str, page_size: int, pages: int) -> dict:
    backend = _C.make_backend(backend_name, 0, page_size, pages, cuda_driver_path())
    out: dict = {"backend": backend_name, "page_size": page_size, "pages": pages, "ops": {}}
    ops = out["ops"]

    # reserve / free of a 1 GiB range
    reserve_s, free_s = [], []
    for _ in range(200):
        t = time.perf_counter()
        base = backend.reserve(GiB)
        reserve_s.append(time.perf_counter() - t)
        free_s.append(timed(lambda: backend.free_reservation(base, GiB)))
    ops["reserve"], ops["free"] = summarize(reserve_s), summarize(free_s)

    create_s = [timed(lambda i=i: backend.create_pages(i, 1)) for i in range(pages)]
    ops["create"] = summarize(create_s)

    base = backend.reserve(pages * page_size)
    addrs = [base + i * page_size for i in range(pages)]
    scattered = [(addrs[i], (i * 7919) % pages) for i in range(pages)]  # a recycled pool is not in order
    # every page used once before the timing, as a cache's are after start-up (a page's first use can cost
    # more: where creation left the kernel's zeroing to it)
    backend.map(scattered)
    backend.populate(addrs)
    backend.unmap(addrs)
    map1, unmap1 = [], []
    for addr, page in scattered:
        map1.append(timed(lambda: backend.map([(addr, page)])))
    for addr in addrs:
        unmap1.append(timed(lambda: backend.unmap([addr])))
    ops["map_1_page_per_call"], ops["unmap_1_page_per_call"] = summarize(map1), summarize(unmap1)

    batch_map, batch_unmap = [], []
    for _ in range(5):
        batch_map.append(timed(lambda: backend.map(scattered)) / pages)
        batch_unmap.append(timed(lambda: backend.unmap(addrs)) / pages)
    ops["map_batched_per_page"], ops["unmap_batched_per_page"] = summarize(batch_map), summarize(batch_unmap)
    map_us = ops["map_batched_per_page"]["mean_us"]
    if backend_name == "host":
        measure_first_touch(backend, base, addrs, scattered, page_size, pages, out)
    backend.free_reservation(base, pages * page_size)

    release_s = [timed(lambda i=i: backend.release_pages(i, 1)) for i in range(pages)]
    ops["release"] = summarize(release_s)

    out["bandwidth_gb_s"] = {
        "map": page_size / (map_us * 1e-6) / 1e9,
        "create_and_map": page_size / ((map_us + ops["create"]["mean_us"]) * 1e-6) / 1e9,
    }
    if backend_name == "host":
        raw = [_testing.raw_mmap_seconds(page_size, pages) for _ in range(5)]
        out["floor"] = {name: summarize([r[i] for r in raw])
                        for i, name in enumerate(("raw_mmap_map", "raw_mmap_touch", "raw_mmap_unmap"))}
        out["map_over_floor"] = map_us / out["floor"]["raw_mmap_map"]["mean_us"]
    else:
        out["facts"] = dict(backend.facts)
        del backend  # its pages go before the raw run creates as many again
        raw = [_testing.raw_cuda_seconds(cuda_driver_path(), 0, page_size, pages) for _ in range(3)]
        create, raw_map, raw_unmap, release = (summarize([r[i] for r in raw]) for i in range(4))
        out["floor"] = {"raw_cuda_create": create, "raw_cuda_map_set_access": raw_map,
                        "raw_cuda_unmap": raw_unmap, "raw_cuda_release": release}
        out["map_over_floor"] = map_us / raw_map["mean_us"]
        out["unmap_over_floor"] = ops["unmap_batched_per_page"]["mean_us"] / raw_unmap["mean_us"]
    return out


def available_backends() -> list[str]:
    names = ["host"]
    try:
        cuda_info(0)
        names.append("cuda")
    except VAttnError as e:
        print(f"cuda backend skipped: {e}")
    return names


def plot(results: list[dict], stem: str, title: str) -> None:
    plt = pyplot()
    backends = sorted({r["backend"] for r in results})
    ops = ["reserve", "create", "map_1_page_per_call", "map_batched_per_page", "unmap_1_page_per_call",
           "unmap_batched_per_page", "release"]
    fig, axes = plt.subplots(1, len(backends), figsize=(7 * len(backends), 4.5), squeeze=False)
    for ax, name in zip(axes[0], backends):
        rows = [r for r in results if r["backend"] == name]
        width = 0.8 / len(rows)
        for j, r in enumerate(rows):
            xs = [i + j * width for i in range(len(ops))]
            ax.bar(xs, [r["ops"][op]["mean_us"] for op in ops], width, label=f"{r['page_size'] // KiB} KiB")
            if "floor" in r:
                floor = r["floor"]["raw_mmap_map" if name == "host" else "raw_cuda_map_set_access"]["mean_us"]
                ax.hlines(floor, -0.4, len(ops), colors=f"C{j}", linestyles="dotted", linewidth=1)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))])
        ax.set_xticklabels([op.replace("_", "\n") for op in ops], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("µs (mean)")
        ax.set_title(f"{name} backend (dotted: raw " + ("mmap" if name == "host" else "cuMemMap+SetAccess")
                     + " floor)")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_plot(fig, stem)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=256, help="pages per measurement (default 256)")
    p.add_argument("--backends", default=None, help="comma list; default: every available backend")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args()
    names = args.backends.split(",") if args.backends else available_backends()
    m = machine()
    results: list[dict] = []
    not_measured: list[str] = []
    cases = [(b, ps) for b in names for ps in page_sizes(b, not_measured)]
    for i, (name, ps) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {name} backend, {ps // KiB} KiB pages ...", flush=True)
        r = measure(name, ps, args.pages)
        results.append(r)
        o = r["ops"]
        line = (f"    create {o['create']['mean_us']:.1f} us, map {o['map_batched_per_page']['mean_us']:.2f} us/page "
                f"(1/call {o['map_1_page_per_call']['mean_us']:.2f}), unmap {o['unmap_batched_per_page']['mean_us']:.2f} "
                f"us/page, bandwidth {r['bandwidth_gb_s']['map']:.1f} GB/s")
        if name == "host":
            line += (f"; raw mmap floor {r['floor']['raw_mmap_map']['mean_us']:.2f} us ({r['map_over_floor']:.2f}x); "
                     f"first touch {o['first_touch_per_page']['mean_us']:.2f} us/page (raw "
                     f"{r['floor']['raw_mmap_touch']['mean_us']:.2f}), populate {o['populate_per_page']['mean_us']:.2f}"
                     f" us/page, first touch after it {o['first_touch_after_populate_per_page']['mean_us']:.2f}\n    "
                     + describe_ratio("map + first touch, lazy / populated", r["map_and_touch_populate_gain"])
                     + "\n    " + describe_ratio("A/A, lazy twice", r["map_and_touch_aa"]))
        else:
            line += (f"; raw cuMemMap+SetAccess {r['floor']['raw_cuda_map_set_access']['mean_us']:.2f} us "
                     f"({r['map_over_floor']:.2f}x), unmap {r['unmap_over_floor']:.2f}x raw; "
                     f"unmap {r['facts']['unmap']}")
        print(line, flush=True)
    for line in not_measured:
        print("not measured:", line)
    slug = machine_slug(m)
    path = write_json(f"vmm_latency_{slug}", {"benchmark": "vmm_latency", "machine": m, "commit": git_revision(ROOT),
                                              "results": results, "not_measured": not_measured})
    print(f"wrote {path}")
    if not args.no_plot:
        plot(results, f"vmm_latency_{slug}", f"VMM operation latency — {m['gpu'] or m['cpu']} ({m['cores']} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
