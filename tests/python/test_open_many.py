"""Registry.open_many over the emulated driver: an owner (tests/progs/owner under the shim) holds
two small buffers that share one pooled chunk, one of 3 MiB and one stream-ordered; open_many opens
ranges of them in one call (vmm_import_many).  Checks the bytes, that ranges of one chunk lie in one
mapping (their pointers are as far apart as in the owner), all-or-nothing on a bad range (the error
names it), bad arguments, and a freed owner's buffers.  Then an owner of 70 buffers of 2 MiB (70
chunks): one open_many is one broker request, 70 handles in 2 messages, one reservation and one
cuMemSetAccess (timing=True, and the emulated driver's counters), its Python share per range printed.
Ends with "N passed, N failed"."""
import os
import types

import harness
from harness import Owner, fnv1a, pattern

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()


def test_open_many(reg, own):
    (b0, s0, f0), (b1, s1, f1), (b2, s2, f2), (b3, s3, f3) = own.buffers
    a1, a2 = reg.find(own.pid, b1), reg.find(own.pid, b2)
    T.check(a1.chunk_id == a2.chunk_id, f"the two small buffers share a chunk: {a1.chunk_id} {a2.chunk_id}")
    bufs = reg.open_many(own.pid, [(b1, None), (b2 + 7, None), (b1 + 100, 50), (b0, None), (b0 + 4096, 8192),
                                   (b3, s3)])
    T.check(len(bufs) == 6, f"{len(bufs)} buffers for 6 ranges")
    whole = [(0, b1, s1, f1, 1), (1, b2, s2, f2, 2), (3, b0, s0, f0, 0), (5, b3, s3, f3, 3)]
    for i, address, size, fnv, index in whole:
        b = bufs[i]
        T.check(b.address == address and b.size == size and b.allocation.address == address,
                f"range {i}: {b.address:#x} {b.size} (want {address:#x} {size})")
        T.check(fnv1a(b.read()) == fnv, f"range {i}: bytes differ from the owner's buffer {index}")
    T.check(bufs[2].address == b1 + 100 and bufs[2].size == 50 and bufs[2].read() == pattern(1, 100, 50),
            "range 2: a piece of buffer 1")
    T.check(bufs[4].size == 8192 and bufs[4].read() == pattern(0, 4096, 8192), "range 4: a piece of buffer 0")
    # one chunk, one mapping: the pointers lie as far apart as the owner's addresses
    T.check(bufs[1].ptr - bufs[0].ptr == b2 - b1 and bufs[2].ptr - bufs[0].ptr == 100 and
            bufs[4].ptr - bufs[3].ptr == 4096, "ranges of one chunk are not in one mapping")
    T.raises(vmmshim.InvalidArgument, lambda: bufs[2].read(40, 20), "a read past a 50-byte range", "50")
    for b in bufs:
        b.check()
        b.close()
    T.check(reg.open_many(own.pid, []) == [], "no ranges: an empty list")


def test_errors(reg, own):
    b0 = own.buffers[0][0]
    e = T.raises(vmmshim.NotFound, lambda: reg.open_many(own.pid, [(b0, None), (0x10, 8)]), "a bad address",
                 "range 1 of 2")
    T.check(e is None or "0x10" in str(e), f"the error names the address: {e}")
    T.raises(vmmshim.NotFound, lambda: reg.open_many(own.pid, [(b0, 1 << 40), (b0, None)]),
             "a range past its allocation", "range 0 of 2")
    T.raises(ValueError, lambda: reg.open_many(own.pid, [(b0, 0)]), "size 0")
    T.raises(TypeError, lambda: reg.open_many(own.pid, [b0]), "not a pair")
    # after a failure the good ranges open again, with the same bytes
    bufs = reg.open_many(own.pid, [(b0, 16)])
    T.check(bufs[0].read() == pattern(0, 0, 16), "opening again after a failure")
    bufs[0].close()


def test_freed(reg, own):
    b0, b1 = own.buffers[0][0], own.buffers[1][0]
    held = reg.open_many(own.pid, [(b1, None)])[0]
    T.check(own.command("free") == "freed", "the owner frees its buffers")
    T.raises(vmmshim.NotFound, lambda: reg.open_many(own.pid, [(b0, None), (b1, None)]), "freed buffers",
             "range 0 of 2")
    T.raises(vmmshim.Stale, held.check, "check() of a held range its owner freed")
    T.check(held.read(0, 16) == pattern(1, 0, 16), "a held range still reads after the free")
    held.close()


