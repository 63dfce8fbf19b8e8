/* Thread tags (vmm_set_thread_tag) as a program sees them: allocations made untagged, under "kv"
 * on the main thread (both APIs), under "opt" on another thread, and untagged again, then each one's
 * record read back from the registry this process publishes in.  Prints, for each, a line
 *   "<name> tag=<tag> chunk=<chunk_id>"
 * and the calls' answers:
 *   "first: (null)", "back: kv", "restored: (null)", "too long: kept (null) ..." .
 * Linked with the client library: natively vmm_set_thread_tag answers NULL and sets nothing. */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vmmshim.h"

static void *opt_ptr;

static void *other_thread(void *arg)
{
    (void)arg;
    vmm_set_thread_tag("opt");
    if (cudaMalloc(&opt_ptr, 3u << 20) != cudaSuccess) opt_ptr = NULL;
    return NULL;
}

static void show(vmm_registry *reg, const char *name, void *p)
{
    vmm_alloc_info a;
    if (!reg || !p || vmm_find(reg, (uint32_t)getpid(), (uint64_t)(uintptr_t)p, &a) != VMM_OK)
        printf("%s missing\n", name);
    else
        printf("%s tag=%s chunk=%llu\n", name, a.tag[0] ? a.tag : "-", (unsigned long long)a.chunk_id);
}

int main(void)
{
    void *untagged = NULL, *kv = NULL, *kv_async = NULL, *after = NULL;
    const char *s;
    if (cudaMalloc(&untagged, 1u << 20) != cudaSuccess) return 1;
    s = vmm_set_thread_tag("kv");
    printf("first: %s\n", s ? s : "(null)");
    if (cudaMalloc(&kv, 1u << 20) != cudaSuccess || cudaMallocAsync(&kv_async, 4096, 0) != cudaSuccess) return 1;
    s = vmm_thread_tag();
    printf("current: %s\n", s ? s : "(null)");
    s = vmm_set_thread_tag(NULL);
    printf("back: %s\n", s ? s : "(null)");
    s = vmm_thread_tag();
    printf("restored: %s\n", s ? s : "(null)");
    if (cudaMalloc(&after, 1u << 20) != cudaSuccess) return 1;
    pthread_t t;
    if (pthread_create(&t, NULL, other_thread, NULL) != 0 || pthread_join(t, NULL) != 0) return 1;
    s = vmm_set_thread_tag("a tag that is far longer than thirty-one bytes");
    const char *now = vmm_thread_tag();
    printf("too long: kept %s, now %s, error %s\n", s ? s : "(null)", now ? now : "(null)", vmm_publish_error());
    if (cudaStreamSynchronize(0) != cudaSuccess) return 1;

    vmm_registry *reg = NULL;
    const char *name = getenv("VMMSHIM_REGISTRY");
    if (vmm_open(name, &reg) != VMM_OK) reg = NULL;
    show(reg, "untagged", untagged);
    show(reg, "kv", kv);
    show(reg, "kv_async", kv_async);
    show(reg, "after", after);
    show(reg, "opt", opt_ptr);
    if (reg) vmm_close(reg);
    cudaFree(untagged), cudaFree(kv), cudaFreeAsync(kv_async, 0), cudaFree(after), cudaFree(opt_ptr);
    return 0;
}
