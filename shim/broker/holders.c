/* Who still holds the owner's memory: the broker's table of what it passed to whom, emptied by the
 * companions' v5 datagrams (protocol.h) and by death, and the pause's bounded wait on it.
 *
 * Why per handle and not per connection: a companion holding one tag's memory would be reported
 * at the pause of another tag it let go of, and the broker closes idle connections after 60 s,
 * losing what it knew.  Why entries also carry the allocation asked for: a companion knows the key
 * of a one-handle mapping (its record's chunk id) but not the keys of a MULTI-HANDLE one; it names
 * that by (slot, generation), which is what it asked for, so no new request form is needed.
 *
 * What cannot be seen: fds a peer took raw (vmm_import_fd, vmm_import_fds) are the caller's to
 * close, and nothing says when it did; such a pid counts as holding them until it exits (a keeper,
 * rung by the pause, is dropped by the pause itself).  One lock, held for table walks only: the
 * broker thread adds under it, a pause's wait reads under it. */
#include "broker/holders.h"

#include "broker/broker.h"
#include "broker/protocol.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FOLD_MAX 64     /* pids whose entries did not fit: they hold "some" of every key */
#define MAX_CONNS 64    /* broker.c's BROKER_MAX_CONNS */
#define TICK_MS 10      /* how often a wait looks again */
#define CHECK_PIDS 64   /* distinct pids judged alive per look; more count as alive unjudged */

typedef struct hold {
    uint32_t pid;
    uint64_t start;
    uint64_t slot, generation, key;
} hold;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static hold g_hold[VMM__HOLDERS_MAX];
static uint32_t g_n;
static struct {
    uint32_t pid;
    uint64_t start;
} g_fold[FOLD_MAX];
static uint32_t g_n_fold;

_Thread_local const int *vmm__holders_broker_conns;
_Thread_local int vmm__holders_broker_listen = -1;
_Thread_local void (*vmm__holders_broker_accept)(void);

uint64_t vmm__holders_start_of(pid_t pid)
{
    char path[48], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ') return 0;
    p += 2;
    if (*p == 'Z' || *p == 'X') return 0; /* a zombie holds no memory any more */
    for (int field = 3; field < 22; field++) { /* p is at field 3 (state) */
        p = strchr(p, ' ');
        if (!p) return 0;
        p++;
    }
    return strtoull(p, NULL, 10);
}

void vmm__holders_peer(int fd, pid_t *pid, uint64_t *start)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    *pid = 0;
    *start = 0;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof cred || cred.pid <= 0) return;
    *pid = cred.pid;
    *start = vmm__holders_start_of(cred.pid);
}

/* Lock held. */
static void fold_locked(uint32_t pid, uint64_t start)
{
    for (uint32_t i = 0; i < g_n_fold; i++)
        if (g_fold[i].pid == pid && g_fold[i].start == start) return;
    if (g_n_fold < FOLD_MAX) {
        g_fold[g_n_fold].pid = pid;
        g_fold[g_n_fold++].start = start;
    }
}

void vmm__holders_add(pid_t pid, uint64_t start, uint64_t slot, uint64_t generation, const uint64_t *keys, uint32_t n)
{
    if (pid <= 0) return;
    pthread_mutex_lock(&g_lock);
    for (uint32_t k = 0; k < n; k++) {
        if (keys[k] == VMM_BROKER_NO_KEY) continue;
        bool have = false; /* asked for again (two threads of the peer racing to map it): one entry */
        for (uint32_t i = 0; i < g_n && !have; i++)
            have = g_hold[i].pid == (uint32_t)pid && g_hold[i].key == keys[k] && g_hold[i].slot == slot &&
                   g_hold[i].generation == generation && g_hold[i].start == start;
        if (have) continue;
        if (g_n == VMM__HOLDERS_MAX) {
            fold_locked((uint32_t)pid, start);
            continue;
        }
        g_hold[g_n++] = (hold){.pid = (uint32_t)pid, .start = start, .slot = slot, .generation = generation, .key = keys[k]};
    }
    pthread_mutex_unlock(&g_lock);
}

