/* Starting the shim's own threads (give-back, broker, reaper, fd room): detached, since nothing
 * joins them, and with every signal blocked from the start, so that a signal the application
 * directs at its process is never delivered to a thread the application does not know of. */
#include "core/thread.h"

#include <signal.h>

int vmm__thread_detached(pthread_t *t, void *(*fn)(void *), void *arg)
{
    pthread_attr_t attr;
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(t, &attr, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc;
}
