/* Thread tags (vmm_set_thread_tag): a name the calling thread's allocations carry in their records
 * instead of the process's VMMSHIM_TAG, and pools of their own, so that a tag's allocations never
 * share a segment with another tag's and pausing a tag (sleep) gives whole segments back.  Names
 * are kept for the process's life, at most VMM__MAX_TAGS of them, so a tag's number (index + 1)
 * and the name a call returns stay valid; the allocation path reads one initial-exec thread-local
 * word. */
#include <stdlib.h>
#include <string.h>

#include "backing/internal.h"
#include "core/log.h"

/* Names are only ever appended, under their own lock (no allocation path waits on it), and
 * published by n_tags: a thread holds a number only after its name was written. */
static pthread_mutex_t names_lock = PTHREAD_MUTEX_INITIALIZER;

/* A fork while another thread appends a name would leave the child's copy of the lock held by a
 * thread the child does not have, and the child's first new tag waiting forever.  So fork takes
 * the lock first (held for a few compares and a copy, never across anything that waits), and the
 * child gets a fresh one, as ipc.c does with its tables' lock.  Registered before the lock is
 * first taken: until then no thread can hold it. */
static void before_fork(void) { pthread_mutex_lock(&names_lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&names_lock); }
static void after_fork_child(void) { pthread_mutex_init(&names_lock, NULL); }
static void register_atfork(void) { pthread_atfork(before_fork, after_fork_parent, after_fork_child); }

static uint32_t lookup(const char *name)
{
    unsigned n = __atomic_load_n(&vmm__S.n_tags, __ATOMIC_ACQUIRE);
    for (unsigned i = 0; i < n; i++)
        if (!strcmp(vmm__S.tags[i], name)) return i + 1;
    return 0;
}

uint32_t vmm__tag_find(const char *name) { return name && *name ? lookup(name) : 0; }

int vmm__tag_number(const char *name, uint32_t *t)
{
    *t = 0;
    if (!name || !*name) return 0;
    if (strlen(name) >= sizeof vmm__S.tags[0]) return -1;
    if ((*t = lookup(name))) return 0;
    static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&names_lock);
    int rc = 0;
    if (!(*t = lookup(name))) {
        unsigned n = vmm__S.n_tags;
        if (n == VMM__MAX_TAGS) rc = -2;
        else {
            memcpy(vmm__S.tags[n], name, strlen(name) + 1);
            __atomic_store_n(&vmm__S.n_tags, n + 1, __ATOMIC_RELEASE);
            *t = n + 1;
        }
    }
    pthread_mutex_unlock(&names_lock);
    return rc;
}

const char *vmm__thread_tag_set(const char *name, int *rc)
{
    uint32_t t, was = vmm__thread_tag;
    *rc = vmm__tag_number(name, &t);
    if (*rc == 0) vmm__thread_tag = t;
    else if (*rc == -1)
        vmm__log(VMM__LOG_WARNING, "a thread tag is at most %zu bytes; the thread keeps its tag", sizeof vmm__S.tags[0] - 1);
    else
        vmm__log(VMM__LOG_WARNING, "a process names at most %d thread tags; the thread keeps its tag", VMM__MAX_TAGS);
    return was ? vmm__S.tags[was - 1] : NULL;
}

const char *vmm__thread_tag_get(void)
{
    uint32_t t = vmm__thread_tag;
    return t ? vmm__S.tags[t - 1] : NULL;
}

vmm__pool *vmm__pools_of_locked(device_state *d, uint32_t t, int make)
{
    if (!t) return d->pool;
    vmm__pool *pair = d->tagged[t - 1];
    if (pair || !make) return pair;
    if (!(pair = calloc(2, sizeof *pair))) return NULL;
    vmm__pair_init_locked(d, pair, t);
    d->tagged[t - 1] = pair;
    return pair;
}

void vmm__tags_destroy_locked(device_state *d)
{
    for (uint32_t t = 0; t < VMM__MAX_TAGS; t++) {
        if (!d->tagged[t]) continue;
        vmm__pool_destroy(&d->tagged[t][0]);
        vmm__pool_destroy(&d->tagged[t][1]);
        free(d->tagged[t]);
        d->tagged[t] = NULL;
    }
}

uint32_t vmm__tag_current(void) { return vmm__thread_tag; }

int vmm__tag_selects(const char *tag, uint32_t t)
{
    if (!tag) return 1;
    if (!t && strncmp(tag, vmm__S.tag, sizeof vmm__S.tag) == 0) return 1;
    uint32_t want = vmm__tag_find(tag);
    return want && want == t;
}
