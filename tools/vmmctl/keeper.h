/* What the two files of vmmctl keep share: the keeper's state, one kept process (owner), and the
 * watcher threads keeper.c runs for each.  keep.c (the command: claiming, --all, the daemon)
 * calls down into keeper.c (what is held and the passes); keeper.c never calls keep.c. */
#ifndef VMMCTL_KEEPER_H
#define VMMCTL_KEEPER_H
#include "vmmshim.h"

#include "registry/keep.h"
#include "registry/registry.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#define SETTLE_MS_DEFAULT 50u /* an allocation's age before its chunk is taken */

struct chunk;
struct pending;
struct held;

/* One kept process. */
typedef struct owner {
    uint32_t pid;
    uint64_t start_time, pidns;
    char cmdline[80];
    vmm__keep k;
    int pidfd;
    struct chunk *chunks;   /* by key */
    struct pending *pend;   /* by key, the watcher's own */
    struct held *recs;      /* the owner's held records */
    unsigned n_held, n_chunks;
    uint64_t pass;
    bool dead, done;
    pthread_t th;
    /* its end, read the moment its pidfd turned readable (a thread of its own, blocked on it), so
     * that its zombie's status is read before its parent reaps it, if at all possible */
    pthread_t death_th;
    bool has_death_th;
    int end_known, stopping; /* atomic */
    uint32_t end_kind;
    int32_t end_value;
    struct owner *next;
} owner;

/* The keeper's state: one keeper a process.  keep.c sets it up; the watchers read it. */
typedef struct vmm__ctl_keeper {
    vmm_registry *reg; /* reading, through the client library */
    vmm__reg wreg;     /* writing the keep fields (keep.h) */
    char sock[108];    /* this keeper's broker socket */
    int stop;          /* atomic: every watcher lets go */
    const char *tag, *dump_dir;
    unsigned settle_ms;
} vmm__ctl_keeper;
extern vmm__ctl_keeper vmm__ctl_kp;

static inline uint64_t mono_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* One event, one line: "HH:MM:SS.mmm keep: ...". */
__attribute__((format(printf, 1, 2))) void vmm__ctl_keep_event(const char *fmt, ...);
/* The broker's export callback: the fds of a held record (shim/broker/broker.h). */
int vmm__ctl_keep_export(uint64_t slot, uint64_t generation, const uint8_t id[16], uint32_t first, uint32_t max,
                       int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total,
                       uint32_t *device);
/* Start o's watcher (and the thread that reads its end): false when it could not start. */
bool vmm__ctl_keep_start(owner *o);
#endif