/* Lock held: drop pid's entries that match g (by key, or by allocation when g's key is none). */
static void drop_locked(uint32_t pid, const vmm_broker_gone5 *g)
{
    for (uint32_t i = 0; i < g_n;) {
        const hold *h = &g_hold[i];
        bool match = h->pid == pid && (g->key != VMM_BROKER_NO_KEY ? h->key == g->key
                                                                   : h->slot == g->slot && h->generation == g->generation);
        if (match)
            g_hold[i] = g_hold[--g_n];
        else
            i++;
    }
}

bool vmm__holders_serve_release(pid_t pid, const void *raw, size_t len)
{
    vmm_broker_release5 h;
    if (len < sizeof h) return false;
    memcpy(&h, raw, sizeof h);
    if (h.magic != VMM_BROKER_MAGIC || h.version != VMM_BROKER_VERSION5 || h.flags != 0 || h.n == 0 ||
        h.n > VMM_BROKER_MAX_RELEASES || len != sizeof h + (size_t)h.n * sizeof(vmm_broker_gone5))
        return false;
    if (pid <= 0) return true;
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < h.n; i++) {
        vmm_broker_gone5 g;
        memcpy(&g, (const uint8_t *)raw + sizeof h + (size_t)i * sizeof g, sizeof g);
        drop_locked((uint32_t)pid, &g);
    }
    pthread_mutex_unlock(&g_lock);
    return true;
}

void vmm__holders_drop(pid_t pid, const uint64_t *keys, size_t n)
{
    if (pid <= 0) return;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < n; i++) {
        vmm_broker_gone5 g = {.key = keys[i]};
        if (keys[i] != VMM_BROKER_NO_KEY) drop_locked((uint32_t)pid, &g);
    }
    pthread_mutex_unlock(&g_lock);
}

void vmm__holders_forget_after_fork(void)
{
    pthread_mutex_init(&g_lock, NULL); /* the parent's lock may have been held by a thread not here */
    g_n = 0;
    g_n_fold = 0;
}

/* ---- the pause's wait ---- */

typedef struct wanted {
    uint64_t key, size;
    bool held;
} wanted;

static int by_key(const void *a, const void *b)
{
    uint64_t x = ((const wanted *)a)->key, y = ((const wanted *)b)->key;
    return x < y ? -1 : x > y;
}

/* pid with start (0: unknown) still lives as that process.  cache: the pids judged this look. */
typedef struct judged {
    uint32_t pid;
    uint64_t start;
    bool alive;
} judged;

static bool alive(uint32_t pid, uint64_t start, judged *cache, uint32_t *n_cache)
{
    for (uint32_t i = 0; i < *n_cache; i++)
        if (cache[i].pid == pid && cache[i].start == start) return cache[i].alive;
    if (*n_cache == CHECK_PIDS) return true;
    uint64_t now = vmm__holders_start_of((pid_t)pid);
    bool live = now != 0 && (start == 0 || now == start);
    cache[(*n_cache)++] = (judged){.pid = pid, .start = start, .alive = live};
    return live;
}

static void note_pid(vmm__held *out, uint32_t pid)
{
    uint32_t shown = out->n_pids < VMM__HOLDERS_REPORT ? out->n_pids : VMM__HOLDERS_REPORT;
    for (uint32_t i = 0; i < shown; i++)
        if (out->pids[i] == pid) return;
    if (out->n_pids < VMM__HOLDERS_REPORT) out->pids[out->n_pids] = pid;
    out->n_pids++; /* past the report's room the count goes on, approximately (not deduplicated) */
}

/* One look: dead pids' entries go; out says what living ones hold of w[0 .. n). */
static void look(wanted *w, size_t n, vmm__held *out)
{
    judged cache[CHECK_PIDS];
    uint32_t n_cache = 0;
    memset(out, 0, sizeof *out);
    for (size_t i = 0; i < n; i++) w[i].held = false;
    pthread_mutex_lock(&g_lock);
    for (uint32_t i = 0; i < g_n;) {
        hold *h = &g_hold[i];
        wanted probe = {.key = h->key};
        wanted *hit = bsearch(&probe, w, n, sizeof *w, by_key);
        if (!hit) {
            i++;
            continue;
        }
        if (!alive(h->pid, h->start, cache, &n_cache)) { /* a pid that died let go of everything */
            g_hold[i] = g_hold[--g_n];
            continue;
        }
        hit->held = true;
        note_pid(out, h->pid);
        i++;
    }
    for (uint32_t i = 0; i < g_n_fold;) {
        if (!alive(g_fold[i].pid, g_fold[i].start, cache, &n_cache)) {
            g_fold[i] = g_fold[--g_n_fold];
            continue;
        }
        note_pid(out, g_fold[i].pid); /* it holds some of the memory, which we cannot tell */
        for (size_t k = 0; k < n; k++) w[k].held = true;
        i++;
    }
    pthread_mutex_unlock(&g_lock);
    for (size_t i = 0; i < n; i++)
        if (w[i].held) out->bytes += w[i].size;
}

