"""Shared pages at their edges: prefix handles dropped without release() or
used in a forked child, page ids given to map_pages in the wrong shape, and
what the external page allocator refuses (issue 25, defects 4, 5, 7, 9)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import vattn
from conftest import assert_invariants

PAGE = 4096  # 32 tokens of 128 bytes (2 KV heads x 16 x fp32)


def make(**options) -> vattn.KVCacheManager:
    return vattn.KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, max_batch_size=4,
                                max_context_len=128, page_size=PAGE, **options)


def stepped(kv: vattn.KVCacheManager, tokens: int) -> int:
    r = kv.alloc_reqid()
    lens = [0] * kv.config.max_batch_size
    lens[r] = tokens
    assert kv.step(lens)
    return r


def test_a_dropped_handle_returns_its_pages():
    """Defect 4: a handle dropped without release() kept its pages until cleanup()."""
    kv = make(policy={"background": False, "deferred_reclaim": False})
    try:
        r = stepped(kv, 96)
        h = kv.retain_prefix(r, 96)
        kv.free_reqid(r)  # the handle alone holds the 3 pages now
        assert kv.stats()["prefix_handles"] == 1 and kv.stats()["pages_in_use"] == 3 * 4
        kept = kv.retain_prefix(stepped(kv, 40), 40)  # a live handle is not disturbed
        del h
        gc.collect()
        assert kv.stats()["prefix_handles"] == 1
        assert kv.stats()["pages_in_use"] == 2 * 4  # the 40-token request's 2 pages
        assert len(kept.page_ids) == 1
        assert_invariants(kv)
    finally:
        kv.cleanup()


def test_handles_outliving_their_manager_or_the_interpreter_are_quiet():
    """A handle collected after cleanup(), and handles still alive at
    interpreter exit (with their manager, or after its cleanup), release
    nothing twice and print nothing."""
    kv = make(policy={"background": False})
    h = kv.retain_prefix(stepped(kv, 64), 64)
    kv.cleanup()
    assert h.released
    h.release()
    del h
    gc.collect()
    script = (
        "import torch, vattn\n"
        "kv = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=32, dtype=torch.float32,\n"
        "                          max_batch_size=2, max_context_len=64, page_size=4096)\n"
        "r = kv.alloc_reqid(); assert kv.step([64, 0] if r == 0 else [0, 64])\n"
        "held = [kv.retain_prefix(r, 64) for _ in range(3)]\n"
        "cycle = [kv.retain_prefix(r, 32)]; cycle.append(cycle)  # only the cyclic collector frees it\n"
        "other = vattn.KVCacheManager(num_layers=1, num_kv_heads=1, head_dim=32, dtype=torch.float32,\n"
        "                             max_batch_size=2, max_context_len=64, page_size=4096)\n"
        "o = other.alloc_reqid(); other.step([64, 0] if o == 0 else [0, 64]); late = other.retain_prefix(o, 64)\n"
        "other.cleanup()\n"
        "print('done')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n" and out.stderr == ""


def test_a_handle_in_a_forked_child_raises_forked_error():
    """Defect 5: in a forked child a handle said it was released (page_ids) and
    release() returned normally, marking it released. Now every use raises
    ForkedError, collecting it does nothing, and the parent's handle is intact."""
    kv = make(policy={"background": False})
    try:
        r = stepped(kv, 64)
        h = kv.retain_prefix(r, 64)
        ids = h.page_ids
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            for use in (lambda: h.page_ids, lambda: h.released, h.release, lambda: kv.attach_prefix(h, 0)):
                try:
                    use()
                    code = 1
                except vattn.ForkedError:
                    pass
                except BaseException:  # noqa: BLE001 - any other outcome is a failure
                    code = 2
            if code == 0 and "another process" not in repr(h):
                code = 3
            try:
                del h
                gc.collect()  # the finalizer must do nothing here, and say nothing
            except BaseException:  # noqa: BLE001
                code = 4
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not h.released and h.page_ids == ids
        assert kv.stats()["prefix_handles"] == 1
        h.release()
        assert h.released and kv.stats()["prefix_handles"] == 0
        assert_invariants(kv)
    finally:
        kv.cleanup()


@pytest.mark.parametrize("page_ids, what", [
    ([5], r"page_ids\[0\] is int 5, not a sequence"),
    (5, "got int"),
    (np.array([5]), "got a 1-D array"),
    (torch.tensor([5]), "got a 1-D array"),
    ([[5], 6], r"page_ids\[1\] is int 6"),
])
def test_flat_page_ids_without_counts_name_the_argument(page_ids, what):
    """Defect 7: map_pages([b], [0], [page_id]) raised "'int' object is not iterable"."""
    kv = make(policy={"background": False}, page_allocator="external")
    try:
        r = kv.alloc_reqid()
        kv.map_pages([r], [0], [[5, 6]])
        before = (kv.page_ids(r), kv.stats())
        with pytest.raises(TypeError, match=r"map_pages: page_ids must be one sequence of page ids per request, "
                                            r"e\.g\. \[\[3, 7\], \[3\]\] \(flat ids need counts=\).*" + what):
            kv.map_pages([r], [0], page_ids)
        assert (kv.page_ids(r), kv.stats()) == before
        kv.map_pages([r], [0], [7], [1])  # flat ids with counts: fine
        assert kv.page_ids(r) == [7]
        kv.map_pages([r], [0], np.array([[8, 9]]))  # a 2-D array is one row per request
        assert kv.page_ids(r) == [8, 9]
    finally:
        kv.cleanup()


def test_external_mode_errors_name_the_constructor_argument():
    """Defect 9: step, fork and retain_prefix named an option page_ids='external'."""
    kv = make(policy={"background": False}, page_allocator="external")
    try:
        r = kv.alloc_reqid()
        kv.map_pages([r], [0], [[0, 1]])
        for call in (lambda: kv.step([64, 0, 0, 0]), lambda: kv.fork(r, 32), lambda: kv.retain_prefix(r, 32)):
            with pytest.raises(ValueError, match=r"page_allocator='external'") as info:
                call()
            assert "page_ids=" not in str(info.value)
    finally:
        kv.cleanup()