def counters():
    return types.SimpleNamespace(**harness.fakecuda_counters())


def test_batch(reg):
    own = Owner(*["2"] * 70)
    try:
        ranges = [(address, None) for address, _, _ in own.buffers]
        c0 = counters()
        bufs, t = reg.open_many(own.pid, ranges, timing=True)
        c1 = counters()
        T.check(len(bufs) == 70 and all(fnv1a(b.read()) == f for b, (_, _, f) in zip(bufs[:5], own.buffers)),
                "70 buffers: the owner's bytes")
        T.check(t["requests"] == 1 and t["messages"] == 2 and t["handles"] == 70 and t["chunks_new"] == 70 and
                t["reserves"] == 1 and t["access_calls"] == 1 and t["maps"] == 70 and t["ranges"] == 70,
                f"70 buffers: one request, 2 messages, 70 handles, one reservation and SetAccess: {t}")
        T.check(c1.imports - c0.imports == 70 and c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess == 1 and
                c1.reservations_live - c0.reservations_live == 1,
                f"70 buffers: the driver saw {c1.imports - c0.imports} imports, "
                f"{c1.calls_cuMemSetAccess - c0.calls_cuMemSetAccess} SetAccess, "
                f"{c1.reservations_live - c0.reservations_live} reservations")
        steps = ("find_ns", "connect_ns", "broker_ns", "import_ns", "reserve_ns", "map_ns", "access_ns", "release_ns")
        T.check(t["total_ns"] >= t["library_ns"] > 0 and t["python_ns"] == t["total_ns"] - t["library_ns"] and
                t["library_total_ns"] <= t["library_ns"] and sum(t[k] for k in steps) <= t["library_total_ns"],
                f"70 buffers: the timing adds up: {t}")
        print(f"stat: open_many of 70 chunks: {t['total_ns'] / 1e3:.0f} us, of it Python "
              f"{t['python_ns'] / 70 / 1e3:.1f} us a range, the library {t['library_ns'] / 1e3:.0f} us (find "
              f"{t['find_ns'] / 1e3:.0f}, broker {t['broker_ns'] / 1e3:.0f}, import {t['import_ns'] / 1e3:.0f}, map "
              f"{t['map_ns'] / 1e3:.0f}, access {t['access_ns'] / 1e3:.0f})")
        for b in bufs:
            b.close()
        # the same with three importing threads, and a bad setting
        os.environ["VMMSHIM_IMPORT_THREADS"] = "3"
        try:
            vmmshim.drop_idle()  # the next open imports afresh
            bufs, t = reg.open_many(own.pid, ranges, timing=True)
            T.check(t["threads"] == 3 and t["handles"] == 70 and fnv1a(bufs[69].read()) == own.buffers[69][2],
                    f"3 threads: {t['threads']} threads, {t['handles']} handles, the owner's bytes")
            for b in bufs:
                b.close()
            os.environ["VMMSHIM_IMPORT_THREADS"] = "many"
            T.raises(vmmshim.InvalidArgument, lambda: reg.open_many(own.pid, ranges[:2]), "VMMSHIM_IMPORT_THREADS=many",
                     "VMMSHIM_IMPORT_THREADS")
        finally:
            del os.environ["VMMSHIM_IMPORT_THREADS"]
        # cached: nothing fetched, and the buffers' records are the library's
        bufs, t = reg.open_many(own.pid, ranges[:3] + [(own.buffers[0][0] + 4096, 4096)], timing=True)
        T.check(t["handles"] == 0 and t["requests"] == 0 and t["chunks_cached"] == 4 and
                bufs[3].allocation.address == own.buffers[0][0] and bufs[3].address == own.buffers[0][0] + 4096,
                f"chunks mapped already: {t['handles']} handles, {t['requests']} requests, {t['chunks_cached']} cached")
        for b in bufs:
            b.close()
    finally:
        own.end()


def main():
    own = None
    try:
        own = Owner("3", "0.01", "0.01", "1a")
        reg = vmmshim.Registry()
        test_open_many(reg, own)
        test_errors(reg, own)
        test_freed(reg, own)
        test_batch(reg)
        reg.close()
    finally:
        if own:
            own.end()
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
