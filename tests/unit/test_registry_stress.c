/* Stress of the registry's seq protocol and index: 3 writer processes bind, publish, retract and
 * unbind records in a loop while 3 reader processes walk the records and look addresses up, for
 * VMMSHIM_STRESS_SECONDS (default 10).  Every field of a published record is derived from one
 * 64-bit value, so a reader can tell a whole copy from a torn one; each writer also keeps a few
 * records live the whole time, which every find must succeed on. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "registry/registry.h"

#define NW 3
#define NR 3
#define NPERM 8
#define NWORK 48
#define MiB (UINT64_C(1) << 20)
#define TWO_MIB (2 * MiB)
#define BIG (8 * MiB)

typedef struct {
    int stop, go, readers_done, ready[NW];
    uint32_t wpid[NW];
    uint64_t publishes[NW], retracts[NW], binds[NW], unbinds[NW], werrors[NW];
    uint64_t reads[NR], torn[NR], misses[NR], finds[NR], work_hits[NR], busy[NR], rerrors[NR];
    char first_bad[NR][240];
} shared_t;

static shared_t *sh;
static char g_name[64];
static pid_t g_main_pid;

static void on_fatal(int sig)
{
    if (getpid() == g_main_pid) shm_unlink(g_name);
    signal(sig, SIG_DFL);
    raise(sig);
}

static uint64_t wbase(int w) { return 0x100000000000ull + ((uint64_t)w << 40); }
static uint64_t perm_addr(int w, int j) { return wbase(w) + (uint64_t)j * TWO_MIB; }
static uint64_t work_addr(int w, int j, int pos) { return wbase(w) + (1ull << 32) + ((uint64_t)j << 28) + (uint64_t)pos * BIG; }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* fork whose child dies with its parent: a failed or killed test leaves no process behind */
static pid_t xfork(void)
{
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(99);
    }
    return pid;
}

static uint64_t rng;
static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* v = (writer+1) << 56 | record << 48 | big << 47 | counter */
static uint64_t make_v(int w, int j, int big, uint64_t counter)
{
    return ((uint64_t)(w + 1) << 56) | ((uint64_t)j << 48) | ((uint64_t)big << 47) | (counter & ((1ull << 47) - 1));
}

static void derive(vmm_reg_alloc *d, uint64_t v)
{
    memset(d, 0, sizeof *d);
    d->requested_size = v;
    d->stream = v * 3;
    d->created_ns = v ^ 0x5a5a5a5aa5a5a5a5ull;
    snprintf(d->tag, sizeof d->tag, "%016" PRIx64, v);
    d->n_frames = 8;
    for (int i = 0; i < 8; i++) d->frames[i] = v + (uint64_t)i;
    d->device = (uint32_t)(v % 8);
    d->api = VMM_API_TEST;
    d->flags = (uint32_t)(v & 1);
    d->handle_kinds = VMM_HANDLE_FABRIC | VMM_HANDLE_BROKER;
    d->exported_fd = -1;
    for (int i = 0; i < 64; i++) d->fabric[i] = (uint8_t)((v + (uint64_t)i) & 0xff);
    for (int i = 0; i < 16; i++) d->device_uuid[i] = (uint8_t)((v >> ((i % 8) * 8)) ^ (uint64_t)i);
    memcpy(d->alloc_id, &v, 8);
    uint64_t nv = ~v;
    memcpy(d->alloc_id + 8, &nv, 8);
}

