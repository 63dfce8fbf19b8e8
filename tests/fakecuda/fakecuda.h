/* Control API of the emulated CUDA driver (build/fakecuda/libcuda.so.1), test equipment only.
 *
 * Tests never link against the fake driver: they dlopen("libcuda.so.1") and dlsym these names,
 * so that the very same test binary also runs against a real driver (where the names are
 * absent and the fake-only checks are skipped).  The typedefs below are for those dlsym calls.
 *
 * Environment knobs, read once when the library is loaded:
 *   FAKECUDA_DEVICES=N            number of devices, 0..8 (default 1; 0 makes cuInit fail with
 *                                 CUDA_ERROR_NO_DEVICE)
 *   FAKECUDA_MEM_BYTES=N[K|M|G]   per-device memory budget (default 8G); cuMemCreate and the
 *                                 cuMemAlloc family fail with CUDA_ERROR_OUT_OF_MEMORY past it
 *   FAKECUDA_NO_VMM=1             devices report no VMM / POSIX-fd support; cuMemCreate and
 *                                 cuMemAddressReserve return CUDA_ERROR_NOT_SUPPORTED
 *   FAKECUDA_FAIL=entry,...       each entry fn[/caller][@k][:n[:err]] makes calls of fn fail:
 *                                 n of them (default 1) with err (a CUresult number or name,
 *                                 with or without CUDA_ERROR_; default as fakecuda_fail_next),
 *                                 from the k-th on (default 1), counting only the calls made
 *                                 from the object (library or program) whose file name is
 *                                 caller, when given.  Without @k, n is required (fn:n[:err],
 *                                 the next n calls).  cuMemMap/libvmmshim.so@2 fails the second
 *                                 cuMemMap the shim makes; cuMemCreate@3:2:OUT_OF_MEMORY the
 *                                 third and fourth of the process.
 *   FAKECUDA_CALLS_AT_EXIT=path   write one line "fn caller count" per entry point and calling
 *                                 object at exit ("%p" as below), the positions @k can name
 *   FAKECUDA_EVENT_DELAY_US=N     work recorded on a stream completes N microseconds late
 *   FAKECUDA_COPY_DELAY_US=N      every copy takes N microseconds: a synchronous one returns that
 *                                 late, an asynchronous one keeps its stream busy that much
 *                                 longer (events recorded after it complete then)
 *   FAKECUDA_ASYNC_DEFER=1        an asynchronous copy (cuMemcpy*Async) moves its bytes only at the
 *                                 next cuCtxSynchronize or cuStreamSynchronize (of any stream),
 *                                 or cuEventSynchronize of an event recorded after it, in the
 *                                 order queued; until then its source may still change
 *                                 and its destination holds the old bytes, so a caller that reads
 *                                 or frees either side before synchronizing is caught
 *   FAKECUDA_COUNTERS_AT_EXIT=path  write the counters as key=value lines at exit
 *                                 ("%p" in path becomes the process id)
 */
#ifndef FAKECUDA_H
#define FAKECUDA_H

