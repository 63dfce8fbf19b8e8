/* Shared by the client library's own files only (never installed). */
#ifndef VMM_CLIENT_INTERNAL_H
#define VMM_CLIENT_INTERNAL_H
#include "vmmshim.h"

/* Record the calling thread's one-line reason (vmm_last_error) and return st. */
__attribute__((format(printf, 2, 3))) vmm_status vmm__client_error(vmm_status st, const char *fmt, ...);
#endif