/* 0 when the LIVE copy is whole: every field agrees with v and with the owner's address plan. */
static const char *inconsistent(const vmm_reg_alloc *a)
{
    uint64_t v = a->requested_size;
    int w = (int)(v >> 56) - 1, j = (int)((v >> 48) & 0xff), big = (int)((v >> 47) & 1);
    if (w < 0 || w >= NW) return "writer";
    if (a->pid != sh->wpid[w]) return "pid";
    vmm_reg_alloc d;
    derive(&d, v);
    if (a->stream != d.stream) return "stream";
    if (a->created_ns != d.created_ns) return "created_ns";
    if (memcmp(a->tag, d.tag, sizeof d.tag)) return "tag";
    if (a->n_frames != 8 || memcmp(a->frames, d.frames, sizeof d.frames)) return "frames";
    if (a->device != d.device || a->api != d.api || a->flags != d.flags) return "device/api/flags";
    if (a->handle_kinds != d.handle_kinds || a->exported_fd != -1) return "handle_kinds";
    if (memcmp(a->fabric, d.fabric, sizeof d.fabric)) return "fabric";
    if (memcmp(a->device_uuid, d.device_uuid, sizeof d.device_uuid)) return "device_uuid";
    if (memcmp(a->alloc_id, d.alloc_id, sizeof d.alloc_id)) return "alloc_id";
    if (j < NPERM) {
        if (big || a->address != perm_addr(w, j) || a->mapped_size != TWO_MIB) return "permanent address";
    } else {
        if (j >= NPERM + NWORK) return "record number";
        uint64_t a0 = work_addr(w, j - NPERM, 0);
        if (a->address < a0 || a->address >= a0 + 16 * BIG || (a->address - a0) % BIG) return "work address";
        if (a->mapped_size != (big ? BIG : TWO_MIB)) return "mapped_size";
    }
    return NULL;
}

/* ---- writers ---- */

static void writer(vmm__reg *r, int w)
{
    vmm__reg_forget_after_fork(r);
    rng = 0x9e3779b97f4a7c15ull ^ ((uint64_t)getpid() << 20) ^ (uint64_t)w;
    if (vmm__reg_attach(r, NULL)) _exit(2);
    uint64_t counter = 1;
    vmm_reg_alloc d;
    for (int j = 0; j < NPERM; j++) {
        uint32_t s;
        if (vmm__reg_bind(r, perm_addr(w, j), TWO_MIB, &s)) _exit(3);
        derive(&d, make_v(w, j, 0, counter++));
        if (vmm__reg_publish(r, s, &d, NULL)) _exit(4);
    }
    __atomic_store_n(&sh->ready[w], 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&sh->go, __ATOMIC_ACQUIRE)) usleep(1000);
    uint32_t slot[NWORK];
    int st[NWORK] = {0}, big[NWORK] = {0};
    uint64_t pub = 0, ret = 0, bnd = 0, unb = 0, err = 0;
    while (!__atomic_load_n(&sh->stop, __ATOMIC_RELAXED)) {
        for (int burst = 0; burst < 64; burst++) {
            int j = (int)(rnd() % NWORK);
            switch (st[j]) {
            case 0: {
                big[j] = (int)(rnd() & 1);
                int pos = (int)(rnd() % 16);
                if (vmm__reg_bind(r, work_addr(w, j, pos), big[j] ? BIG : TWO_MIB, &slot[j]) == 0) {
                    st[j] = 1;
                    bnd++;
                } else {
                    err++;
                }
                break;
            }
            case 1:
                derive(&d, make_v(w, NPERM + j, big[j], counter++));
                if (vmm__reg_publish(r, slot[j], &d, NULL) == 0) {
                    st[j] = 2;
                    pub++;
                } else {
                    err++;
                }
                break;
            default:
                if (rnd() % 3) {
                    if (vmm__reg_retract(r, slot[j]) == 0) {
                        st[j] = 1;
                        ret++;
                    } else {
                        err++;
                    }
                } else if (vmm__reg_unbind(r, slot[j]) == 0) {
                    st[j] = 0;
                    unb++;
                } else {
                    err++;
                }
            }
        }
    }
    sh->publishes[w] = pub;
    sh->retracts[w] = ret;
    sh->binds[w] = bnd;
    sh->unbinds[w] = unb;
    sh->werrors[w] = err;
    /* the permanent records must stay live until no reader looks any more */
    while (!__atomic_load_n(&sh->readers_done, __ATOMIC_ACQUIRE)) usleep(1000);
    vmm__reg_close(r); /* detach: everything of this writer goes */
    _exit(0);
}

/* ---- readers ---- */

typedef struct {
    int k;
    uint64_t reads, torn, busy;
} rctx;

static void note_bad(int k, const char *what, const vmm_reg_alloc *a)
{
    if (sh->first_bad[k][0]) return;
    snprintf(sh->first_bad[k], sizeof sh->first_bad[k], "%s: pid %u address %#" PRIx64 " v %#" PRIx64 " state %u", what,
             a->pid, a->address, a->requested_size, a->state);
}

