/* Legacy CUDA IPC between two processes, as torch.multiprocessing uses it.  Every line printed
 * is one observation ("ipc: <what> <result>"); pointers are never printed, so runs can be
 * compared line by line.
 *
 *   ipc_pair            parent: cudaMalloc 3 MiB, fill, cudaIpcGetMemHandle (base and interior
 *                       pointer), open its own handle, run "ipc_pair child" on both handles, then
 *                       check the child's writes
 *   ipc_pair child H I  open H twice and I once, read, write, close, close a third time, open a
 *                       corrupted handle and random bytes, open/close from 8 threads at once
 *   ipc_pair stale      parent frees (and reallocates) before the child opens the handle
 *   ipc_pair serve      allocate, fill, print "handle <hex> <address>", wait for stdin to close
 *   ipc_pair open H     open H, check the pattern of its first 4 KiB, close */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIZE (3u << 20)
#define FLAGS cudaIpcMemLazyEnablePeerAccess
#define THREADS 8

static void show(const char *what, cudaError_t e)
{
    printf("ipc: %-52s %s\n", what, cudaGetErrorName(e));
    fflush(stdout);
}

static void note(const char *what, int ok)
{
    printf("ipc: %-52s %s\n", what, ok ? "ok" : "FAILED");
    fflush(stdout);
}

static unsigned char pattern(size_t k, int which)
{
    return which == 1 ? (unsigned char)(k * 13 + 5) : (unsigned char)((k * 7 + 3) ^ 0xa5);
}

static void fill(unsigned char *h, size_t n, int which)
{
    for (size_t k = 0; k < n; k++) h[k] = pattern(k, which);
}

static int matches(const unsigned char *h, size_t n, int which)
{
    for (size_t k = 0; k < n; k++)
        if (h[k] != pattern(k, which)) return 0;
    return 1;
}

static void to_hex(const cudaIpcMemHandle_t *h, char out[129])
{
    const unsigned char *b = (const unsigned char *)h->reserved;
    for (int i = 0; i < 64; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static int from_hex(const char *s, cudaIpcMemHandle_t *h)
{
    if (strlen(s) != 128) return -1;
    for (int i = 0; i < 64; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
        h->reserved[i] = (char)v;
    }
    return 0;
}

/* Run this program again with args; returns its exit status (or 128+signal). */
static int spawn(char *const args[])
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execv("/proc/self/exe", args);
        _exit(127);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) < 0) return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Allocate and fill with pattern 1; NULL on failure (reported). */
static void *make_buffer(const char *who)
{
    void *p = NULL;
    char what[64];
    snprintf(what, sizeof what, "%s cudaMalloc 3 MiB", who);
    cudaError_t e = cudaMalloc(&p, SIZE);
    show(what, e);
    if (e != cudaSuccess) return NULL;
    unsigned char *h = malloc(SIZE);
    fill(h, SIZE, 1);
    snprintf(what, sizeof what, "%s cudaMemcpy pattern in", who);
    show(what, cudaMemcpy(p, h, SIZE, cudaMemcpyHostToDevice));
    free(h);
    return p;
}

static int parent(void)
{
    unsigned char *p = make_buffer("parent");
    if (!p) return 1;
    cudaIpcMemHandle_t h, hi;
    cudaError_t e = cudaIpcGetMemHandle(&h, p);
    show("parent cudaIpcGetMemHandle(base)", e);
    cudaError_t ei = cudaIpcGetMemHandle(&hi, p + 12345);
    show("parent cudaIpcGetMemHandle(base + 12345)", ei);
    if (e != cudaSuccess) return 1;
    if (ei != cudaSuccess) hi = h;
    void *own = NULL;
    e = cudaIpcOpenMemHandle(&own, h, FLAGS);
    show("parent opens its own handle", e);
    if (e == cudaSuccess) cudaIpcCloseMemHandle(own);
    cudaGetLastError();

    char hex[129], hexi[129], self[16] = "ipc_pair", mode[8] = "child";
    to_hex(&h, hex);
    to_hex(&hi, hexi);
    char *args[] = {self, mode, hex, hexi, NULL};
    int rc = spawn(args);
    printf("ipc: %-52s %d\n", "child exit status", rc);

    unsigned char *back = malloc(SIZE);
    show("parent cudaMemcpy back", cudaMemcpy(back, p, SIZE, cudaMemcpyDeviceToHost));
    note("parent sees the child's writes", matches(back, SIZE, 2));
    free(back);
    show("parent cudaFree", cudaFree(p));
    return 0;
}

typedef struct {
    cudaIpcMemHandle_t h;
    void *ptr;
    cudaError_t open_rc, close_rc;
} opener;

static pthread_barrier_t gate;

static void *open_in_thread(void *arg)
{
    opener *o = arg;
    pthread_barrier_wait(&gate);
    o->open_rc = cudaIpcOpenMemHandle(&o->ptr, o->h, FLAGS);
    return NULL;
}

