/* The sequence counters of the registry's records (layout.h, READING A RECORD), shared by the
 * registry (registry.c) and the name tables beside it (names.c): the writer's begin/end and the
 * reader's seq-checked copy, as static inline functions so each keeps its one fence inline.
 * Internal to shim/registry. */
#ifndef VMM_REGISTRY_SEQ_H
#define VMM_REGISTRY_SEQ_H
#include <errno.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "registry/registry.h"

#define READ_RETRIES 4096
#define BUSY_WAIT_S 0.05 /* longest one reader call waits on records mid-write, all of them together */

static inline uint64_t clock_ns(clockid_t which)
{
    struct timespec t;
    clock_gettime(which, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static inline double monotonic_s(void) { return (double)clock_ns(CLOCK_MONOTONIC) / 1e9; }

/* ---- seq-protected copies: 8-byte atomics, so neither side races in the C11 sense ---- */

/* ThreadSanitizer follows no fences (GCC refuses them under -fsanitize=thread): there the
 * seqlocks take their fence-free form, every word stored with release and loaded with acquire
 * (Boehm, "Can seqlocks get along with programming language memory models?").  Elsewhere one
 * fence orders all the words: a single barrier on weakly ordered CPUs instead of one per word. */
#ifdef __SANITIZE_THREAD__
#define SEQ_WORD_STORE __ATOMIC_RELEASE
#define SEQ_WORD_LOAD __ATOMIC_ACQUIRE
#define SEQ_FENCE(order) ((void)0)
#else
#define SEQ_WORD_STORE __ATOMIC_RELAXED
#define SEQ_WORD_LOAD __ATOMIC_RELAXED
#define SEQ_FENCE(order) __atomic_thread_fence(order)
#endif

static inline void copy_words_in(void *dst, const void *src, size_t bytes)
{
    uint64_t *d = dst;
    const uint64_t *s = src;
    for (size_t i = 0; i < bytes / 8; i++) __atomic_store_n(&d[i], s[i], SEQ_WORD_STORE);
}

static inline void copy_words_out(void *dst, const void *src, size_t bytes)
{
    uint64_t *d = dst;
    const uint64_t *s = src;
    for (size_t i = 0; i < bytes / 8; i++) d[i] = __atomic_load_n(&s[i], SEQ_WORD_LOAD);
}

static inline void seq_begin(uint32_t *seq)
{
    uint32_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, (s | 1u) == s ? s + 2 : s + 1, __ATOMIC_RELAXED);
    SEQ_FENCE(__ATOMIC_RELEASE);
}

static inline void seq_end(uint32_t *seq)
{
    uint32_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    __atomic_store_n(seq, (s + 1) & ~1u, __ATOMIC_RELEASE);
}

/* Copy `bytes` of a record whose first 4 bytes at seq_off are its sequence counter.  Past a short
 * spin, waiting for a writer draws on w, which the caller shares among the records it reads. */
static inline int seq_read(const void *rec, size_t bytes, const uint32_t *seq, void *out, vmm__reg_wait *w)
{
    for (int i = 0; i < READ_RETRIES; i++) {
        uint32_t s1 = __atomic_load_n(seq, __ATOMIC_ACQUIRE);
        if (s1 & 1u) {
            if (i > 64) {
                double now = monotonic_s();
                if (w->until == 0) w->until = now + BUSY_WAIT_S;
                else if (now > w->until) return -EAGAIN;
                sched_yield();
            }
            continue;
        }
        copy_words_out(out, rec, bytes);
        SEQ_FENCE(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(seq, __ATOMIC_RELAXED) == s1) return 0;
    }
    return -EAGAIN;
}

#endif
