/* Broker wire format: on a SOCK_SEQPACKET connection, each request gets one reply (+ an SCM_RIGHTS
 * fd when status is 0); a peer may send any number of requests, one at a time, on one connection.
 * The broker closes a connection idle for 60 s, or the longest idle one when it has 64 open: a
 * peer reconnects when its next request finds the connection closed.  Little-endian fixed-width
 * fields; a reader in any language can speak it. */
#ifndef VMM_BROKER_PROTOCOL_H
#define VMM_BROKER_PROTOCOL_H
#include <stddef.h>
#include <stdint.h>

#define VMM_BROKER_MAGIC 0x424d4d56u /* "VMMB" */
#define VMM_BROKER_VERSION 1u

typedef struct vmm_broker_request {
    uint32_t magic;
    uint32_t version;
    uint64_t slot;
    uint64_t generation;
    uint8_t alloc_id[16];
} vmm_broker_request; /* 40 */

typedef struct vmm_broker_reply {
    uint32_t magic;
    int32_t status;       /* 0, or a negative errno: -ESTALE, -ENOENT, -EACCES, -EPROTO, ... */
    uint64_t mapped_size;
    uint32_t device;
    uint32_t export_ns;   /* how long the owner took to export the fd (saturating): for profiles */
} vmm_broker_reply; /* 24 */

_Static_assert(sizeof(vmm_broker_request) == 40, "request size");
_Static_assert(offsetof(vmm_broker_request, slot) == 8, "request.slot");
_Static_assert(offsetof(vmm_broker_request, generation) == 16, "request.generation");
_Static_assert(offsetof(vmm_broker_request, alloc_id) == 24, "request.alloc_id");
_Static_assert(sizeof(vmm_broker_reply) == 24, "reply size");
_Static_assert(offsetof(vmm_broker_reply, status) == 4, "reply.status");
_Static_assert(offsetof(vmm_broker_reply, mapped_size) == 8, "reply.mapped_size");
_Static_assert(offsetof(vmm_broker_reply, device) == 16, "reply.device");
_Static_assert(offsetof(vmm_broker_reply, export_ns) == 20, "reply.export_ns");
#endif
