"""PyTorch's side of vmmshim.pause and resume, so that a process keeps working while some of its
memory sleeps.  Used only when the program imported torch itself and started CUDA; this module
never imports torch.

Two things in PyTorch outlive a pause without knowing of it:
- the caching allocator keeps free blocks inside segments that are now paused, and hands them out
  to the next tensor of a fitting size, on any thread;
- cuBLAS keeps a workspace per handle and stream, made before the pause.
So, once the shim paused (it waited for the device first, so no kernel still uses them), when the
paused memory lies under the default pool (always after a pause of everything):
- the cuBLAS workspaces are dropped (the next matmul makes a new one where allocations go now; one
  in paused memory is not handed out again while paused).  Not after a tag's pause that leaves the
  default pool alone: a CUDA graph captured earlier replays with the workspace it baked in, and
  faults once that is freed, so a pause of everything breaks graphs captured before it;
- with the native allocator (default and expandable_segments), while anything paused lies under a
  pool the program allocates from without asking (the default pool: always after a pause of
  everything; after a tag's pause only when the default pool has a segment in that tag's memory),
  every thread's allocations on every device go to a fresh private pool, as PyTorch routes them
  during a CUDA graph capture.  Once nothing is paused the route ends and the pool is let go:
  tensors made while paused stay valid, and its free blocks go back to the device at the next
  empty_cache() or when PyTorch runs short, as a captured graph's pool's do.
- under backend:cudaMallocAsync the shim's own pool already never hands out paused memory.

A CUDA graph captured while the route is on gets its memory from the graph's own pool: the route
steps aside for the capture (torch.cuda.CUDAGraph.capture_begin / capture_end), and allocations of
other threads during a capture go to the default pool then.  It steps aside as well for
torch.cuda.empty_cache(), which PyTorch refuses (an internal assert ends the process) while any
pool is allocated to; a MemPool deleted while routed empties its cache the same way from C++,
where nothing can step aside: delete pools once resumed, or inside stepped_aside().  Since 2.10
PyTorch takes the last begun pool that matches: a use_mem_pool() begun while routed gets its
allocations, but the route begun again after a capture or empty_cache() comes before a pool that
was begun earlier and is still in use."""
import contextlib
import sys
import threading

_lock = threading.RLock()
_state = {"all": False, "tags": set(), "route": None, "steps_aside": 0, "spent": []}
_patched = False