/* One list drives the struct, the at-exit dump and the tests, so they cannot drift apart. */
#define FAKECUDA_COUNTER_FIELDS(X)                                                              \
    X(handles_live)          /* VMM allocations alive in this process (created or imported) */ \
    X(handles_created)       /* successful cuMemCreate calls */                                \
    X(mappings_live)         /* cuMemMap ranges not yet unmapped */                            \
    X(reservations_live)     /* cuMemAddressReserve ranges not yet freed */                    \
    X(exports)               /* successful cuMemExportToShareableHandle calls */               \
    X(imports)               /* successful cuMemImportFromShareableHandle calls */             \
    X(imports_live)          /* imported allocations still alive */                            \
    X(phys_bytes_live)       /* bytes charged to the device budgets, all devices */            \
    X(memalloc_live)         /* cuMemAlloc/AllocAsync/AllocPitch/AllocManaged not yet freed */ \
    X(ipc_opens_live)        /* cuIpcOpenMemHandle mappings not yet closed */                  \
    X(host_allocs_live)      /* cuMemAllocHost/cuMemHostAlloc not yet cuMemFreeHost'd */       \
    X(host_registered_live)  /* cuMemHostRegister'd ranges not yet unregistered */             \
    X(fds_open)              /* fds on the memory of no live handle: exported or received and  \
                                never closed (read from /proc/self/fd at each snapshot) */     \
    X(calls_cuMemCreate)                                                                       \
    X(calls_cuMemAlloc)      /* cuMemAlloc_v2 */                                               \
    X(calls_cuMemAllocAsync) /* cuMemAllocAsync and cuMemAllocAsync_ptsz */                    \
    X(calls_cuMemFree)       /* cuMemFree_v2 */                                                \
    X(calls_cuMemFreeAsync)  /* cuMemFreeAsync and cuMemFreeAsync_ptsz */                      \
    X(calls_cuMemMap)                                                                          \
    X(calls_cuMemUnmap)      /* counted as the call begins, before any delay */                \
    X(calls_cuMemSetAccess)                                                                    \
    X(calls_cuMemcpyDtoHAsync) /* both exported variants */                                    \
    X(calls_cuMemRelease)                                                                      \
    X(calls_cuGetProcAddress) /* both ABI versions */                                          \
    X(calls_cuMemAllocFromPoolAsync) /* and _ptsz */                                           \
    X(calls_cuMemPoolSetAccess)                                                                \
    X(calls_cuMemPoolGetAttribute)                                                             \
    X(calls_cuMemPoolSetAttribute)                                                             \
    X(calls_cuMemPoolTrimTo)                                                                   \
    X(calls_cuEventRecord)   /* and its _ptsz and WithFlags variants */                        \
    X(calls_cuDeviceSetMemPool) /* and cuMemSetMemPool */                                      \
    X(calls_cuMemHostAlloc)  /* successful cuMemHostAlloc calls (cuMemAllocHost not counted) */ \
    X(calls_cuMemFreeHost)   /* successful cuMemFreeHost calls */                              \
    X(calls_cuMemHostRegister)   /* successful cuMemHostRegister calls */                      \
    X(calls_cuMemHostUnregister) /* successful cuMemHostUnregister calls */                    \
    X(host_register_peak)    /* most cuMemHostRegister calls in flight at once (with           \
                                FAKECUDA_HOST_REGISTER_DELAY_US they overlap) */               \
    X(calls_cuMemcpyHtoDAsync) /* both exported variants */                                    \
    X(calls_legacy_abi)      /* pre-3.2 entry points with 32-bit pointers: always a bug */     \
    X(calls_cuStreamWaitEvent) /* successful cuStreamWaitEvent calls */                        \
    X(calls_cuLaunchHostFunc)  /* host functions queued (cuLaunchHostFunc) */                  \
    X(failures_injected)

#define FAKECUDA_COUNTER_MEMBER(name) unsigned long long name;
struct fakecuda_counters {
    FAKECUDA_COUNTER_FIELDS(FAKECUDA_COUNTER_MEMBER)
};
#undef FAKECUDA_COUNTER_MEMBER

/* Makes the next n calls of fn fail with cuda_error (a CUresult; 0 picks the default:
 * CUDA_ERROR_OUT_OF_MEMORY for cuMemCreate and the cuMemAlloc family, CUDA_ERROR_UNKNOWN
 * otherwise).  fn is the base name as passed to cuGetProcAddress; ABI suffixes such as
 * "_v2" or "_ptsz" are ignored, so "cuMemAllocAsync" covers both exported variants.
 * n == 0 disarms.  Returns 0, or -1 for a name the fake driver does not implement. */
int fakecuda_fail_next(const char *fn, int n, int cuda_error);
typedef int (*fakecuda_fail_next_fn)(const char *fn, int n, int cuda_error);

/* Sets the per-device memory budget (what FAKECUDA_MEM_BYTES sets at load time). */
void fakecuda_set_budget(unsigned long long bytes);
typedef void (*fakecuda_set_budget_fn)(unsigned long long bytes);

/* Sets the event completion delay (what FAKECUDA_EVENT_DELAY_US sets at load time). */
void fakecuda_set_event_delay_us(unsigned long long us);
typedef void (*fakecuda_set_event_delay_us_fn)(unsigned long long us);

/* Sets the copy duration (what FAKECUDA_COPY_DELAY_US sets at load time). */
void fakecuda_set_copy_delay_us(unsigned long long us);
typedef void (*fakecuda_set_copy_delay_us_fn)(unsigned long long us);

/* Makes every POSIX fd export take this long (the real driver's is ~0.6 ms on an H100). */
void fakecuda_set_export_delay_us(unsigned long long us);
typedef void (*fakecuda_set_export_delay_us_fn)(unsigned long long us);

/* Makes every cuMemUnmap take this long (an importer's reaper caught mid-unmap). */
void fakecuda_set_unmap_delay_us(unsigned long long us);
typedef void (*fakecuda_set_unmap_delay_us_fn)(unsigned long long us);
/* Each cuMemSetAccess takes this long before it changes the pages (FAKECUDA_ACCESS_DELAY_US). */
void fakecuda_set_access_delay_us(unsigned long long us);
typedef void (*fakecuda_set_access_delay_us_fn)(unsigned long long us);

/* Snapshot of the counters. */
void fakecuda_counters(struct fakecuda_counters *out);
typedef void (*fakecuda_counters_fn)(struct fakecuda_counters *out);

#endif
