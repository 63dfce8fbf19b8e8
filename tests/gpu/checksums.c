/* Test equipment for the GPU scripts, built with the project (the GPU machine has no
 * libxxhash-dev): the two checksums they compare bytes with, for Python through ctypes.
 * FNV-1a 64 is what the owners and trainers print of their buffers; XXH3-64 is what a dump's
 * manifest gives for each file (libxxhash's own, so a manifest is checked against the
 * reference, not against vmmctl's code). */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <stddef.h>
#include <stdint.h>

__attribute__((visibility("default"))) uint64_t vmm_test_fnv1a(const unsigned char *p, size_t n, uint64_t h)
{
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

__attribute__((visibility("default"))) uint64_t vmm_test_xxh3(const void *p, size_t n) { return XXH3_64bits(p, n); }