def _torch():
    """The program's torch with CUDA started, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:  # a torch without CUDA, or a half-imported one
        return None


def _native(torch):
    try:
        return torch.cuda.get_allocator_backend() == "native"
    except Exception:
        return False


def _clear_workspaces(torch):
    """Drop cuBLAS's workspaces (a later matmul makes new ones).  Only after the shim's pause waited
    for the device: freed before it, a workspace an earlier kernel still used could go to another
    stream's allocation meanwhile."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _default_pool_paused(torch, tag):
    """Whether a segment of PyTorch's default pool lies in paused memory of this process.  After
    a pause of everything it does; after a tag's pause the shim is asked (vmm_paused_overlaps)
    about the default pool's segments (under expandable_segments, any page of one)."""
    if tag is None:
        return True
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:
        return True  # cannot tell: route, which is always safe
    default = [(s["address"], s["total_size"]) for s in segments if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
    return bool(default) and _paused_overlaps(default) is not False


def _paused_overlaps(ranges):
    """Whether any of [(address, size)] overlaps this process's paused memory (vmm_paused_overlaps);
    None when the shim cannot say."""
    import ctypes
    overlaps = getattr(ctypes.CDLL(None), "vmm_paused_overlaps", None)
    if overlaps is None:
        return None
    overlaps.restype = ctypes.c_int
    overlaps.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    starts = (ctypes.c_uint64 * len(ranges))(*(a for a, _ in ranges))
    sizes = (ctypes.c_uint64 * len(ranges))(*(n for _, n in ranges))
    return bool(overlaps(starts, sizes, len(ranges)))


def cache_outside_paused(torch):
    """Whether empty_cache() would give the device some of PyTorch's cache that lies outside paused
    memory.  Cache inside paused memory is left alone where it can be: emptied, it would not come
    back at the resume, as torch_memory_saver's users count on (its training_engine example)."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:
        return True
    releasable = [(s["address"], s["total_size"]) for s in segments
                  if s.get("allocated_size", 0) == 0
                  or (s.get("is_expandable") and s["total_size"] - s.get("allocated_size", 0) >= 2 << 20)]
    return any(_paused_overlaps([r]) is not True for r in releasable)


def _end_fn(torch):
    return getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool


def _route_begin(torch):
    pool = torch.cuda.graph_pool_handle()
    devices = list(range(torch.cuda.device_count()))
    for d in devices:
        torch._C._cuda_beginAllocateToPool(d, pool)
    _state["route"] = (pool, devices)
    _patch(torch)


def _route_end(torch, release):
    pool, devices = _state["route"]
    end = _end_fn(torch)
    for d in devices:
        end(d, pool)
        if release:
            torch._C._cuda_releasePool(d, pool)
    if release:
        _release_spent(torch)
        _state["route"] = None


def _release_spent(torch):
    for pool, devices in _state["spent"]:
        for d in devices:
            torch._C._cuda_releasePool(d, pool)
    _state["spent"] = []


def _first_match_wins(torch):
    """Whether PyTorch hands an allocation to the first begun pool whose filter matches.  Since
    pytorch#168382 (2.10) it takes the last, so that nested use_mem_pool() contexts work, and a
    pool begun after the route already comes before it."""
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return False
    return (major, minor) < (2, 10)


def route_behind():
    """The calling thread just began allocating to a pool of its own (use_mem_pool): where PyTorch
    takes the first matching pool, the route (begun earlier, matching every stream) would take its
    allocations, so the route moves behind it onto a fresh pool, begun before the old one ends so
    that no allocation of another thread meanwhile finds no route; the old pool is let go with the
    route (tensors made in it stay valid).  Where PyTorch takes the last, nothing to do: moving the
    route on top would take the caller's allocations instead (torch 2.11, H200: the 5 GB a
    torch_memory_saver disable() made under TMS_INIT_ENABLE stayed in the route's pool)."""
    with _lock:
        if _state["route"] is None or _state["steps_aside"]:
            return
        torch = sys.modules.get("torch")
        if not _first_match_wins(torch):
            return
        old, devices = _state["route"]
        pool = torch.cuda.graph_pool_handle()
        for d in devices:
            torch._C._cuda_beginAllocateToPool(d, pool)
        end = _end_fn(torch)
        for d in devices:
            end(d, old)
        _state["spent"].append((old, devices))
        _state["route"] = (pool, devices)


def _step_aside(torch):
    with _lock:
        if _state["route"] is not None and _state["steps_aside"] == 0:
            _route_end(torch, release=False)
        if _state["route"] is not None:
            _state["steps_aside"] += 1


def _step_back(torch):
    with _lock:
        if _state["route"] is not None and _state["steps_aside"] > 0:
            _state["steps_aside"] -= 1
            if _state["steps_aside"] == 0:
                pool, devices = _state["route"]
                for d in devices:
                    torch._C._cuda_beginAllocateToPool(d, pool)


@contextlib.contextmanager
def stepped_aside():
    """The route steps aside inside: what PyTorch refuses while any pool is allocated to, as during a
    capture (emptying a cache asserts that none is), runs there.  Another thread's allocation
    meanwhile goes to the default pool."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    _step_aside(torch)
    try:
        yield
    finally:
        _step_back(torch)


def _patch(torch):
    """Make the route step aside while a CUDA graph is captured (PyTorch takes the first pool whose
    filter matches, and the route's matches every stream) and while empty_cache() runs (PyTorch
    asserts that no pool is allocated to, and would end the process)."""
    global _patched
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if _patched or graph is None:
        return
    begin, end = graph.capture_begin, graph.capture_end

    def capture_begin(self, *args, **kwargs):
        _step_aside(torch)
        return begin(self, *args, **kwargs)

    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            _step_back(torch)

    graph.capture_begin, graph.capture_end = capture_begin, capture_end
    empty = getattr(torch.cuda, "empty_cache", None)
    if empty is not None:
        def empty_cache(*args, **kwargs):
            with _lock, stepped_aside():
                return empty(*args, **kwargs)

        torch.cuda.empty_cache = empty_cache
        memory = getattr(torch.cuda, "memory", None)
        if memory is not None and getattr(memory, "empty_cache", None) is empty:
            memory.empty_cache = empty_cache
    _patched = True


def after_pause(tag):
    """The shim paused tag (None: everything): cuBLAS's workspaces go, and new allocations are
    routed away from paused memory."""
    with _lock:
        if tag is None:
            _state["all"] = True
        else:
            _state["tags"].add(tag)
        torch = _torch()
        if torch is None:
            return
        native = _native(torch)
        # only where eager work allocates (the default pool) does paused memory matter to it; the
        # workspaces also hold what CUDA graphs captured earlier baked in, and a graph replayed after
        # its workspace went faults (2026-11-28, H200: a captured decode step after a tag's pause)
        if tag is not None and not (native and _default_pool_paused(torch, tag)):
            return
        _clear_workspaces(torch)
        if _state["route"] is None and native:
            _route_begin(torch)


def after_resume(tag):
    """The shim resumed tag (None: everything): once nothing is paused the route ends."""
    with _lock:
        if tag is None:
            _state["all"] = False
            _state["tags"].clear()
        else:
            _state["tags"].discard(tag)
        if _state["all"] or _state["tags"] or _state["route"] is None:
            return
        torch = sys.modules.get("torch")
        if _state["steps_aside"] == 0:
            _route_end(torch, release=True)
        else:  # ending inside a capture: the pool is let go once the capture ends and finds no route
            pool, devices = _state["route"]
            for d in devices:
                torch._C._cuda_releasePool(d, pool)
            _release_spent(torch)
            _state["route"] = None
            _state["steps_aside"] = 0

