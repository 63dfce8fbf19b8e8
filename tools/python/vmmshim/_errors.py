"""One exception class per vmm_status; str(e) is the library's one-line reason."""


class Error(Exception):
    """A failed vmmshim call.  status is the vmm_status (None when the library was not reached)."""
    status = None

    def __init__(self, reason, status=None):
        super().__init__(reason)
        if status is not None:
            self.status = status


class LibraryNotFound(Error):
    """libvmmshim-client.so could not be loaded."""


class InvalidArgument(Error):
    status = 1


class NotFound(Error):
    """No registry, or no such process or allocation."""
    status = 2


class Access(Error):
    """Permission denied (the registry, or the owner's broker)."""
    status = 3


class Corrupt(Error):
    """The registry is not a valid vmmshim segment."""
    status = 4


class VersionMismatch(Error):
    """The registry's layout is newer than the library reads."""
    status = 5


class Busy(Error):
    """A writer is mid-update (or died mid-update): retry, or run `vmmctl gc`."""
    status = 6


class Stale(Error):
    """The allocation was freed since it was read."""
    status = 7


class OwnerDead(Error):
    """The owning process has exited."""
    status = 8


class CudaError(Error):
    """A CUDA driver call failed; the reason names it."""
    status = 9


class OutOfMemory(Error):
    status = 10


class IOFailure(Error):
    status = 11


class NotUnderShim(Error):
    """Owner side (vmmshim.publish): this process does not run under an active libvmmshim.so."""
    status = 12


class Paused(Error):
    """The owner paused this memory (vmm_pause): import it once the owner resumes it."""
    status = 13


class WrongState(Error):
    """Owner side: a pause of memory paused already, or a resume of memory not paused (a no-op)."""
    status = 14


# Tracebacks name them as the package exports them: vmmshim.NotFound.
for _cls in (Error, LibraryNotFound, InvalidArgument, NotFound, Access, Corrupt, VersionMismatch, Busy, Stale,
             OwnerDead, CudaError, OutOfMemory, IOFailure, NotUnderShim, Paused, WrongState):
    _cls.__module__ = "vmmshim"

BY_STATUS = {cls.status: cls for cls in (InvalidArgument, NotFound, Access, Corrupt, VersionMismatch, Busy, Stale,
                                         OwnerDead, CudaError, OutOfMemory, IOFailure, NotUnderShim, Paused,
                                         WrongState)}