static int reader_visit(void *ctx, uint64_t slot, const vmm_reg_alloc *a, int rc)
{
    (void)slot;
    rctx *c = ctx;
    if (rc) {
        c->busy++;
        return 0;
    }
    if (a->state != VMM_REG_LIVE) return 0;
    c->reads++;
    const char *why = inconsistent(a);
    if (why) {
        c->torn++;
        note_bad(c->k, why, a);
    }
    return 0;
}

static void reader(const vmm__reg *r, int k)
{
    rng = 0x2545f4914f6cdd1dull ^ ((uint64_t)getpid() << 24) ^ (uint64_t)k;
    while (!__atomic_load_n(&sh->go, __ATOMIC_ACQUIRE)) usleep(1000);
    rctx c = {k, 0, 0, 0};
    uint64_t misses = 0, finds = 0, hits = 0, errors = 0;
    vmm_reg_alloc out;
    uint64_t fs;
    while (!__atomic_load_n(&sh->stop, __ATOMIC_RELAXED)) {
        if (vmm__reg_for_each(r, reader_visit, &c) != 0) errors++;
        for (int n = 0; n < 256; n++) {
            int w = (int)(rnd() % NW), j = (int)(rnd() % NPERM);
            uint64_t a = perm_addr(w, j) + rnd() % TWO_MIB;
            finds++;
            int rc = vmm__reg_find(r, sh->wpid[w], a, &out, &fs);
            if (rc != 0 || out.state != VMM_REG_LIVE || out.address != perm_addr(w, j)) {
                misses++;
                if (!sh->first_bad[k][0])
                    snprintf(sh->first_bad[k], sizeof sh->first_bad[k], "find of permanent record %d/%d: rc %d", w, j, rc);
                continue;
            }
            c.reads++;
            const char *why = inconsistent(&out);
            if (why) {
                c.torn++;
                note_bad(k, why, &out);
            }
        }
        for (int n = 0; n < 256; n++) {
            int w = (int)(rnd() % NW), j = (int)(rnd() % NWORK), pos = (int)(rnd() % 16);
            uint64_t a = work_addr(w, j, pos) + rnd() % BIG;
            finds++;
            int rc = vmm__reg_find(r, sh->wpid[w], a, &out, &fs);
            if (rc == -EAGAIN) c.busy++;
            if (rc != 0) continue;
            hits++;
            c.reads++;
            const char *why = inconsistent(&out);
            if (!why && (out.state != VMM_REG_LIVE || a < out.address || a >= out.address + out.mapped_size))
                why = "find answered a record not holding the address";
            if (why) {
                c.torn++;
                note_bad(k, why, &out);
            }
        }
    }
    sh->reads[k] = c.reads;
    sh->torn[k] = c.torn;
    sh->busy[k] = c.busy;
    sh->misses[k] = misses;
    sh->finds[k] = finds;
    sh->work_hits[k] = hits;
    sh->rerrors[k] = errors;
    _exit(0);
}

static int count_cb(void *ctx, uint64_t slot, const vmm_reg_alloc *a, int rc)
{
    (void)slot;
    (void)a;
    (void)rc;
    ++*(uint64_t *)ctx;
    return 0;
}

