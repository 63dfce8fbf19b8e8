/* The shim's own threads (thread.c). */
#ifndef VMM_THREAD_H
#define VMM_THREAD_H
#include <pthread.h>

/* Start fn(arg) in a detached thread that takes no signals (they are the application's):
 * pthread_create's result; *t names the thread when it is 0. */
int vmm__thread_detached(pthread_t *t, void *(*fn)(void *), void *arg);

#endif
