/* Minimal assertion harness shared by the unit tests.  Every test binary ends with
 * CHECK_DONE(), which prints the "N passed, N failed" line that tests/run.sh sums. */
#ifndef VMM_TEST_CHECK_H
#define VMM_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>

static int check__passed, check__failed;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (cond) {                                                            \
            check__passed++;                                                   \
        } else {                                                               \
            check__failed++;                                                   \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                      \
            fputc('\n', stderr);                                               \
        }                                                                      \
    } while (0)

#define CHECK_EQ(a, b) CHECK((long long)(a) == (long long)(b), "%lld != %lld", (long long)(a), (long long)(b))

#define CHECK_DONE()                                                           \
    do {                                                                       \
        printf("%d passed, %d failed\n", check__passed, check__failed);        \
        fflush(stdout);                                                        \
        return check__failed ? 1 : 0;                                          \
    } while (0)

#endif
