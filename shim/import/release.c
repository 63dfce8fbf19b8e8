/* Telling an owner's broker that this process's import cache unmapped a chunk of its memory
 * (protocol v5), so that a pause of that memory, waiting for its companions to let go, hears it
 * (shim/broker/holders.c).  One datagram per chunk, no reply, on a connection of its own per owner
 * (rel_sock): a v5 datagram on the kept request connection would, to a broker older than v5,
 * draw an -EPROTO reply that the next request would read as its own.  Such a broker also closes
 * the connection: the next release finds that reply queued and stops telling that owner.
 * Nothing here blocks for long or fails loudly: a release not told makes a pause report a
 * holder that is not one, which the pause's wait bounds.  Calls owners.c only. */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "broker/broker.h"
#include "broker/protocol.h"

#include "import/internal.h"

void vmm__release_note_path(owner_ref *o)
{
    struct sockaddr_un sa;
    socklen_t len = sizeof sa;
    memset(&sa, 0, sizeof sa);
    if (getpeername(o->sock, (struct sockaddr *)&sa, &len) != 0 || sa.sun_family != AF_UNIX || !sa.sun_path[0]) return;
    pthread_mutex_lock(&o->rel_io);
    if (strcmp(o->path, sa.sun_path) != 0) { /* another broker (the owner's, or its keeper's) */
        if (o->rel_sock >= 0) close(o->rel_sock);
        o->rel_sock = -1;
        o->no_release = false;
        memcpy(o->path, sa.sun_path, sizeof o->path - 1);
        o->path[sizeof o->path - 1] = 0;
    }
    pthread_mutex_unlock(&o->rel_io);
}

/* rel_io held.  A connection to the owner's broker, without waiting: a broker whose backlog is
 * full is told nothing this time. */
static int rel_connect(owner_ref *o)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, o->path, sizeof o->path);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) return -1;
    int rc;
    do rc = connect(s, (struct sockaddr *)&sa, sizeof sa);
    while (rc < 0 && errno == EINTR);
    if (rc != 0) {
        close(s);
        return -1;
    }
    return s;
}

/* rel_io held.  What the broker sent on rel_sock: a v5 broker sends nothing, an older one its
 * -EPROTO (then it closes).  False when the connection is of no further use. */
static bool rel_usable(owner_ref *o)
{
    uint8_t buf[64];
    ssize_t n;
    do n = recv(o->rel_sock, buf, sizeof buf, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n > 0) o->no_release = true; /* any answer at all: it predates v5 */
    close(o->rel_sock); /* answered, closed (idle for 60 s), or broken */
    o->rel_sock = -1;
    return false;
}

void vmm__release_tell(const chunk *c)
{
    owner_ref *o = c->owner;
    struct {
        vmm_broker_release5 h;
        vmm_broker_gone5 g;
    } msg;
    memset(&msg, 0, sizeof msg);
    msg.h.magic = VMM_BROKER_MAGIC;
    msg.h.version = VMM_BROKER_VERSION5;
    msg.h.n = 1;
    /* what the owner recorded it under: a one-handle chunk's key is its segment's id; a
     * MULTI-HANDLE one was asked for by slot and generation (the owner knows its handles' keys) */
    msg.g.key = c->key.by_slot ? VMM_BROKER_NO_KEY : c->key.id;
    msg.g.slot = c->key.by_slot ? c->key.id : 0;
    msg.g.generation = c->key.by_slot ? c->key.generation : 0;
    pthread_mutex_lock(&o->rel_io);
    for (int attempt = 0; attempt < 2 && !o->no_release && o->path[0]; attempt++) {
        if (o->rel_sock >= 0 && !rel_usable(o)) continue;
        if (o->rel_sock < 0 && (o->rel_sock = rel_connect(o)) < 0) break;
        ssize_t n;
        do n = send(o->rel_sock, &msg, sizeof msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        while (n < 0 && errno == EINTR);
        if (n == (ssize_t)sizeof msg) break;
        close(o->rel_sock); /* closed under us (idle): once more on a fresh one */
        o->rel_sock = -1;
    }
    pthread_mutex_unlock(&o->rel_io);
}