int main(void)
{
    const char *env = getenv("VMMSHIM_STRESS_SECONDS");
    double secs = env && *env ? atof(env) : 10.0;
    if (secs <= 0) secs = 10.0;
    g_main_pid = getpid();
    signal(SIGALRM, on_fatal);
    signal(SIGTERM, on_fatal);
    alarm((unsigned)secs + 45);
    char *name = g_name;
    snprintf(g_name, sizeof g_name, "/vmmshim-t-%d-stress", (int)getpid());
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        CHECK(0, "mmap: %s", strerror(errno));
        CHECK_DONE();
    }
    memset(sh, 0, sizeof *sh);
    vmm__reg r;
    char err[256] = "";
    int rc = vmm__reg_open(&r, name, VMM__REG_CREATE, 1024, NULL, err, sizeof err);
    CHECK(rc == 0, "open: %d %s", rc, err);
    if (rc) CHECK_DONE();

    pid_t wp[NW], rp[NR];
    fflush(NULL);
    for (int w = 0; w < NW; w++) {
        wp[w] = xfork();
        if (wp[w] == 0) writer(&r, w);
        sh->wpid[w] = (uint32_t)wp[w];
    }
    double t0 = now_s();
    int ready = 0;
    while (!ready && now_s() - t0 < 20) {
        ready = 1;
        for (int w = 0; w < NW; w++) ready = ready && __atomic_load_n(&sh->ready[w], __ATOMIC_ACQUIRE);
        if (!ready) usleep(2000);
    }
    CHECK(ready, "writers did not start");
    for (int k = 0; k < NR; k++) {
        rp[k] = xfork();
        if (rp[k] == 0) reader(&r, k);
    }
    __atomic_store_n(&sh->go, 1, __ATOMIC_RELEASE);
    double start = now_s();
    while (now_s() - start < secs) usleep(20000);
    __atomic_store_n(&sh->stop, 1, __ATOMIC_RELEASE);
    double elapsed = now_s() - start;
    int st, bad_exit = 0;
    for (int k = 0; k < NR; k++) {
        waitpid(rp[k], &st, 0);
        bad_exit += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    __atomic_store_n(&sh->readers_done, 1, __ATOMIC_RELEASE);
    for (int w = 0; w < NW; w++) {
        waitpid(wp[w], &st, 0);
        bad_exit += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    CHECK(bad_exit == 0, "%d workers failed", bad_exit);

    uint64_t pub = 0, ret = 0, bnd = 0, unb = 0, werr = 0, reads = 0, torn = 0, misses = 0, finds = 0, hits = 0, busy = 0,
             rerr = 0;
    for (int w = 0; w < NW; w++) {
        pub += sh->publishes[w];
        ret += sh->retracts[w];
        bnd += sh->binds[w];
        unb += sh->unbinds[w];
        werr += sh->werrors[w];
    }
    for (int k = 0; k < NR; k++) {
        reads += sh->reads[k];
        torn += sh->torn[k];
        misses += sh->misses[k];
        finds += sh->finds[k];
        hits += sh->work_hits[k];
        busy += sh->busy[k];
        rerr += sh->rerrors[k];
        if (sh->first_bad[k][0]) fprintf(stderr, "reader %d: first problem: %s\n", k, sh->first_bad[k]);
    }
    printf("figure: stress %.1f s: %d writers, %d readers: publishes %.0f/s, reads %.0f/s, torn reads %" PRIu64
           ", missed finds %" PRIu64 "\n",
           elapsed, NW, NR, (double)pub / elapsed, (double)reads / elapsed, torn, misses);
    printf("stat: stress: %" PRIu64 " binds, %" PRIu64 " publishes, %" PRIu64 " retracts, %" PRIu64 " unbinds; %" PRIu64
           " finds (%" PRIu64 " hits on churning records), %" PRIu64 " busy reads\n",
           bnd, pub, ret, unb, finds, hits, busy);
    CHECK(torn == 0, "%" PRIu64 " torn reads", torn);
    CHECK(misses == 0, "%" PRIu64 " finds of permanently live records failed", misses);
    CHECK(werr == 0 && rerr == 0, "%" PRIu64 " writer errors, %" PRIu64 " reader errors", werr, rerr);
    CHECK(pub > 0 && reads > 0 && finds > 0 && hits > 0 && ret > 0 && unb > 0, "nothing happened");
    CHECK(elapsed >= secs && elapsed < secs + 5, "ran %.1f s", elapsed);

    /* the writers detached: nothing is left, and nothing needs reclaiming */
    uint64_t left = 0, entries = 0;
    CHECK_EQ(vmm__reg_for_each(&r, count_cb, &left), 0);
    CHECK_EQ(left, 0);
    const uint32_t *ix = (const uint32_t *)(r.base + r.hdr->index_off);
    for (uint64_t i = 0; i < r.hdr->index_slots; i++) entries += ix[i] != 0;
    CHECK_EQ(entries, 0);
    CHECK_EQ(r.hdr->index_seq & 1, 0);
    vmm__reg_gc_stats gs;
    CHECK_EQ(vmm__reg_gc(&r, &gs), 0);
    CHECK(gs.procs_dead == 0 && gs.records_reclaimed == 0 && gs.chunks_reclaimed == 0, "gc after clean exits: %u/%u/%u",
          gs.procs_dead, gs.records_reclaimed, gs.chunks_reclaimed);
    CHECK_EQ(r.hdr->stat_publishes, pub + NW * NPERM);
    vmm__reg_close(&r);
    shm_unlink(name);
    munmap(sh, sizeof *sh);
    CHECK_DONE();
}
