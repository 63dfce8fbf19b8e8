/* Many threads on many streams at once (argv: threads, rounds).  Each thread has two streams and
 * an event of its own; every round it allocates (stream-ordered on its first stream, or
 * synchronously), writes its pattern, records the event and makes its second stream wait for it,
 * reads the bytes back, and frees stream-ordered on the second stream or synchronously.  Every
 * third round it also takes the buffer its neighbour left in a shared slot (checking the
 * neighbour's pattern) and frees it on its own stream, and leaves one of its own there: memory
 * freed on another thread's stream than the one it was allocated on.  Once every thread is done
 * it stops at "checkpoint done <pid>" and waits for a line on stdin (end of input goes on at
 * once), so a companion importing meanwhile can stop while the owner is alive; then prints
 * "threads=T rounds=N failures=F" and exits 1 on any failure. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_THREADS 64

typedef struct slot {
    pthread_mutex_t lock;
    void *p;
    size_t size;
    uint64_t tag;
} slot;

static int rounds, n_threads, failures;
static slot slots[MAX_THREADS];

static void fail(void) { __atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED); }

/* Sizes the shim places differently: packed small blocks, split medium chunks, whole chunks. */
static size_t pick_size(unsigned *seed)
{
    *seed = *seed * 1103515245u + 12345u;
    unsigned r = *seed >> 8;
    switch (r % 4) {
    case 0: return 512 + r % (64u << 10);
    case 1: return (1u << 20) + r % (4u << 20);
    case 2: return 12u << 20;
    default: return 8 + r % 4096;
    }
}

/* The first and last words of a buffer carry its tag; the check reads both back. */
static int write_tag(void *p, size_t size, uint64_t tag, cudaStream_t s)
{
    if (cudaMemcpyAsync(p, &tag, sizeof tag, cudaMemcpyHostToDevice, s) != cudaSuccess) return -1;
    return size >= 16 && cudaMemcpyAsync((char *)p + size - 8, &tag, sizeof tag, cudaMemcpyHostToDevice, s) != cudaSuccess
               ? -1
               : 0;
}

static int tag_is(void *p, size_t size, uint64_t tag, cudaStream_t s)
{
    uint64_t a = 0, b = tag;
    if (cudaMemcpyAsync(&a, p, sizeof a, cudaMemcpyDeviceToHost, s) != cudaSuccess) return 0;
    if (size >= 16 && cudaMemcpyAsync(&b, (char *)p + size - 8, sizeof b, cudaMemcpyDeviceToHost, s) != cudaSuccess) return 0;
    return cudaStreamSynchronize(s) == cudaSuccess && a == tag && b == tag;
}

static void take_neighbours(int id, cudaStream_t s)
{
    slot *sl = &slots[(id + 1) % n_threads];
    pthread_mutex_lock(&sl->lock);
    void *p = sl->p;
    size_t size = sl->size;
    uint64_t tag = sl->tag;
    sl->p = NULL;
    pthread_mutex_unlock(&sl->lock);
    if (!p) return;
    if (!tag_is(p, size, tag, s)) fail();
    if (cudaFreeAsync(p, s) != cudaSuccess) fail();
}

static void leave_one(int id, unsigned *seed, uint64_t tag, cudaStream_t s)
{
    size_t size = pick_size(seed);
    void *p = NULL;
    if (cudaMallocAsync(&p, size, s) != cudaSuccess || write_tag(p, size, tag, s) || cudaStreamSynchronize(s) != cudaSuccess) {
        fail();
        return;
    }
    slot *sl = &slots[id];
    pthread_mutex_lock(&sl->lock);
    void *old = sl->p;
    sl->p = p;
    sl->size = size;
    sl->tag = tag;
    pthread_mutex_unlock(&sl->lock);
    if (old && cudaFree(old) != cudaSuccess) fail(); /* not taken yet: ours to free */
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    unsigned seed = (unsigned)id * 2654435761u + 7;
    cudaStream_t s1, s2;
    cudaEvent_t ev;
    if (cudaStreamCreate(&s1) != cudaSuccess || cudaStreamCreate(&s2) != cudaSuccess ||
        cudaEventCreate(&ev) != cudaSuccess) {
        fail();
        return NULL;
    }
    for (int r = 0; r < rounds; r++) {
        uint64_t tag = (uint64_t)id << 32 | (uint64_t)r;
        size_t size = pick_size(&seed);
        int ordered = (seed >> 3) & 1;
        void *p = NULL;
        cudaError_t e = ordered ? cudaMallocAsync(&p, size, s1) : cudaMalloc(&p, size);
        if (e != cudaSuccess) {
            fail();
            continue;
        }
        if (write_tag(p, size, tag, s1) || cudaEventRecord(ev, s1) != cudaSuccess ||
            cudaStreamWaitEvent(s2, ev, 0) != cudaSuccess || !tag_is(p, size, tag, s2))
            fail();
        e = ordered ? cudaFreeAsync(p, s2) : cudaFree(p);
        if (e != cudaSuccess) fail();
        if (r % 3 == 2) {
            take_neighbours(id, s1);
            leave_one(id, &seed, tag | 1ull << 63, s1);
        }
    }
    if (cudaStreamSynchronize(s1) != cudaSuccess || cudaStreamSynchronize(s2) != cudaSuccess) fail();
    cudaEventDestroy(ev);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    return NULL;
}

int main(int argc, char **argv)
{
    n_threads = argc > 1 ? atoi(argv[1]) : 8;
    rounds = argc > 2 ? atoi(argv[2]) : 300;
    if (n_threads < 1 || n_threads > MAX_THREADS) n_threads = 8;
    pthread_t t[MAX_THREADS];
    for (int i = 0; i < n_threads; i++) pthread_mutex_init(&slots[i].lock, NULL);
    for (int i = 0; i < n_threads; i++) pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < n_threads; i++) pthread_join(t[i], NULL);
    printf("checkpoint done %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
    for (int i = 0; i < n_threads; i++) /* what nobody took */
        if (slots[i].p && cudaFree(slots[i].p) != cudaSuccess) fail();
    if (cudaDeviceSynchronize() != cudaSuccess) fail();
    printf("threads=%d rounds=%d failures=%d\n", n_threads, rounds, failures);
    return failures != 0;
}