/* On the broker thread: read the v5 datagrams waiting first on its open connections, for up to ms.
 * A connection whose next datagram is anything else is left for the broker (skip), and not
 * polled again in this wait, so that it does not wake every poll.  A new connection is taken in
 * (the next drain polls it): a companion's first release comes on one. */
static void drain(int ms, bool *skip, uint8_t *buf, size_t cap)
{
    struct pollfd pf[MAX_CONNS + 1];
    int at[MAX_CONNS], n = 0, open = 0;
    for (int i = 0; i < MAX_CONNS; i++) {
        int fd = __atomic_load_n(&vmm__holders_broker_conns[i], __ATOMIC_ACQUIRE) - 1;
        open += fd >= 0;
        if (fd < 0 || skip[i]) continue;
        at[n] = i;
        pf[n++] = (struct pollfd){.fd = fd, .events = POLLIN};
    }
    /* with every slot taken a waiting peer stays in the backlog: polling for it would spin */
    bool listen = vmm__holders_broker_listen >= 0 && vmm__holders_broker_accept && open < MAX_CONNS;
    if (listen) pf[n] = (struct pollfd){.fd = vmm__holders_broker_listen, .events = POLLIN};
    int pr = poll(pf, (nfds_t)n + listen, ms);
    if (pr > 0 && listen && (pf[n].revents & POLLIN)) vmm__holders_broker_accept();
    for (int k = 0; pr > 0 && k < n; k++) {
        if (!(pf[k].revents & POLLIN)) {
            if (pf[k].revents) skip[at[k]] = true; /* hung up: the broker closes it later */
            continue;
        }
        vmm_broker_release5 h;
        ssize_t got = recv(pf[k].fd, &h, sizeof h, MSG_DONTWAIT | MSG_PEEK | MSG_TRUNC);
        if (got < (ssize_t)sizeof h || h.magic != VMM_BROKER_MAGIC || h.version != VMM_BROKER_VERSION5 ||
            (size_t)got > cap) {
            skip[at[k]] = true;
            continue;
        }
        got = recv(pf[k].fd, buf, cap, MSG_DONTWAIT | MSG_TRUNC);
        pid_t pid;
        uint64_t start;
        vmm__holders_peer(pf[k].fd, &pid, &start);
        if (got > 0 && (size_t)got <= cap) (void)vmm__holders_serve_release(pid, buf, (size_t)got);
        /* a malformed one is dropped here unanswered: its sender expects no answer anyway */
    }
}

static uint64_t mono_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

void vmm__holders_wait(const uint64_t *keys, const uint64_t *sizes, size_t n, unsigned wait_ms, vmm__held *out)
{
    memset(out, 0, sizeof *out);
    if (!n) return;
    wanted *w = malloc(n * sizeof *w);
    size_t cap = sizeof(vmm_broker_release5) + VMM_BROKER_MAX_RELEASES * sizeof(vmm_broker_gone5);
    uint8_t *buf = vmm__holders_broker_conns ? malloc(cap) : NULL;
    if (!w) { /* no memory for the wait: say nothing rather than guess */
        free(buf);
        return;
    }
    for (size_t i = 0; i < n; i++) w[i] = (wanted){.key = keys[i], .size = sizes[i]};
    qsort(w, n, sizeof *w, by_key);
    bool skip[MAX_CONNS] = {0};
    uint64_t end = mono_ms() + wait_ms;
    for (;;) {
        look(w, n, out);
        uint64_t now = mono_ms();
        if (!out->n_pids || now >= end) break;
        int ms = end - now < TICK_MS ? (int)(end - now) : TICK_MS;
        if (buf) {
            drain(ms, skip, buf, cap);
        } else {
            struct timespec ts = {0, (long)ms * 1000000L};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
            }
        }
    }
    free(buf);
    free(w);
}
