/* Who still holds the owner's memory after it let go of it (issue 29): a table the broker fills as
 * it passes fds (peer pid, its start time, the allocation asked for, each handle's key) and
 * empties as companions say what their import caches unmapped (protocol v5); a pause asks it, a
 * bounded time, which of the segments it released are still held, and by whom.  A pid that died
 * (or whose pid now names another process, or a zombie) counts as let go.  See holders.c. */
#ifndef VMM_BROKER_HOLDERS_H
#define VMM_BROKER_HOLDERS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define VMM__HOLDERS_MAX 4096u  /* entries; past them a pid's new ones fold into "some of the memory" */
#define VMM__HOLDERS_REPORT 8u  /* pids a report names (vmm_sleep_report.holders) */

/* The peer of connected socket fd (SO_PEERCRED) and its start time; 0s when unknown. */
void vmm__holders_peer(int fd, pid_t *pid, uint64_t *start);
/* pid's start time (clock ticks after boot, /proc/PID/stat field 22); 0 when it is gone or a zombie. */
uint64_t vmm__holders_start_of(pid_t pid);
/* The broker passed pid the handles of keys[0 .. n) (VMM_BROKER_NO_KEY ones are skipped: a keeper's
 * broker has no keys), asked for as allocation (slot, generation). */
void vmm__holders_add(pid_t pid, uint64_t start, uint64_t slot, uint64_t generation, const uint64_t *keys, uint32_t n);
/* A v5 datagram of len bytes from pid: applied and true when well formed; false (nothing
 * applied) otherwise, for the broker to answer -EPROTO.  Reads only within raw[0 .. len). */
bool vmm__holders_serve_release(pid_t pid, const void *raw, size_t len);
/* pid let go of keys[0 .. n) without saying so (a keeper, rung by the pause, closed its fds). */
void vmm__holders_drop(pid_t pid, const uint64_t *keys, size_t n);

typedef struct vmm__held {
    uint64_t bytes;                      /* of the keys asked about, the bytes some live pid holds */
    uint32_t n_pids;                     /* how many pids hold them */
    uint32_t pids[VMM__HOLDERS_REPORT];  /* the first of them */
} vmm__held;
/* Wait at most wait_ms until no living pid holds any of keys[0 .. n) (sizes[i] the bytes of key
 * i), then say what is still held.  On the broker thread (a pause from outside runs there) it
 * reads the companions' v5 datagrams from the open connections itself, since nothing else would
 * meanwhile.  Takes no lock of the caller's; allocates (a sorted copy of the keys). */
void vmm__holders_wait(const uint64_t *keys, const uint64_t *sizes, size_t n, unsigned wait_ms, vmm__held *out);
/* In a fork child: the parent's holders are not the child's. */
void vmm__holders_forget_after_fork(void);

/* Set on the broker thread only (broker.c): its open connections' fds + 1 (0: none), 64 of them,
 * so that a wait there reads the releases itself; NULL on every other thread.  Handed over this
 * way so that this file calls nothing of broker.c's (which calls it). */
extern _Thread_local const int *vmm__holders_broker_conns;
/* Also the broker thread's only: its listening socket (-1 elsewhere) and how it takes one new
 * connection into a free slot (never closing another).  A companion that lets go during a wait
 * says so on a connection of its own, often a new one, which nothing else accepts meanwhile. */
extern _Thread_local int vmm__holders_broker_listen;
extern _Thread_local void (*vmm__holders_broker_accept)(void);
#endif
