"""What surrounds the host attention kernel's arithmetic (that is
test_cpu_attention.py): which path runs by default and under
VATTN_CPU_ATTN_ISA, how calls use threads (a small call stays on one,
concurrent callers agree, torch's OpenMP threads or a pool of its own, a
forked child), bad input, and the mapping checks: a batch that would read
rows past a request's mapping, or an unallocated reqid, raises before the
kernel reads anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import vattn
from kernels.host_attention_cases import ISAS, VECTOR_ISA, DenseCase
from vattn.attention import AttentionBatch, attention, host_attention, host_attention_info, sdpa_attention
from vattn.core.manager import MappedCheck
from vattn.kernels import KERNELS

# ---- paths and threads -------------------------------------------------------------------


def test_the_default_path_is_the_fastest_this_cpu_has() -> None:
    """AMX, then AVX-512 with AVX512_BF16 (VDPBF16PS), AVX-512, AVX2; SVE at
    256 bits, NEON; scalar: the first of these the CPU supports is the default."""
    info = host_attention_info()
    fastest_first = ["amx", "avx512_bf16", "avx512", "avx2", "sve256", "neon", "scalar"]
    assert info["best_isa"] == next(i for i in fastest_first if i in info["supported"]), info
    assert sorted(info["supported"]) == sorted(i for i in fastest_first if i in info["supported"])


def test_a_call_too_small_to_share_stays_on_one_thread() -> None:
    """Handing items to another thread and waiting for it costs more than a
    few microseconds of work saves: a small decode is one item (no head or
    key split), a long one is cut for every thread of the pool."""
    small = AttentionBatch([0], [127], [1])
    assert small.plan(KERNELS["host"]).native.num_items(group_size=4, heads_kv=2, head_dim=64) == (1, 0)
    if host_attention_info()["threads"] > 1:
        long = AttentionBatch([0], [4095], [1])
        items, groups = long.plan(KERNELS["host"]).native.num_items(group_size=4, heads_kv=2, head_dim=64)
        assert items >= host_attention_info()["threads"] and groups > 0, (items, groups)


def test_concurrent_calls_from_many_threads_agree() -> None:
    """Callers on several threads at once (each its own batch, split-KV
    decodes that use the per-thread split buffers, prefill chunks, fp32
    prompts whose values each call packs in its thread's buffer) get the
    same results as one call at a time."""
    cases = []
    for i in range(4):
        lens = [2000 + 300 * i, 700, 1]
        batch = AttentionBatch([0, 1, 2], [n - 1 for n in lens], [1, 1, 1]) if i % 2 else \
            AttentionBatch([0, 1], [1500 + 100 * i, 0], [1, 33])
        case = DenseCase(batch, 8, 2, 64, torch.bfloat16, max_len=3000, seed=i)
        alone = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
        cases.append((case, alone))
    for i in range(2):  # 2 kv heads of 64 in a 2-layer view: fp32 tokens 1 KiB apart, packed
        batch = AttentionBatch([1, 0], [200 + 50 * i, 300], [150 - 40 * i, 1])
        case = DenseCase(batch, 8, 2, 64, torch.float32, max_len=400, layers=2, seed=10 + i)
        alone = host_attention(case.q, case.k_cache, case.v_cache, batch, k=case.k, v=case.v)
        cases.append((case, alone))
    errors: list[str] = []

    def hammer(i: int) -> None:
        case, alone = cases[i]
        for n in range(30):
            out = host_attention(case.q, case.k_cache, case.v_cache, case.batch)
            if not torch.equal(out, alone):
                errors.append(f"thread {i} call {n}")
                return

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_decode_requests_go_to_l2_on_cores_with_a_small_l1() -> None:
    """Decode items from memory request their next tile's lines into L2 on
    cores whose L1 data cache is under 48 KiB (a Zen 4's 32 KiB: 1.0-2.0x
    as fast as into L1 there), into L1 on the others (48 KiB and more) and
    where the C library cannot tell the size; the choice is in the info."""
    # glibc's sysconf, as the kernel asks it (Python's os.sysconf does not know this name)
    try:
        l1d = int(subprocess.run(["getconf", "LEVEL1_DCACHE_SIZE"], capture_output=True, text=True).stdout)
    except (OSError, ValueError):
        pytest.skip("needs getconf: it tells the L1 data cache's size as the kernel's sysconf reads it")
    expected = "l2" if 0 < l1d < 48 << 10 else "l1"
    assert host_attention_info()["decode_prefetch"] == expected, l1d


# ---- bad input ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> DenseCase:
    return DenseCase(AttentionBatch([1, 0], [3, 0], [1, 4]), 4, 2, 64, torch.float16, max_len=8)


def test_bad_dtypes_raise_type_error(small: DenseCase) -> None:
    c, b = small, small.batch
    with pytest.raises(TypeError, match="k must have the cache's dtype"):
        host_attention(c.q, c.k_cache, c.v_cache, b, k=c.k.float(), v=c.v.float())
    with pytest.raises(TypeError, match="q must be float32, bfloat16 or float16"):
        host_attention(c.q.to(torch.int32), c.k_cache, c.v_cache, b)
    with pytest.raises(TypeError, match="k_cache and v_cache dtypes differ"):
        host_attention(c.q, c.k_cache, c.v_cache.float(), b)
    with pytest.raises(TypeError, match="out must have q's dtype"):
        host_attention(c.q, c.k_cache, c.v_cache, b, out=torch.empty(c.q.shape))


# Each bad argument its own test, so that a crash names the case (faulthandler shows the test, not the loop).
BAD_SHAPES = {
    "q_rows": (lambda c: dict(q=c.q[:4]), r"q must have num_tokens = 5 rows"),
    "q_rank": (lambda c: dict(q=c.q[None]), r"q must be \[num_tokens, num_heads_q, head_dim\], got 4-D"),
    "q_heads": (lambda c: dict(q=c.q[:, :3]),
                r"q heads \(3\) must be a positive multiple of the cache's kv heads \(2\)"),
    "q_stride": (lambda c: dict(q=c.q.transpose(1, 2).contiguous().transpose(1, 2)),
                 r"q must be contiguous in its last dimension"),
    "cache_shapes": (lambda c: dict(k_cache=c.k_cache[..., :32]), r"k_cache and v_cache shapes differ"),
    "cache_stride": (lambda c: dict(k_cache=c.k_cache.transpose(2, 3), v_cache=c.v_cache.transpose(2, 3)),
                     r"k_cache must be contiguous in its last dimension"),
    "cache_batch": (lambda c: dict(k_cache=c.k_cache[:1], v_cache=c.v_cache[:1]),
                    r"reqids must be in \[0, 0\] for this cache"),
    "cache_length": (lambda c: dict(k_cache=c.k_cache[:, :3], v_cache=c.v_cache[:, :3]),
                     r"cached_lens \+ query_lens must be <= 3 \(the cache's max_context_len\), got 4"),
    "k_alone": (lambda c: dict(k=c.k), r"k and v must be given together"),
    "kv_heads": (lambda c: dict(k=c.k[:, :1], v=c.v[:, :1]), r"k must be \[5, 2, 64\]"),
    "out_shape": (lambda c: dict(out=torch.empty(5, 4, 32, dtype=torch.float16)), r"out must have q's shape"),
    "window": (lambda c: dict(sliding_window=-1), r"sliding_window must be >= 0"),
    "soft_cap": (lambda c: dict(logits_soft_cap=-1.0), r"logits_soft_cap must be a finite value >= 0"),
    "scale": (lambda c: dict(softmax_scale=float("nan")), r"softmax_scale must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shapes_and_strides_raise_value_error(small: DenseCase, case: str) -> None:
    override, message = BAD_SHAPES[case]
    args = dict(q=small.q, k_cache=small.k_cache, v_cache=small.v_cache, batch=small.batch)
    args.update(override(small))
    with pytest.raises(ValueError, match=message):
        host_attention(**args)


def test_bad_plans_raise(small: DenseCase) -> None:
    from vattn import _cpu_attn

    with pytest.raises(ValueError, match="distinct"):
        _cpu_attn.Plan([0, 0], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="query_lens must be >= 1"):
        _cpu_attn.Plan([0], [1], [0])
    with pytest.raises(TypeError, match="reqids must hold ints"):
        _cpu_attn.Plan([0.5], [1], [1])
    plan = _cpu_attn.Plan([0], [1], [1])
    for bad in (dict(group_size=0, heads_kv=1), dict(group_size=1, heads_kv=0)):  # a division by zero once
        with pytest.raises(ValueError, match="group_size and heads_kv must be >= 1"):
            plan.num_items(**bad)
    with pytest.raises(ValueError, match="window must be >= 0"):
        plan.num_items(group_size=1, heads_kv=1, window=-1)
    with pytest.raises(ValueError, match="isa must be one of"):
        host_attention(small.q, small.k_cache, small.v_cache, small.batch, isa="sse9")
    args = dict(q=small.q, k_cache=small.k_cache, v_cache=small.v_cache)
    extra = dict(k=small.k_cache[0, :1], v=small.v_cache[0, :1], out=torch.empty_like(small.q))
    for name in [*args, *extra]:  # each argument is checked, and named
        moved = {**args, **extra, name: {**args, **extra}[name].to("meta")}
        with pytest.raises(ValueError, match=f"needs CPU tensors, got {name} on meta"):
            host_attention(batch=small.batch, **moved)


@pytest.fixture
def mapped_cache():
    """A manager mapping exactly one page (``t`` tokens) of reqid 0 and none
    of reqid 1, which is allocated; reqid 2 is free. Rows past a mapping fault
    when read, so a check that ran after the kernel read would crash the test."""
    kv = vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                              max_context_len=2048, page_size=64 << 10,
                              policy={"background": False, "deferred_reclaim": False, "eager": False,
                                      "lookahead_tokens": 0})
    t = kv.page_size // kv.config.token_bytes_per_buffer
    assert (kv.alloc_reqid(), kv.alloc_reqid()) == (0, 1)
    assert kv.step([t, 0, 0, 0])
    yield kv, t
    kv.cleanup()


ADAPTERS = {"host_attention": host_attention, "attention": attention, "sdpa_attention": sdpa_attention}


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("layout_view", ["layer", "kv_tensor"])
def test_rows_past_the_mapping_or_unallocated_reqids_raise(mapped_cache, adapter: str, layout_view: str) -> None:
    kv, t = mapped_cache
    fn = ADAPTERS[adapter]
    k_cache, v_cache = kv.layer(1) if layout_view == "layer" else tuple(kv.kv_tensor(1))
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    new = torch.randn(1, 2, 64, dtype=torch.float16)
    fn(q, k_cache, v_cache, AttentionBatch([0], [t - 1], [1]), k=new, v=new)  # the last mapped row: fine
    cases = [
        (AttentionBatch([0], [t], [1]), rf"reqid 0 would read {t + 1} tokens but has {t} mapped"),
        (AttentionBatch([0], [0], [t + 1]), rf"reqid 0 would read {t + 1} tokens but has {t} mapped"),
        (AttentionBatch([1], [0], [1]), r"reqid 1 would read 1 tokens but has 0 mapped"),
        (AttentionBatch([0, 2], [3, 0], [1, 1]), r"reqid 2 is not allocated"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(torch.randn(batch.num_tokens, 4, 64, dtype=torch.float16), k_cache, v_cache, batch)
        with pytest.raises(ValueError, match=message):  # and before any new row is written
            fn(torch.randn(batch.num_tokens, 4, 64, dtype=torch.float16), k_cache, v_cache, batch,
               k=torch.randn(batch.num_tokens, 2, 64, dtype=torch.float16),
               v=torch.randn(batch.num_tokens, 2, 64, dtype=torch.float16))


def test_every_call_is_checked_and_views_keep_their_slots(mapped_cache) -> None:
    kv, t = mapped_cache
    k_cache, v_cache = kv.layer(0)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    batch = AttentionBatch([0], [t - 1], [1])
    host_attention(q, k_cache, v_cache, batch)
    kv.free_reqid(0)  # unmapped at once (no deferred reclaim): the same batch must not read it now
    with pytest.raises(ValueError, match="vattn.s host kernel: reqid 0 is not allocated"):
        host_attention(q, k_cache, v_cache, batch)
    # a slice of the cache: its row 0 is reqid 1 (allocated, nothing mapped) and row 1 token 0 is token 1
    with pytest.raises(ValueError, match="reqid 1 would read 1 tokens but has 0 mapped"):
        host_attention(q, k_cache[1:], v_cache[1:], AttentionBatch([0], [0], [1]))
    kv.alloc_reqid(reqid=0)
    assert kv.step([t, 0, 0, 0])
    with pytest.raises(ValueError, match=rf"reqid 0 would read {t + 1} tokens but has {t} mapped"):
        host_attention(q, k_cache[:, 1:], v_cache[:, 1:], AttentionBatch([0], [t - 1], [1]))
    with pytest.raises(ValueError, match="a view of the vattn cache must have its reqid and token strides"):
        host_attention(q, k_cache[::2], v_cache[::2], AttentionBatch([0], [0], [1]))


def test_the_core_is_asked_again_only_after_a_slice_shrinks(mapped_cache) -> None:
    """A batch's mapping check runs per layer; it asks the core once, then
    again only when a slice lost positions or a reqid was freed (growth keeps
    every check valid)."""
    kv, t = mapped_cache

    class CountingPages:
        def __init__(self, pages) -> None:
            self.pages, self.asked = pages, 0

        @property
        def shrinks(self) -> int:
            return self.pages.shrinks

        def check_mapped(self, *args) -> None:
            self.asked += 1
            self.pages.check_mapped(*args)

    pages = CountingPages(kv._pages)
    check = MappedCheck(pages, [0], [t], (0, 0), "probe")
    for _ in range(4):  # four layers
        check()
    assert pages.asked == 1
    assert kv.step([2 * t, 5, 0, 0])  # slices grow: still valid
    check()
    assert pages.asked == 1
    kv.free_reqid(1)  # a shrink elsewhere: asked again, and still true
    check()
    check()
    assert pages.asked == 2
    kv.free_reqid(0)
    with pytest.raises(ValueError, match="probe: reqid 0 is not allocated"):
        check()
    with pytest.raises(ValueError, match="probe: reqid 0 is not allocated"):  # a failed check is not cached
        check()


def test_a_cache_at_a_closed_caches_addresses_is_checked_as_itself() -> None:
    """After cleanup its addresses may go to a new manager: the check must ask
    the new one, never the closed one (kept alive here), though a view at the
    same place and strides was checked against the closed one before."""
    kwargs = dict(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.float32, max_batch_size=2,
                  max_context_len=64, page_size=4096, policy={"background": False, "eager": False})
    q = torch.randn(1, 2, 64)
    closed = vattn.KVCacheManager(**kwargs)
    for reqid in range(2):
        closed.alloc_reqid(reqid=reqid)
    assert closed.step([5, 5])
    host_attention(q, *closed.layer(0), AttentionBatch([1], [4], [1]))  # its views' owner is remembered
    closed_span = closed._span
    closed.cleanup()
    with vattn.KVCacheManager(**kwargs) as kv:
        assert kv._span == closed_span  # the same addresses: the remembered owner must not be used
        r = kv.alloc_reqid()
        lens = [0, 0]
        lens[r] = 5
        assert kv.step(lens)
        k_cache, v_cache = kv.layer(0)
        out = host_attention(q, k_cache, v_cache, AttentionBatch([r], [4], [1]))
        assert out.shape == q.shape
        with pytest.raises(ValueError, match=f"reqid {1 - r} is not allocated"):
            host_attention(q, k_cache, v_cache, AttentionBatch([1 - r], [0], [1]))


def test_calls_are_counted_per_path() -> None:
    batch = AttentionBatch([0], [3], [1])
    case = DenseCase(batch, 4, 2, 64, torch.float32, max_len=8)
    for isa in ISAS:
        before = host_attention_info()["calls"][isa]
        host_attention(case.q, case.k_cache, case.v_cache, batch, isa=isa)
        assert host_attention_info()["calls"][isa] == before + 1


def test_isa_env_forces_a_lower_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "scalar")
    assert host_attention_info()["isa"] == "scalar"
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "nonsense")
    info = host_attention_info()
    assert info["isa"] == info["best_isa"] and "ignored" in info["note"]


POOL_SCRIPT = """
import os, sys, torch
from vattn.attention import AttentionBatch, host_attention, host_attention_info, sdpa_attention
torch.manual_seed(0)
batch = AttentionBatch([1, 0, 2], [300, 0, 57], [1, 40, 1])
k_cache, v_cache = torch.randn(3, 341, 2, 64), torch.randn(3, 341, 2, 64)
q = torch.randn(batch.num_tokens, 8, 64)
expected = sdpa_attention(q, k_cache, v_cache, batch)
def ok():
    return (host_attention(q, k_cache, v_cache, batch) - expected).abs().max().item() < 2e-5
assert ok()
print(host_attention_info()["pool"], flush=True)
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:
        os._exit(0 if ok() and host_attention_info()["pool"] == "own" else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the forked child's kernel failed"
    assert ok()
print("done")
"""


def run_pool_script(mode: str, **env: str) -> str:
    """The kernel in a fresh interpreter (the pool is chosen once per process),
    with this checkout's vattn first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), **env)
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          env=environ, cwd=root)
    assert proc.returncode == 0 and proc.stdout.endswith("done\n"), proc.stdout + proc.stderr[-3000:]
    return proc.stdout.splitlines()[0]


def test_runs_on_torchs_openmp_threads_or_its_own_pool() -> None:
    """With torch loaded, jobs run on its OpenMP runtime's threads (one set of
    threads for the framework's ops and attention); VATTN_CPU_ATTN_POOL=own
    gives the kernel a pool of its own. Both compute the same."""
    assert host_attention_info()["pool"].startswith("openmp (")
    assert run_pool_script("plain", VATTN_CPU_ATTN_POOL="own") == "own"
    assert run_pool_script("plain", VATTN_CPU_ATTN_THREADS="3").startswith("openmp (")


def test_a_forked_child_runs_the_kernel_on_a_pool_of_its_own() -> None:
    """The parent's OpenMP team does not exist in a fork: the child must not
    wait on it (the test would time out) and must get the same output."""
    assert run_pool_script("fork").startswith("openmp (")
    assert run_pool_script("fork", VATTN_CPU_ATTN_POOL="own") == "own"


def test_info_names_the_active_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from vattn.cli.info import collect, render

    assert f"host attention kernel: {VECTOR_ISA} path" in render(collect())
    monkeypatch.setenv("VATTN_CPU_ATTN_ISA", "scalar")
    assert "host attention kernel: scalar path" in render(collect())