static int child(const char *hex, const char *hexi)
{
    cudaIpcMemHandle_t h, hi;
    if (from_hex(hex, &h) || from_hex(hexi, &hi)) {
        printf("ipc: bad handle argument\n");
        return 2;
    }
    void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    cudaError_t ea = cudaIpcOpenMemHandle(&a, h, FLAGS);
    show("child cudaIpcOpenMemHandle", ea);
    cudaError_t eb = cudaIpcOpenMemHandle(&b, h, FLAGS);
    show("child cudaIpcOpenMemHandle again", eb);
    if (ea == cudaSuccess && eb == cudaSuccess) note("open twice: same pointer", a == b);
    cudaError_t ec = cudaIpcOpenMemHandle(&c, hi, FLAGS);
    show("child opens the interior pointer's handle", ec);
    if (ea == cudaSuccess && ec == cudaSuccess) note("interior pointer's handle: same pointer", a == c);
    if (ea == cudaSuccess) {
        unsigned char *buf = malloc(SIZE);
        show("child cudaMemcpy out", cudaMemcpy(buf, a, SIZE, cudaMemcpyDeviceToHost));
        note("child reads the parent's pattern", matches(buf, SIZE, 1));
        fill(buf, SIZE, 2);
        show("child cudaMemcpy second pattern in", cudaMemcpy(a, buf, SIZE, cudaMemcpyHostToDevice));
        show("child cudaDeviceSynchronize", cudaDeviceSynchronize());
        free(buf);
    }
    if (ec == cudaSuccess) show("child cudaIpcCloseMemHandle (interior)", cudaIpcCloseMemHandle(c));
    if (eb == cudaSuccess) show("child cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(b));
    if (ea == cudaSuccess) show("child cudaIpcCloseMemHandle again", cudaIpcCloseMemHandle(a));
    show("child cudaIpcCloseMemHandle once too often", cudaIpcCloseMemHandle(a));
    cudaGetLastError();

    cudaIpcMemHandle_t bad = h;
    bad.reserved[30] ^= 0x40;
    show("child opens a corrupted handle", cudaIpcOpenMemHandle(&d, bad, FLAGS));
    show("  cudaGetLastError after the corrupted handle", cudaGetLastError());
    cudaIpcMemHandle_t rnd;
    uint64_t x = 0x1234567890abcdefull;
    for (int i = 0; i < 64; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        rnd.reserved[i] = (char)(x >> 56);
    }
    show("child opens random bytes", cudaIpcOpenMemHandle(&d, rnd, FLAGS));
    show("  cudaGetLastError after random bytes", cudaGetLastError());

    /* many threads opening one handle at once share one mapping */
    opener o[THREADS];
    pthread_t t[THREADS];
    pthread_barrier_init(&gate, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) {
        memset(&o[i], 0, sizeof o[i]);
        o[i].h = h;
        pthread_create(&t[i], NULL, open_in_thread, &o[i]);
    }
    int all_ok = 1, same = 1, n_ok = 0;
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&gate);
    for (int i = 0; i < THREADS; i++) {
        all_ok &= o[i].open_rc == cudaSuccess;
        same &= o[i].ptr == o[0].ptr;
    }
    show("8 threads open at once", all_ok ? cudaSuccess : o[0].open_rc);
    if (all_ok) note("8 threads open at once: one pointer", same);
    for (int i = 0; i < THREADS; i++)
        if (o[i].open_rc == cudaSuccess && cudaIpcCloseMemHandle(o[i].ptr) == cudaSuccess) n_ok++;
    if (all_ok) note("8 closes succeed", n_ok == THREADS);
    return 0;
}

static int stale(void)
{
    unsigned char *p = make_buffer("parent");
    if (!p) return 1;
    cudaIpcMemHandle_t h;
    show("parent cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, p));
    show("parent cudaFree before the child opens", cudaFree(p));
    void *q = NULL;
    show("parent cudaMalloc 3 MiB again", cudaMalloc(&q, SIZE)); /* may reuse the same memory */
    char hex[129], self[16] = "ipc_pair", mode[8] = "open";
    to_hex(&h, hex);
    char *args[] = {self, mode, hex, NULL};
    int rc = spawn(args);
    printf("ipc: %-52s %d\n", "child exit status", rc);
    show("parent cudaFree", cudaFree(q));
    return 0;
}

static int serve(void)
{
    unsigned char *p = make_buffer("owner");
    if (!p) return 1;
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, p + 4096);
    show("owner cudaIpcGetMemHandle", e);
    char hex[129];
    to_hex(&h, hex);
    printf("handle %s 0x%llx\n", hex, (unsigned long long)(uintptr_t)p);
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
    }
    cudaFree(p);
    return 0;
}

static int open_one(const char *hex)
{
    cudaIpcMemHandle_t h;
    if (from_hex(hex, &h)) {
        printf("ipc: bad handle argument\n");
        return 2;
    }
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, FLAGS);
    show("cudaIpcOpenMemHandle", e);
    if (e != cudaSuccess) return 0;
    unsigned char buf[4096];
    show("cudaMemcpy out", cudaMemcpy(buf, p, sizeof buf, cudaMemcpyDeviceToHost));
    note("first 4 KiB hold the owner's pattern", matches(buf, sizeof buf, 1));
    show("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(p));
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "pair";
    if (!strcmp(mode, "pair")) return parent();
    if (!strcmp(mode, "child") && argc == 4) return child(argv[2], argv[3]);
    if (!strcmp(mode, "stale")) return stale();
    if (!strcmp(mode, "serve")) return serve();
    if (!strcmp(mode, "open") && argc == 3) return open_one(argv[2]);
    fprintf(stderr, "usage: ipc_pair [pair | child HEX HEX | stale | serve | open HEX]\n");
    return 2;
}
