"""Registry.open_many over the emulated driver: an owner (tests/progs/owner under the shim) holds
two small buffers that share one pooled chunk, one of 3 MiB and one stream-ordered; open_many opens
ranges of them in one call (vmm_import_many).  Checks the bytes, that ranges of one chunk lie in one
mapping (their pointers are as far apart as in the owner), all-or-nothing on a bad range (the error
names it), bad arguments, and a freed owner's buffers.  Ends with "N passed, N failed"."""
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


def main():
    own = None
    try:
        own = Owner("3", "0.01", "0.01", "1a")
        reg = vmmshim.Registry()
        test_open_many(reg, own)
        test_errors(reg, own)
        test_freed(reg, own)
        reg.close()
    finally:
        if own:
            own.end()
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
