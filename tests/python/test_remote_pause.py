"""Registry.pause and Registry.resume (vmm_pause_process, vmm_resume_process: protocol v4) over the
emulated driver: owners run tests/progs/owner under the shim.  One without VMMSHIM_REMOTE_PAUSE is
refused (Access, naming the option) and reads as before; one with it is paused (a SleepReport, an
open refused with Paused), resumed (the same bytes), paused discarding by its tag, paused while
this process holds an import (the report names its pid; nobody when it let go), and told a
resume of nothing (WrongState), an unknown tag (NotFound), a dead owner (OwnerDead).  Ends with
"N passed, N failed"."""
import os

import harness
from harness import Owner, fnv1a

harness.setup()
import vmmshim  # noqa: E402  (after setup: sys.path, the client library)

T = harness.Tally()
MiB = 1 << 20


def main():
    plain = sleeper = None
    try:
        os.environ.pop("VMMSHIM_REMOTE_PAUSE", None)
        os.environ["VMMSHIM_TAG"] = "rollout"
        plain = Owner("2")
        reg = vmmshim.Registry()
        address, size, fnv = plain.buffers[0]
        T.raises(vmmshim.Access, lambda: reg.pause(plain.pid), "a pause without the opt-in", "VMMSHIM_REMOTE_PAUSE=1")
        T.raises(vmmshim.Access, lambda: reg.resume(plain.pid), "a resume without the opt-in", "does not accept")
        with reg.open(plain.pid, address) as buf:
            T.check(fnv1a(buf.read()) == fnv, "the refused owner's bytes changed")

        os.environ["VMMSHIM_REMOTE_PAUSE"] = "1"
        sleeper = Owner("3", "1a")
        address, size, fnv = sleeper.buffers[0]
        with reg.open(sleeper.pid, address) as buf:
            T.check(fnv1a(buf.read()) == fnv, "bytes before the pause")
        r = reg.pause(sleeper.pid)
        T.check(isinstance(r, vmmshim.SleepReport) and r.bytes_kept == 4 * MiB and r.allocations == 2 and
                r.bytes_released >= 4 * MiB and r.seconds > 0, f"pause report: {r!r}")
        # this process's import went idle in its cache, and let go during the owner's wait
        T.check(r.holders_known and r.n_holders == 0 and r.holders == [] and r.bytes_held == 0,
                f"a pause nobody holds: {r!r}")
        T.check(reg.find(sleeper.pid, address).flags & vmmshim.ALLOC_PAUSED, "the record is not marked paused")
        T.raises(vmmshim.Paused, lambda: reg.open(sleeper.pid, address), "an open while paused", "paused")
        T.raises(vmmshim.WrongState, lambda: reg.pause(sleeper.pid), "a second pause")
        r = reg.resume(sleeper.pid)
        T.check(r.bytes_kept == 4 * MiB and r.allocations == 2, f"resume report: {r!r}")
        with reg.open(sleeper.pid, address) as buf:
            T.check(fnv1a(buf.read()) == fnv, "the bytes after the resume differ")
        T.raises(vmmshim.WrongState, lambda: reg.resume(sleeper.pid), "a resume of nothing paused")
        T.raises(vmmshim.NotFound, lambda: reg.pause(sleeper.pid, tag="nosuchtag"), "an unknown tag")
        T.raises(vmmshim.InvalidArgument, lambda: reg.pause(sleeper.pid, keep=False, to_file=True), "discard to a file")
        r = reg.pause(sleeper.pid, tag="rollout", keep=False)
        T.check(r.bytes_kept == 0 and r.bytes_released >= 4 * MiB, f"discarding pause report: {r!r}")
        r = reg.resume(sleeper.pid, tag="rollout")
        T.check(r.bytes_released >= 4 * MiB and r.bytes_kept == 0, f"resume after a discard: {r!r}")
        with reg.open(sleeper.pid, address) as buf:
            T.check(buf.size == size, "open after the resume")
        # a live import through the pause: its holder (this process) is named in the report
        held = reg.open(sleeper.pid, address)
        r = reg.pause(sleeper.pid)
        T.check(r.holders_known and r.n_holders == 1 and r.holders == [os.getpid()] and
                size <= r.bytes_held <= r.bytes_released, f"a pause while this process holds an import: {r!r}")
        T.check("still held by pid" in repr(r), f"repr names the holder: {r!r}")
        held.close()
        r = reg.resume(sleeper.pid)
        T.check(r.bytes_held == 0 and r.n_holders == 0 and r.holders_known, f"a resume holds nothing: {r!r}")
        sleeper.kill()
        T.raises(vmmshim.OwnerDead, lambda: reg.pause(sleeper.pid), "a dead owner", "exited")
        reg.close()
    finally:
        for own in (plain, sleeper):
            if own:
                own.end()
        harness.cleanup()
    T.done()


if __name__ == "__main__":
    main()
