/* The fd broker (shim/broker/broker.c) and the client's import (shim/import/import.c).
 *
 * No shim here: forked children of this test play the owner.  Each creates a 2 MiB VMM
 * allocation through the emulated driver (build/fakecuda), fills it with a pattern, publishes it
 * in a private registry and starts the broker with an export function of its own.  Companions
 * (build/tests/prog_broker_companion, public API only) import it and read and write the bytes:
 * with the emulated driver device pointers are host addresses.  Cases needing a second uid run
 * only as root (as CI does). */
#include "../../shim/broker/broker.c" /* test equipment: the broker's statics stay reachable */
#include "../../shim/broker/dir.c"
#include "../../shim/broker/holders.c"
#include "../../shim/broker/control.c"

#include "check.h"
#include "registry/registry.h"
#include "vmmshim.h"

#include <cuda.h>
#include <dlfcn.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#define ALLOC_SIZE (2ull << 20)
#define REQ_SIZE (ALLOC_SIZE - 4096 - 17)
#define OTHER_UID 54321
#define OTHER_GID 54321
#define SHARE_GID 54322
#define THIRD_UID 54323

static char g_companion[600];
static char g_base[128]; /* "/tmp/vmmshim-tb-<pid>": every directory of this test starts so */
static char g_reg[64], g_reg_group[64];
static bool g_root;

static uint8_t pattern(unsigned seed, uint64_t i) { return (uint8_t)(seed + i * 31u + (i >> 9)); }

static long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ------------------------------------------------------------------------------------------ */
/* The emulated driver, through dlsym as a companion would                                     */

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                           unsigned long long);
    void *fake_counters;
} drv;

static bool load_driver(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return false;
    struct {
        const char *n;
        void **p;
    } s[] = {
        {"cuInit", (void **)&drv.Init},
        {"cuDeviceGet", (void **)&drv.DeviceGet},
        {"cuDevicePrimaryCtxRetain", (void **)&drv.DevicePrimaryCtxRetain},
        {"cuCtxSetCurrent", (void **)&drv.CtxSetCurrent},
        {"cuMemCreate", (void **)&drv.MemCreate},
        {"cuMemAddressReserve", (void **)&drv.MemAddressReserve},
        {"cuMemMap", (void **)&drv.MemMap},
        {"cuMemSetAccess", (void **)&drv.MemSetAccess},
        {"cuMemExportToShareableHandle", (void **)&drv.MemExportToShareableHandle},
        {"fakecuda_counters", &drv.fake_counters},
    };
    for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
        void *p = dlsym(h, s[i].n);
        if (!p) return false;
        memcpy(s[i].p, &p, sizeof p);
    }
    return true;
}

/* ------------------------------------------------------------------------------------------ */
/* Plumbing: full reads/writes with a deadline, children that report their CHECK counts        */

static bool write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return false;
        p += n, len -= (size_t)n;
    }
    return true;
}

/* Reads exactly len bytes within timeout_ms; returns the bytes read. */
static size_t read_full(int fd, void *buf, size_t len, int timeout_ms)
{
    char *p = buf;
    size_t got = 0;
    long end = now_ms() + timeout_ms;
    while (got < len) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        long left = end - now_ms();
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0) break;
        ssize_t n = read(fd, p + got, len - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    return got;
}

/* waitpid with a deadline; a child past it is killed.  Returns the wait status, -1 on timeout. */
static int wait_child(pid_t pid, int timeout_ms)
{
    long end = now_ms() + timeout_ms;
    int st = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return st;
        if (r < 0 && errno != EINTR) return -1;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
}

/* Runs fn in a forked child (fresh broker state, its own environment); the child's CHECK
 * counts are added to ours. */
static void in_child(const char *name, void (*fn)(void *), void *arg)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        CHECK(0, "%s: pipe: %s", name, strerror(errno));
        return;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        check__passed = check__failed = 0;
        fn(arg);
        int c[2] = {check__passed, check__failed};
        (void)write_full(p[1], c, sizeof c);
        fflush(stderr);
        _exit(0);
    }
    close(p[1]);
    int c[2] = {0, 0};
    size_t n = read_full(p[0], c, sizeof c, 60000);
    close(p[0]);
    int st = wait_child(pid, 10000);
    CHECK(n == sizeof c && st == 0, "%s: the child did not finish (wait status %d)", name, st);
    if (n == sizeof c) {
        check__passed += c[0];
        check__failed += c[1];
    }
}

static bool file_contains(const char *path, const char *needle)
{
    char buf[8192];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    return strstr(buf, needle) != NULL;
}

static unsigned mode_of(const char *path, struct stat *st)
{
    return lstat(path, st) == 0 ? (unsigned)(st->st_mode & 07777) : 01000000u;
}

/* Removes a test directory and the files in it (one level: all this test creates). */
static void remove_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        if (unlink(p) != 0 && (errno == EISDIR || errno == EPERM)) remove_tree(p);
    }
    closedir(d);
    rmdir(dir);
}

/* ------------------------------------------------------------------------------------------ */
/* Raw protocol, as any client in any language would speak it                                  */

static int raw_connect(const char *path)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) return -errno;
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        close(s);
        return -e;
    }
    return s;
}

/* Sends len bytes of req on connection s; 0 with *rep and *fd (-1 when none came), or -errno
 * (-ECONNRESET when the broker closed the connection instead of replying). */
static int raw_exchange(int s, const void *req, size_t len, vmm_broker_reply *rep, int *fd)
{
    *fd = -1;
    memset(rep, 0, sizeof *rep);
    if (send(s, req, len, MSG_NOSIGNAL) != (ssize_t)len) return -errno;
    struct pollfd pf = {.fd = s, .events = POLLIN};
    if (poll(&pf, 1, 5000) != 1) return -ETIMEDOUT;
    union {
        struct cmsghdr a;
        char b[CMSG_SPACE(sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = rep, .iov_len = sizeof *rep};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.b;
    mh.msg_controllen = sizeof ctl.b;
    ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0) return -errno;
    if (n == 0) return -ECONNRESET;
    if (n != (ssize_t)sizeof *rep) return -EPROTO;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(fd, CMSG_DATA(c), sizeof(int));
    return 0;
}

/* One request on a connection of its own. */
static int raw_request(const char *path, const void *req, size_t len, vmm_broker_reply *rep, int *fd)
{
    *fd = -1;
    memset(rep, 0, sizeof *rep);
    int s = raw_connect(path);
    if (s < 0) return s;
    int rc = raw_exchange(s, req, len, rep, fd);
    close(s);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* The owner: a forked child that allocates, publishes, runs the broker, and obeys commands    */

typedef struct owner_cfg {
    const char *reg_name, *reg_group, *broker_dir, *broker_group, *log_path;
    uint32_t kinds;
    unsigned seed;
} owner_cfg;

typedef struct owner_info {
    int rc; /* 0, or the failing step */
    char err[200];
    int32_t pid, exported_fd;
    uint64_t address, slot, generation;
    uint8_t id[16];
    char sock[112];
} owner_info;

typedef struct owner {
    pid_t pid;
    int cmd, rep;
    owner_info info;
} owner;

/* owner-process state; the broker thread reads it under o_lock */
static pthread_mutex_t o_lock = PTHREAD_MUTEX_INITIALIZER;
static vmm__reg o_reg;
static CUmemGenericAllocationHandle o_handle;
static CUdeviceptr o_ptr;
static uint32_t o_slot, o_kinds;
static uint64_t o_gen;
static uint8_t o_id[16];
static int o_pidfd_fd = -1;
static owner_info o_info;

static int owner_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                        int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)keys; /* no key: every handle passed each time it is asked for */
    pthread_mutex_lock(&o_lock);
    int rc = 0;
    if (slot != o_slot)
        rc = -ENOENT;
    else if (generation != o_gen || memcmp(alloc_id, o_id, 16) != 0)
        rc = -ESTALE;
    CUmemGenericAllocationHandle h = o_handle;
    pthread_mutex_unlock(&o_lock);
    if (rc) return rc;
    *n_total = 1;
    if (first != 0 || max == 0) return -ERANGE;
    int f = -1;
    if (drv.MemExportToShareableHandle(&f, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) != CUDA_SUCCESS) return -EIO;
    fds[0] = f;
    sizes[0] = ALLOC_SIZE;
    *n_here = 1;
    *device = 0;
    return 0;
}

static int owner_publish(void)
{
    vmm_reg_alloc d, pub;
    memset(&d, 0, sizeof d);
    d.device = 0;
    d.api = VMM_API_TEST;
    d.requested_size = REQ_SIZE;
    d.handle_kinds = o_kinds;
    d.exported_fd = o_pidfd_fd;
    snprintf(d.tag, sizeof d.tag, "test_broker");
    int rc = vmm__reg_publish(&o_reg, o_slot, &d, &pub);
    if (rc) return rc;
    o_gen = pub.generation;
    memcpy(o_id, pub.alloc_id, 16);
    o_info.generation = pub.generation;
    memcpy(o_info.id, pub.alloc_id, 16);
    return 0;
}

#define OWNER_FAIL(step, ...)                                                                    \
    do {                                                                                         \
        o_info.rc = step;                                                                        \
        snprintf(o_info.err, sizeof o_info.err, __VA_ARGS__);                                    \
        (void)write_full(rep, &o_info, sizeof o_info);                                           \
        _exit(1);                                                                                \
    } while (0)

/* Is every ordinary signal blocked in the broker thread, and none in this (main) thread? */
static int broker_thread_masks_ok(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d) return 0;
    int others = 0, ok = 1;
    pid_t self = (pid_t)syscall(SYS_gettid);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        char path[96], buf[4096];
        if (snprintf(path, sizeof path, "/proc/self/task/%s/status", de->d_name) >= (int)sizeof path) continue;
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0) continue;
        buf[n] = 0;
        char *l = strstr(buf, "\nSigBlk:");
        if (!l) continue;
        unsigned long long mask = strtoull(l + 8, NULL, 16);
        unsigned long long want = (1ull << (SIGINT - 1)) | (1ull << (SIGTERM - 1)) | (1ull << (SIGUSR1 - 1)) |
                                  (1ull << (SIGCHLD - 1)) | (1ull << (SIGPIPE - 1));
        if (atoi(de->d_name) == self) {
            if (mask & want) ok = 0; /* the caller's mask was restored */
        } else {
            others++;
            if ((mask & want) != want) ok = 0;
        }
    }
    closedir(d);
    return ok && others >= 1;
}

/* Forks a child that forgets the broker and starts its own: 0 = all as expected, else a bit
 * per failed expectation. */
static int owner_fork_check(void)
{
    int p[2];
    if (pipe(p) != 0) return 0x100;
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        vmm__broker_forget_after_fork();
        char path[112] = "";
        int bits = 0;
        if (vmm__broker_start(owner_export, path, sizeof path) != 0) bits |= 1;
        char want[160];
        snprintf(want, sizeof want, "%.*s/%d.sock", (int)(strrchr(o_info.sock, '/') - o_info.sock), o_info.sock,
                 (int)getpid());
        if (strcmp(path, want) != 0) bits |= 2;
        struct stat st;
        if (lstat(o_info.sock, &st) != 0) bits |= 4; /* the parent's socket is untouched */
        (void)write_full(p[1], &bits, sizeof bits);
        (void)write_full(p[1], path, sizeof path);
        /* What exit() would run (the handler registered by the parent is inherited): it must
         * unlink the child's own socket only.  Called directly and then _exit, because LSan in
         * a fork child of a threaded process warns about the parent's threads. */
        at_exit_unlink();
        _exit(0);
    }
    close(p[1]);
    int bits = 0x200;
    char path[112] = "";
    if (read_full(p[0], &bits, sizeof bits, 10000) != sizeof bits) bits = 0x200;
    if (read_full(p[0], path, sizeof path, 10000) != sizeof path) bits |= 0x400;
    close(p[0]);
    if (wait_child(pid, 10000) != 0) bits |= 0x800;
    struct stat st;
    if (lstat(o_info.sock, &st) != 0) bits |= 0x10; /* ours survived the child's exit */
    if (path[0] && lstat(path, &st) == 0) bits |= 0x20; /* the child's was removed at its exit */
    /* and our broker still answers */
    vmm_broker_request req = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION, .slot = o_slot};
    pthread_mutex_lock(&o_lock);
    req.generation = o_gen;
    memcpy(req.alloc_id, o_id, 16);
    pthread_mutex_unlock(&o_lock);
    vmm_broker_reply rep;
    int fd;
    if (raw_request(o_info.sock, &req, sizeof req, &rep, &fd) != 0 || rep.status != 0 || fd < 0) bits |= 0x40;
    if (fd >= 0) close(fd);
    return bits;
}

static void owner_main(const owner_cfg *cfg, int cmd, int rep)
{
    memset(&o_info, 0, sizeof o_info);
    o_info.pid = (int32_t)getpid();
    o_kinds = cfg->kinds;
    if (cfg->broker_dir) setenv("VMMSHIM_BROKER_DIR", cfg->broker_dir, 1);
    if (cfg->broker_group)
        setenv("VMMSHIM_BROKER_GROUP", cfg->broker_group, 1);
    else
        unsetenv("VMMSHIM_BROKER_GROUP");
    vmm__opt_reload_for_test();
    if (cfg->log_path) {
        int lf = open(cfg->log_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
        if (lf >= 0) vmm__log_set_fd_for_test(lf);
    }
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    CUresult r;
    if ((r = drv.Init(0)) || (r = drv.DeviceGet(&dev, 0)) || (r = drv.DevicePrimaryCtxRetain(&ctx, dev)) ||
        (r = drv.CtxSetCurrent(ctx)))
        OWNER_FAIL(1, "driver init: %d", (int)r);
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    if ((r = drv.MemCreate(&o_handle, ALLOC_SIZE, &prop, 0))) OWNER_FAIL(2, "cuMemCreate: %d", (int)r);
    if ((r = drv.MemAddressReserve(&o_ptr, ALLOC_SIZE, ALLOC_SIZE, 0, 0)))
        OWNER_FAIL(3, "cuMemAddressReserve: %d", (int)r);
    if (o_ptr % ALLOC_SIZE) OWNER_FAIL(3, "reservation 0x%llx is not 2 MiB aligned", (unsigned long long)o_ptr);
    if ((r = drv.MemMap(o_ptr, ALLOC_SIZE, 0, o_handle, 0))) OWNER_FAIL(4, "cuMemMap: %d", (int)r);
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = (int)dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = drv.MemSetAccess(o_ptr, ALLOC_SIZE, &acc, 1))) OWNER_FAIL(5, "cuMemSetAccess: %d", (int)r);
    uint8_t *host = (uint8_t *)(uintptr_t)o_ptr;
    for (uint64_t i = 0; i < REQ_SIZE; i++) host[i] = pattern(cfg->seed, i);
    o_info.address = o_ptr;

    if (cfg->kinds & VMM_HANDLE_PIDFD) {
        /* pidfd mode keeps every exported fd open above 1023, out of the application's way */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 2048 && rl.rlim_max >= 2048) {
            rl.rlim_cur = 2048;
            setrlimit(RLIMIT_NOFILE, &rl);
        }
        int f = -1;
        if ((r = drv.MemExportToShareableHandle(&f, o_handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
            OWNER_FAIL(6, "cuMemExportToShareableHandle: %d", (int)r);
        o_pidfd_fd = fcntl(f, F_DUPFD_CLOEXEC, 1024);
        close(f);
        if (o_pidfd_fd < 0) OWNER_FAIL(6, "F_DUPFD_CLOEXEC 1024: %s", strerror(errno));
    }
    o_info.exported_fd = o_pidfd_fd;

    char err[256] = "";
    int rc = vmm__reg_open(&o_reg, cfg->reg_name, VMM__REG_CREATE, 1024, cfg->reg_group, err, sizeof err);
    if (rc) OWNER_FAIL(7, "registry: %s", err);
    if ((rc = vmm__reg_attach(&o_reg, NULL))) OWNER_FAIL(8, "attach: %d", rc);
    if ((rc = vmm__reg_bind(&o_reg, o_ptr, ALLOC_SIZE, &o_slot))) OWNER_FAIL(9, "bind: %d", rc);
    o_info.slot = o_slot;
    pthread_mutex_lock(&o_lock);
    rc = owner_publish();
    pthread_mutex_unlock(&o_lock);
    if (rc) OWNER_FAIL(10, "publish: %d", rc);
    if (cfg->kinds & VMM_HANDLE_BROKER) {
        /* what the shim does on its first allocation: attach, start the broker, record its path */
        rc = vmm__broker_start(owner_export, o_info.sock, sizeof o_info.sock);
        if (rc) OWNER_FAIL(11, "broker start: %d (%s)", rc, strerror(-rc));
        if ((rc = vmm__reg_set_broker(&o_reg, o_info.sock))) OWNER_FAIL(12, "set_broker: %d", rc);
    }
    if (!write_full(rep, &o_info, sizeof o_info)) _exit(1);

    for (;;) {
        uint8_t c[2];
        if (read_full(cmd, c, 2, 600000) != 2) _exit(0);
        if (c[0] == 'V') { /* verify pattern(c[1]) */
            uint8_t ok = 1;
            for (uint64_t i = 0; i < REQ_SIZE && ok; i++) ok = host[i] == pattern(c[1], i);
            (void)write_full(rep, &ok, 1);
        } else if (c[0] == 'R') { /* free and allocate again in the same place: a new generation */
            pthread_mutex_lock(&o_lock);
            rc = vmm__reg_retract(&o_reg, o_slot);
            if (!rc) rc = owner_publish();
            pthread_mutex_unlock(&o_lock);
            o_info.rc = rc;
            (void)write_full(rep, &o_info, sizeof o_info);
        } else if (c[0] == 'S') {
            uint8_t ok = (uint8_t)broker_thread_masks_ok();
            (void)write_full(rep, &ok, 1);
        } else if (c[0] == 'F') {
            int bits = owner_fork_check();
            (void)write_full(rep, &bits, sizeof bits);
        } else if (c[0] == 'Q') {
            exit(0); /* a normal exit: the broker thread must not hold it up */
        }
    }
}

static bool owner_start(const owner_cfg *cfg, owner *o)
{
    memset(o, 0, sizeof *o);
    int c[2], r[2];
    if (pipe2(c, O_CLOEXEC) != 0 || pipe2(r, O_CLOEXEC) != 0) return false;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(c[1]);
        close(r[0]);
        owner_main(cfg, c[0], r[1]);
        _exit(0);
    }
    close(c[0]);
    close(r[1]);
    o->pid = pid;
    o->cmd = c[1];
    o->rep = r[0];
    size_t n = read_full(o->rep, &o->info, sizeof o->info, 30000);
    CHECK(n == sizeof o->info && o->info.rc == 0, "owner did not start: step %d: %s", o->info.rc,
          n == sizeof o->info ? o->info.err : "no report");
    return n == sizeof o->info && o->info.rc == 0;
}

static bool owner_cmd(owner *o, char op, uint8_t arg, void *reply, size_t len)
{
    uint8_t c[2] = {(uint8_t)op, arg};
    return write_full(o->cmd, c, 2) && read_full(o->rep, reply, len, 30000) == len;
}

static bool owner_verify(owner *o, unsigned seed)
{
    uint8_t ok = 0;
    return owner_cmd(o, 'V', (uint8_t)seed, &ok, 1) && ok == 1;
}

static void owner_close_pipes(owner *o)
{
    close(o->cmd);
    close(o->rep);
}

/* Normal exit; returns the wait status (-1: it did not exit within 5 s). */
static int owner_quit(owner *o)
{
    uint8_t c[2] = {'Q', 0};
    (void)write_full(o->cmd, c, 2);
    int st = wait_child(o->pid, 5000);
    owner_close_pipes(o);
    return st;
}

static void owner_kill(owner *o)
{
    kill(o->pid, SIGKILL);
    wait_child(o->pid, 5000);
    owner_close_pipes(o);
}

/* ------------------------------------------------------------------------------------------ */
/* Companions                                                                                  */

typedef struct creds {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[2];
} creds;

/* Starts the companion with stdin/stdout on pipes, as cr (NULL: as we are), with env's
 * "NAME=value" entries added ("NAME=" unsets); returns its pid. */
static pid_t companion_spawn(const char *const *args, const creds *cr, const char *const *env, int *in_w, int *out_r)
{
    int i[2], o[2];
    if (pipe2(i, O_CLOEXEC) != 0 || pipe2(o, O_CLOEXEC) != 0) return -1;
    char *argv[12];
    int n = 0;
    argv[n++] = g_companion;
    for (; args[n - 1] && n < 11; n++) argv[n] = (char *)args[n - 1];
    argv[n] = NULL;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(i[0], 0);
        dup2(o[1], 1);
        for (; env && *env; env++) {
            const char *eq = strchr(*env, '=');
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)(eq - *env), *env);
            if (eq[1])
                setenv(name, eq + 1, 1);
            else
                unsetenv(name);
        }
        if (cr && (setgroups((size_t)cr->ngroups, cr->groups) != 0 || setresgid(cr->gid, cr->gid, cr->gid) != 0 ||
                   setresuid(cr->uid, cr->uid, cr->uid) != 0))
            _exit(126);
        execv(g_companion, argv);
        _exit(127);
    }
    close(i[0]);
    close(o[1]);
    *in_w = i[1];
    *out_r = o[0];
    return pid;
}

/* Runs a companion to the end: its exit code (-1: killed or timed out); its stdout in out. */
static int companion_run(const char *const *args, const creds *cr, const char *const *env, char *out, size_t outlen)
{
    int in_w, out_r;
    pid_t pid = companion_spawn(args, cr, env, &in_w, &out_r);
    if (pid < 0) return -1;
    close(in_w);
    size_t got = 0;
    long end = now_ms() + 30000;
    for (;;) {
        struct pollfd pf = {.fd = out_r, .events = POLLIN};
        long left = end - now_ms();
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0) break;
        ssize_t n = read(out_r, out + got, outlen - 1 - got);
        if (n <= 0) break;
        got += (size_t)n;
        if (got >= outlen - 1) break;
    }
    out[got] = 0;
    close(out_r);
    int st = wait_child(pid, 5000);
    return st >= 0 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A companion's exit code must be `expect`; on a mismatch its output is shown. */
#define COMPANION(args, cr, expect, out) COMPANION_ENV(args, cr, NULL, expect, out)
#define COMPANION_ENV(args, cr, env, expect, out)                                                            \
    do {                                                                                                     \
        int rc_ = companion_run(args, cr, env, out, sizeof out);                                             \
        CHECK(rc_ == (expect), "companion %s %s: exit %d, expected %d; it said: %s", args[0], args[3], rc_,  \
              (int)(expect), out);                                                                           \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* Cases                                                                                       */

static int dummy_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                        int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)keys; /* no key: every handle passed each time it is asked for */
    (void)slot, (void)generation, (void)alloc_id, (void)first, (void)max, (void)fds, (void)sizes, (void)n_here,
        (void)n_total, (void)device;
    return -ENOENT;
}

typedef struct dir_case {
    const char *name;
    int kind; /* what to set up before starting */
    const char *log;
} dir_case;

enum { DC_SYMLINK, DC_WORLD_WRITABLE_THEN_FIXED, DC_GROUP_WRITABLE, DC_OTHER_OWNER, DC_UMASK, DC_XDG, DC_BAD_GROUP };

/* Broker threads of this process, by name (a sanitizer runtime may run threads of its own). */
static int count_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d) return -1;
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        char path[300], name[32] = "";
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (f && fgets(name, sizeof name, f) && !strncmp(name, "vmmshim-broker", 14)) n++;
        if (f) fclose(f);
    }
    closedir(d);
    return n;
}

static void dir_case_child(void *arg)
{
    const dir_case *dc = arg;
    char dir[256], real[300], path[112] = "", want[400];
    struct stat st;
    snprintf(dir, sizeof dir, "%s-%s", g_base, dc->name);
    mkdir(dir, 0700);
    int lf = open(dc->log, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    vmm__log_set_fd_for_test(lf);
    unsetenv("VMMSHIM_BROKER_GROUP");
    int rc;
    switch (dc->kind) {
    case DC_SYMLINK:
        snprintf(real, sizeof real, "%s/real", dir);
        mkdir(real, 0700);
        snprintf(want, sizeof want, "%s/link", dir);
        CHECK(symlink(real, want) == 0, "symlink: %s", strerror(errno));
        setenv("VMMSHIM_BROKER_DIR", want, 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        CHECK(rc < 0, "a symlinked broker directory was accepted (rc %d, %s)", rc, path);
        CHECK(file_contains(dc->log, "link is a symlink; refusing it"), "no warning naming the symlink");
        break;
    case DC_WORLD_WRITABLE_THEN_FIXED:
    case DC_GROUP_WRITABLE:
        snprintf(real, sizeof real, "%s/d", dir);
        mkdir(real, 0700);
        chmod(real, dc->kind == DC_GROUP_WRITABLE ? 0770 : 0777);
        setenv("VMMSHIM_BROKER_DIR", real, 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        CHECK(rc == -EACCES, "a directory writable by others was accepted (rc %d)", rc);
        CHECK(file_contains(dc->log, "writable by others"), "no warning about the mode");
        CHECK_EQ(count_threads(), 0);
        if (dc->kind == DC_WORLD_WRITABLE_THEN_FIXED) {
            /* a failed start may be retried */
            chmod(real, 0700);
            rc = vmm__broker_start(dummy_export, path, sizeof path);
            snprintf(want, sizeof want, "%s/%d.sock", real, (int)getpid());
            CHECK(rc == 0 && !strcmp(path, want), "retry after fixing the mode: rc %d, path %s", rc, path);
            CHECK_EQ(count_threads(), 1);
            at_exit_unlink();
        }
        break;
    case DC_OTHER_OWNER:
        snprintf(real, sizeof real, "%s/d", dir);
        mkdir(real, 0700);
        CHECK(chown(real, OTHER_UID, OTHER_GID) == 0, "chown: %s", strerror(errno));
        setenv("VMMSHIM_BROKER_DIR", real, 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        CHECK(rc == -EACCES, "another user's directory was accepted (rc %d)", rc);
        CHECK(file_contains(dc->log, "owned by uid 54321"), "no warning naming the owner");
        break;
    case DC_UMASK:
        /* the modes are set explicitly, whatever the umask */
        umask(0777);
        snprintf(real, sizeof real, "%s/new", dir);
        setenv("VMMSHIM_BROKER_DIR", real, 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        umask(022);
        snprintf(want, sizeof want, "%s/%d.sock", real, (int)getpid());
        CHECK(rc == 0 && !strcmp(path, want), "start: rc %d, path %s", rc, path);
        CHECK(mode_of(real, &st) == 0700 && S_ISDIR(st.st_mode) && st.st_uid == geteuid(), "directory mode %o",
              mode_of(real, &st));
        CHECK(mode_of(path, &st) == 0600 && S_ISSOCK(st.st_mode), "socket mode %o", mode_of(path, &st));
        /* idempotent: the same path, no second thread */
        char again[112] = "";
        CHECK_EQ(vmm__broker_start(dummy_export, again, sizeof again), 0);
        CHECK(!strcmp(again, path), "second start gave %s", again);
        CHECK_EQ(count_threads(), 1);
        char tiny[8];
        CHECK_EQ(vmm__broker_start(dummy_export, tiny, sizeof tiny), -ENAMETOOLONG);
        at_exit_unlink();
        CHECK(lstat(path, &st) != 0, "the at-exit handler left the socket");
        break;
    case DC_XDG:
        snprintf(real, sizeof real, "%s/xdg", dir);
        mkdir(real, 0700);
        unsetenv("VMMSHIM_BROKER_DIR");
        setenv("XDG_RUNTIME_DIR", real, 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        snprintf(want, sizeof want, "%s/vmmshim/%d.sock", real, (int)getpid());
        CHECK(rc == 0 && !strcmp(path, want), "XDG default: rc %d, path %s", rc, path);
        at_exit_unlink();
        break;
    case DC_BAD_GROUP:
        snprintf(real, sizeof real, "%s/d", dir);
        setenv("VMMSHIM_BROKER_DIR", real, 1);
        setenv("VMMSHIM_BROKER_GROUP", "vmmshim-no-such-group", 1);
        vmm__opt_reload_for_test();
        rc = vmm__broker_start(dummy_export, path, sizeof path);
        CHECK(rc == -EINVAL, "an unknown broker group was accepted (rc %d)", rc);
        CHECK(file_contains(dc->log, "vmmshim-no-such-group"), "no warning naming the group");
        break;
    }
    vmm__log_set_fd_for_test(-1);
    close(lf);
}

/* ---- v3 batches: the broker thread of this (child) process, a raw peer in another thread ---- */

/* Slot s is an allocation of s handles (slot 0: none, -ENOENT), generation 3 * s (else -ESTALE);
 * handle h is 2 MiB * (h + 1) of one memfd, dup'ed per export, keyed by slot and h (a slot named
 * twice in a batch names its handles again). */
static int g_b3_memfd = -1;
static unsigned long g_b3_exports;

static int batch_export(uint64_t slot, uint64_t generation, const uint8_t alloc_id[16], uint32_t first, uint32_t max,
                        int *fds, uint64_t *sizes, uint64_t *keys, uint32_t *n_here, uint32_t *n_total, uint32_t *device)
{
    (void)alloc_id;
    __atomic_add_fetch(&g_b3_exports, 1, __ATOMIC_RELAXED);
    if (slot == 0) return -ENOENT;
    if (generation != 3 * slot) return -ESTALE;
    *n_total = (uint32_t)slot;
    *device = 1;
    if (first >= slot) return -ERANGE;
    for (*n_here = 0; *n_here < max && first + *n_here < slot; (*n_here)++) {
        fds[*n_here] = fcntl(g_b3_memfd, F_DUPFD_CLOEXEC, 0);
        sizes[*n_here] = (2ull << 20) * (first + *n_here + 1);
        keys[*n_here] = slot << 16 | (first + *n_here);
    }
    return 0;
}

static size_t b3_request(uint8_t *buf, uint32_t n, const uint64_t *slot, const uint32_t *first, const uint32_t *count,
                         uint32_t flags)
{
    vmm_broker_request3 h = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION3, .n_entries = n, .flags = flags};
    memcpy(buf, &h, sizeof h);
    for (uint32_t i = 0; i < n; i++) {
        vmm_broker_entry3 e = {.slot = slot[i], .generation = 3 * slot[i], .first = first ? first[i] : 0,
                               .count = count ? count[i] : 0};
        memcpy(buf + sizeof h + i * sizeof e, &e, sizeof e);
    }
    return sizeof h + n * sizeof(vmm_broker_entry3);
}

/* One message of a v3 stream: its length (or -errno), the fds closed and counted in *n_fds. */
static ssize_t b3_recv(int s, vmm_broker_reply3 *m, uint32_t *n_fds, int timeout_ms)
{
    *n_fds = 0;
    memset(m, 0, sizeof *m);
    struct pollfd pf = {.fd = s, .events = POLLIN};
    if (poll(&pf, 1, timeout_ms) != 1) return -ETIMEDOUT;
    union {
        struct cmsghdr a;
        char b[CMSG_SPACE((VMM_BROKER_MAX_FDS + 4) * sizeof(int))];
    } ctl;
    struct iovec iov = {.iov_base = m, .iov_len = sizeof *m};
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctl.b;
    mh.msg_controllen = sizeof ctl.b;
    ssize_t n = recvmsg(s, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0) return -errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
                int f;
                memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof f);
                close(f);
                (*n_fds)++;
            }
    return n;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d) return -1;
    while (readdir(d)) n++;
    closedir(d);
    return n - 3; /* ".", ".." and the directory's own fd */
}

/* Entries of the last b3_stream named as repeats (VMM_BROKER_FD3_REPEAT: no fd came with them). */
static uint32_t g_b3_repeats;

/* A whole stream: the fds of each entry in order (*fds_total), checked against the export's
 * rules; the last message's status and entry.  *msgs: messages read. */
static int b3_stream(int s, uint32_t n, const uint64_t *slot, const uint32_t *first, uint32_t *msgs,
                     uint32_t *fds_total, uint32_t *failed_entry, int *bad)
{
    uint32_t at = 0, next = first ? first[0] : 0;
    *msgs = *fds_total = *failed_entry = g_b3_repeats = 0;
    *bad = 0;
    for (;;) {
        vmm_broker_reply3 m;
        uint32_t got, repeats = 0;
        ssize_t len = b3_recv(s, &m, &got, 5000);
        for (uint32_t i = 0; len == (ssize_t)sizeof m && i < m.n_here && i < VMM_BROKER_MAX_FDS; i++)
            repeats += (m.fds[i].device & VMM_BROKER_FD3_REPEAT) != 0;
        if (len != (ssize_t)sizeof m || m.magic != VMM_BROKER_MAGIC || m.version != VMM_BROKER_VERSION3 ||
            m.seq != *msgs || got != m.n_here - repeats) {
            *bad = 1;
            return len < 0 ? (int)len : -EPROTO;
        }
        (*msgs)++;
        for (uint32_t i = 0; i < m.n_here; i++) {
            const vmm_broker_fd3 *f = &m.fds[i];
            while (at < n && f->entry != at) { /* the next entry starts */
                at++;
                next = first && at < n ? first[at] : 0;
            }
            if (at >= n || f->handle != next || f->n_total != slot[at] || (f->device & ~VMM_BROKER_FD3_REPEAT) != 1 ||
                f->size != (2ull << 20) * (next + 1))
                *bad = 1;
            next++;
        }
        *fds_total += got;
        g_b3_repeats += repeats;
        if (m.flags & VMM_BROKER_REPLY_LAST) {
            *failed_entry = m.entry;
            return m.status;
        }
        if (m.status != 0) *bad = 1;
    }
}

static void batch_child(void *arg)
{
    const char *dir = arg;
    setenv("VMMSHIM_BROKER_DIR", dir, 1);
    g_b3_memfd = memfd_create("vmmshim-tb-batch", MFD_CLOEXEC);
    CHECK(g_b3_memfd >= 0 && ftruncate(g_b3_memfd, 2 << 20) == 0, "memfd: %s", strerror(errno));
    char path[112] = "";
    int rc = vmm__broker_start(batch_export, path, sizeof path);
    CHECK(rc == 0, "broker start: %d", rc);
    if (rc) return;
    static uint8_t req[sizeof(vmm_broker_request3) + 64 * sizeof(vmm_broker_entry3)];
    uint64_t slots[32];
    uint32_t msgs, total, failed;
    int bad;

    /* 1. 20 entries of 64 handles: 1280 fds in 20 messages, more than the peer's socket queues at
     * once, so the broker waits for room; meanwhile another peer is served at once */
    int base = count_fds();
    int s = raw_connect(path);
    CHECK(s >= 0, "connect: %d", s);
    for (int i = 0; i < 20; i++) slots[i] = 64;
    size_t len = b3_request(req, 20, slots, NULL, NULL, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    (void)poll(NULL, 0, 200); /* the broker fills this peer's queue and waits */
    int s2 = raw_connect(path);
    vmm_broker_request2 q2 = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION2, .slot = 3, .generation = 9,
                              .first = 1, .max = 64};
    long t0 = now_ms();
    CHECK(send(s2, &q2, sizeof q2, MSG_NOSIGNAL) == (ssize_t)sizeof q2, "send v2: %s", strerror(errno));
    struct pollfd pf = {.fd = s2, .events = POLLIN};
    CHECK(poll(&pf, 1, 2000) == 1 && now_ms() - t0 < 1000, "a v2 peer waited %ld ms behind a stalled batch",
          now_ms() - t0);
    vmm_broker_reply2 r2;
    ssize_t n2 = recv(s2, &r2, sizeof r2, 0); /* its fds: closed with the socket (no control buffer) */
    CHECK(n2 == (ssize_t)sizeof r2 && r2.status == 0 && r2.n_here == 2, "v2 beside a batch: %zd, status %d, %u fds",
          n2, (int)r2.status, r2.n_here);
    close(s2);
    rc = b3_stream(s, 20, slots, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == 0 && !bad && msgs == 20 && total == 1280, "20 x 64 handles: status %d, %u messages, %u fds%s", rc,
          msgs, total, bad ? ", out of order" : "");
    printf("stat: one v3 batch of 20 entries: %u fds in %u messages\n", total, msgs);
    fflush(stdout);

    /* 2. the same connection goes on: entries of 1, 3 (from handle 1, two of them) and 70 handles */
    uint64_t s_mix[3] = {1, 3, 70};
    uint32_t f_mix[3] = {0, 1, 0}, c_mix[3] = {0, 2, 0};
    len = b3_request(req, 3, s_mix, f_mix, c_mix, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 3, s_mix, f_mix, &msgs, &total, &failed, &bad);
    CHECK(rc == 0 && !bad && msgs == 2 && total == 73, "1 + 2 + 70 handles: status %d, %u messages, %u fds", rc,
          msgs, total);

    /* 3. a stale entry ends the batch: entry 0's first 64 fds came, the rest of its message not */
    uint64_t s_stale[3] = {100, 7, 2};
    len = b3_request(req, 3, s_stale, NULL, NULL, 0);
    ((vmm_broker_entry3 *)(req + sizeof(vmm_broker_request3)))[1].generation = 1;
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 3, s_stale, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == -ESTALE && failed == 1 && msgs == 2 && total == 64 && !bad,
          "a stale entry: status %d, entry %u, %u messages, %u fds", rc, failed, msgs, total);

    /* 4. a count past the allocation's end (-ERANGE), n_entries 0 and flags (-EINVAL) */
    uint64_t s_r[1] = {10};
    uint32_t f_r[1] = {8}, c_r[1] = {5};
    len = b3_request(req, 1, s_r, f_r, c_r, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 1, s_r, f_r, &msgs, &total, &failed, &bad);
    CHECK(rc == -ERANGE && failed == 0 && total == 0, "count past the end: status %d, %u fds", rc, total);
    len = b3_request(req, 0, NULL, NULL, NULL, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 0, NULL, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == -EINVAL && msgs == 1 && total == 0, "no entries: status %d", rc);
    len = b3_request(req, 1, s_r, NULL, NULL, 4);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 1, s_r, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == -EINVAL && total == 0 && failed == 1, "flags: status %d, entry %u", rc, failed);
    /* a flag this broker knows beside one it does not: refused whole, as a broker older than
     * VMM_BROKER_REQ3_REPEATS refuses that one (the peer then asks without it) */
    len = b3_request(req, 1, s_r, NULL, NULL, VMM_BROKER_REQ3_REPEATS | 2);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 1, s_r, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == -EINVAL && total == 0 && failed == 1, "an unknown flag beside REPEATS: status %d", rc);

    /* 4b. VMM_BROKER_REQ3_REPEATS: each handle's fd once a batch.  Slot 3 from handle 0, slot 3
     * from handle 1 (both repeats), slot 70, slot 70 again (70 repeats, across a message
     * boundary): 73 fds in 3 messages of 145 entries; the same batch without the flag: 145 fds */
    uint64_t s_rep[4] = {3, 3, 70, 70};
    uint32_t f_rep[4] = {0, 1, 0, 0};
    len = b3_request(req, 4, s_rep, f_rep, NULL, VMM_BROKER_REQ3_REPEATS);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 4, s_rep, f_rep, &msgs, &total, &failed, &bad);
    CHECK(rc == 0 && !bad && msgs == 3 && total == 73 && g_b3_repeats == 72,
          "repeats: status %d, %u messages, %u fds, %u repeats (want 3, 73, 72)%s", rc, msgs, total, g_b3_repeats,
          bad ? ", out of order" : "");
    len = b3_request(req, 4, s_rep, f_rep, NULL, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 4, s_rep, f_rep, &msgs, &total, &failed, &bad);
    CHECK(rc == 0 && !bad && msgs == 3 && total == 145 && g_b3_repeats == 0,
          "without the flag: status %d, %u messages, %u fds, %u repeats", rc, msgs, total, g_b3_repeats);
    /* repeats, then a stale entry: the batch ends there, the repeats' handles came once */
    uint64_t s_rs[3] = {3, 3, 7};
    len = b3_request(req, 3, s_rs, NULL, NULL, VMM_BROKER_REQ3_REPEATS);
    ((vmm_broker_entry3 *)(req + sizeof(vmm_broker_request3)))[2].generation = 1;
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    rc = b3_stream(s, 3, s_rs, NULL, &msgs, &total, &failed, &bad);
    CHECK(rc == -ESTALE && failed == 2 && msgs == 1 && total == 0 && !bad,
          "repeats, then a stale entry: status %d, entry %u, %u fds", rc, failed, total);
    /* still a working connection: a v1 request of a one-handle allocation */
    vmm_broker_request q1 = {.magic = VMM_BROKER_MAGIC, .version = VMM_BROKER_VERSION, .slot = 1, .generation = 3};
    vmm_broker_reply r1;
    int fd = -1;
    rc = raw_exchange(s, &q1, sizeof q1, &r1, &fd);
    CHECK(rc == 0 && r1.status == 0 && fd >= 0 && r1.mapped_size == 2 << 20, "v1 after batches: %d %d", rc,
          (int)r1.status);
    if (fd >= 0) close(fd);
    /* a length that disagrees with n_entries: -EPROTO in the v1 form, and the connection ends */
    uint64_t s_two[2] = {10, 10};
    len = b3_request(req, 2, s_two, NULL, NULL, 0);
    rc = raw_exchange(s, req, len - 1, &r1, &fd);
    CHECK(rc == 0 && r1.status == -EPROTO && fd < 0, "a short batch: %d %d", rc, (int)r1.status);
    vmm_broker_reply3 m;
    uint32_t got;
    CHECK(b3_recv(s, &m, &got, 2000) == 0, "the connection stays open after a malformed batch");
    close(s);

    /* 5. a peer that leaves mid-stream: the broker drops what it held, and serves on */
    s = raw_connect(path);
    for (int i = 0; i < 32; i++) slots[i] = 64;
    len = b3_request(req, 32, slots, NULL, NULL, 0);
    CHECK(send(s, req, len, MSG_NOSIGNAL) == (ssize_t)len, "send: %s", strerror(errno));
    CHECK(b3_recv(s, &m, &got, 2000) == (ssize_t)sizeof m && got == 64, "the first message of a long stream");
    (void)poll(NULL, 0, 100);
    close(s);
    int left = -1;
    for (int i = 0; i < 100 && (left = count_fds()) != base; i++) (void)poll(NULL, 0, 20);
    CHECK(left == base, "%d fds open after a peer left mid-stream (%d before)", left, base);
    s = raw_connect(path);
    rc = raw_exchange(s, &q1, sizeof q1, &r1, &fd);
    CHECK(rc == 0 && r1.status == 0 && fd >= 0, "served after a peer left mid-stream: %d %d", rc, (int)r1.status);
    if (fd >= 0) close(fd);
    close(s);
}

static void case_batches(void)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s-batch", g_base);
    in_child("v3 batches", batch_child, dir);
    remove_tree(dir);
}

static void case_dir_rules(void)
{
    char log[200];
    snprintf(log, sizeof log, "%s-dirs.log", g_base);
    static const dir_case cases[] = {
        {"symlink", DC_SYMLINK, NULL},       {"ww", DC_WORLD_WRITABLE_THEN_FIXED, NULL},
        {"gw", DC_GROUP_WRITABLE, NULL},     {"other", DC_OTHER_OWNER, NULL},
        {"umask", DC_UMASK, NULL},           {"xdg", DC_XDG, NULL},
        {"badgroup", DC_BAD_GROUP, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].kind == DC_OTHER_OWNER && !g_root) continue;
        dir_case dc = cases[i];
        dc.log = log;
        in_child(dc.name, dir_case_child, &dc);
        char dir[256];
        snprintf(dir, sizeof dir, "%s-%s", g_base, dc.name);
        remove_tree(dir);
    }
    unlink(log);
}

static void make_request(vmm_broker_request *req, const owner_info *in)
{
    memset(req, 0, sizeof *req);
    req->magic = VMM_BROKER_MAGIC;
    req->version = VMM_BROKER_VERSION;
    req->slot = in->slot;
    req->generation = in->generation;
    memcpy(req->alloc_id, in->id, 16);
}

static const char *hex(uint64_t v, char *buf)
{
    sprintf(buf, "0x%llx", (unsigned long long)v);
    return buf;
}

static void case_broker_basic(void)
{
    char dir[200], want[300], pid[16], addr[32], out[1024];
    struct stat st;
    snprintf(dir, sizeof dir, "%s-basic", g_base);
    owner_cfg cfg = {.reg_name = g_reg, .broker_dir = dir, .kinds = VMM_HANDLE_BROKER, .seed = 11};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address + 3 * 4096 + 5, addr); /* an interior address */

    /* where and how the socket lives */
    snprintf(want, sizeof want, "%s/%d.sock", dir, o.info.pid);
    CHECK(!strcmp(o.info.sock, want), "socket path %s, expected %s", o.info.sock, want);
    CHECK(mode_of(dir, &st) == 0700 && S_ISDIR(st.st_mode) && st.st_uid == geteuid(), "broker dir mode %o",
          mode_of(dir, &st));
    CHECK(mode_of(o.info.sock, &st) == 0600 && S_ISSOCK(st.st_mode) && st.st_uid == geteuid(), "socket mode %o",
          mode_of(o.info.sock, &st));
    uint8_t ok = 0;
    CHECK(owner_cmd(&o, 'S', 0, &ok, 1) && ok == 1, "the broker thread does not block every signal");

    /* the registry names the broker */
    vmm_registry *reg = NULL;
    vmm_proc_info proc;
    CHECK_EQ(vmm_open(g_reg, &reg), VMM_OK);
    if (reg) {
        CHECK_EQ(vmm_find_proc(reg, (uint32_t)o.info.pid, &proc), VMM_OK);
        CHECK(!strcmp(proc.broker_path, o.info.sock), "registry broker_path '%s'", proc.broker_path);
    }

    /* a companion imports, reads, writes; the owner sees the write */
    const char *imp1[] = {"import", g_reg, pid, addr, "11", "22", NULL};
    COMPANION(imp1, NULL, 0, out);
    CHECK(!strncmp(out, "status 0", 8), "companion said: %s", out);
    CHECK(owner_verify(&o, 22), "the owner does not see the companion's write");

    /* just the fd: a companion, and this process too */
    const char *fd1[] = {"fd", g_reg, pid, addr, NULL};
    COMPANION(fd1, NULL, 0, out);
    if (reg) {
        vmm_alloc_info a;
        int fd = -1;
        CHECK_EQ(vmm_find(reg, (uint32_t)o.info.pid, o.info.address + ALLOC_SIZE - 1, &a), VMM_OK);
        CHECK_EQ(vmm_import_fd(reg, &a, &fd), VMM_OK);
        CHECK(fd >= 0 && (fcntl(fd, F_GETFD) & FD_CLOEXEC), "fd %d without close-on-exec", fd);
        if (fd >= 0) {
            /* the emulated driver's fd is the memory itself */
            uint8_t *m = mmap(NULL, ALLOC_SIZE, PROT_READ, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                CHECK(m[0] == pattern(22, 0) && m[REQ_SIZE - 1] == pattern(22, REQ_SIZE - 1), "fd maps other bytes");
                munmap(m, ALLOC_SIZE);
            }
            close(fd);
        }
        /* argument checks */
        CHECK_EQ(vmm_import_fd(reg, NULL, &fd), VMM_ERR_INVALID);
        vmm_imported *imp = (vmm_imported *)&a;
        CHECK_EQ(vmm_import(reg, NULL, &imp), VMM_ERR_INVALID);
        CHECK(imp == NULL, "*out not cleared on failure");
        CHECK_EQ(vmm_import_release(NULL), VMM_OK);
        CHECK_EQ(vmm_import_ptr(NULL), 0);
        vmm_alloc_info none = a;
        none.handle_kinds = 0;
        CHECK_EQ(vmm_import_fd(reg, &none, &fd), VMM_ERR_INVALID);
        CHECK(strstr(vmm_last_error(), "not exportable") != NULL, "message: %s", vmm_last_error());
    }

    /* protocol errors: wrong magic, short request, wrong slot */
    vmm_broker_request req;
    vmm_broker_reply rep;
    int fd = -1;
    make_request(&req, &o.info);
    req.magic ^= 1;
    CHECK_EQ(raw_request(o.info.sock, &req, sizeof req, &rep, &fd), 0);
    CHECK(rep.magic == VMM_BROKER_MAGIC && rep.status == -EPROTO && fd < 0, "bad magic: status %d fd %d", rep.status,
          fd);
    make_request(&req, &o.info);
    CHECK_EQ(raw_request(o.info.sock, &req, 20, &rep, &fd), 0);
    CHECK(rep.status == -EPROTO && fd < 0, "short request: status %d fd %d", rep.status, fd);
    make_request(&req, &o.info);
    req.version = 99;
    CHECK_EQ(raw_request(o.info.sock, &req, sizeof req, &rep, &fd), 0);
    CHECK(rep.status == -EPROTO && fd < 0, "unknown version: status %d fd %d", rep.status, fd);
    make_request(&req, &o.info);
    req.slot ^= 1;
    CHECK_EQ(raw_request(o.info.sock, &req, sizeof req, &rep, &fd), 0);
    CHECK(rep.status == -ENOENT && fd < 0, "wrong slot: status %d fd %d", rep.status, fd);

    /* a peer that connects and says nothing cannot stall the broker for long */
    int silent = raw_connect(o.info.sock);
    CHECK(silent >= 0, "connect: %s", strerror(-silent));
    long t0 = now_ms();
    make_request(&req, &o.info);
    CHECK_EQ(raw_request(o.info.sock, &req, sizeof req, &rep, &fd), 0);
    long waited = now_ms() - t0;
    CHECK(rep.status == 0 && rep.mapped_size == ALLOC_SIZE && fd >= 0, "after a silent peer: status %d fd %d",
          rep.status, fd);
    CHECK(waited < 3000, "a silent peer stalled the broker for %ld ms", waited);
    if (fd >= 0) close(fd);
    if (silent >= 0) close(silent);

    /* one connection carries many requests, a refused one included */
    int conn = raw_connect(o.info.sock);
    CHECK(conn >= 0, "connect: %s", strerror(-conn));
    for (int i = 0; conn >= 0 && i < 3; i++) {
        make_request(&req, &o.info);
        CHECK_EQ(raw_exchange(conn, &req, sizeof req, &rep, &fd), 0);
        CHECK(rep.status == 0 && fd >= 0, "request %d on one connection: status %d fd %d", i, rep.status, fd);
        if (fd >= 0) close(fd);
        req.slot ^= 1;
        CHECK_EQ(raw_exchange(conn, &req, sizeof req, &rep, &fd), 0);
        CHECK(rep.status == -ENOENT && fd < 0, "wrong slot on one connection: status %d fd %d", rep.status, fd);
    }
    /* past 64 open connections, the one idle the longest (conn) is closed to make room; the broker
     * counts idleness in milliseconds, so conn must be older than the newcomers by more than a tie */
    usleep(20000);
    int many[BROKER_MAX_CONNS + 1];
    for (int i = 0; i <= BROKER_MAX_CONNS; i++) {
        many[i] = raw_connect(o.info.sock);
        make_request(&req, &o.info);
        fd = -1;
        if (many[i] >= 0 && raw_exchange(many[i], &req, sizeof req, &rep, &fd) == 0 && fd >= 0) close(fd);
    }
    CHECK(rep.status == 0, "the newest of %d connections: status %d", BROKER_MAX_CONNS + 1, rep.status);
    make_request(&req, &o.info);
    int evicted = conn >= 0 ? raw_exchange(conn, &req, sizeof req, &rep, &fd) : 0;
    CHECK(evicted == -ECONNRESET || evicted == -EPIPE, "the longest idle connection was not closed: %d", evicted);
    for (int i = 0; i <= BROKER_MAX_CONNS; i++)
        if (many[i] >= 0) close(many[i]);
    if (conn >= 0) close(conn);

    /* stale generation: the owner frees and reallocates; the old generation is refused */
    owner_info old = o.info, cur;
    CHECK(owner_cmd(&o, 'R', 0, &cur, sizeof cur) && cur.rc == 0, "republish failed");
    CHECK(cur.generation != old.generation, "generation did not move");
    char gen[32], msg[64];
    snprintf(gen, sizeof gen, "%llu", (unsigned long long)old.generation);
    const char *stale[] = {"try", g_reg, pid, addr, gen, NULL};
    COMPANION(stale, NULL, VMM_ERR_STALE, out);
    snprintf(msg, sizeof msg, "generation %s is gone", gen);
    CHECK(strstr(out, msg) != NULL, "stale message: %s", out);
    const char *imp2[] = {"import", g_reg, pid, addr, "22", "33", NULL};
    COMPANION(imp2, NULL, 0, out);
    CHECK(owner_verify(&o, 33), "second import's write not seen");

    /* after fork, the child runs its own broker and leaves the parent's alone */
    int bits = -1;
    CHECK(owner_cmd(&o, 'F', 0, &bits, sizeof bits) && bits == 0, "fork check failed: bits 0x%x", bits);

    /* a normal exit is not held up by the broker thread, and removes the socket */
    t0 = now_ms();
    int wst = owner_quit(&o);
    CHECK(wst == 0, "owner exit status %d", wst);
    CHECK(now_ms() - t0 < 3000, "exit took %ld ms", now_ms() - t0);
    CHECK(lstat(want, &st) != 0 && errno == ENOENT, "the socket outlived a normal exit");
    vmm_close(reg);
    remove_tree(dir);
}

static void case_owner_dead(void)
{
    char dir[200], pid[16], addr[32], out[1024], p1[300], p2[300], p3[300];
    struct stat st;
    snprintf(dir, sizeof dir, "%s-dead", g_base);
    owner_cfg cfg = {.reg_name = g_reg, .broker_dir = dir, .kinds = VMM_HANDLE_BROKER, .seed = 5};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address, addr);
    owner_kill(&o);
    CHECK(lstat(o.info.sock, &st) == 0, "SIGKILL cannot have removed the socket");
    const char *try1[] = {"try", g_reg, pid, addr, NULL};
    COMPANION(try1, NULL, VMM_ERR_OWNER_DEAD, out);
    CHECK(strstr(out, "exited") != NULL, "owner-dead message: %s", out);

    /* the next broker in that directory removes the dead one's socket, and nothing else:
     * not a live pid's, not a dead pid's that still has a listener (another pid namespace) */
    snprintf(p1, sizeof p1, "%s/%d.sock", dir, (int)getpid());
    pid_t gone = fork();
    if (gone == 0) _exit(0);
    waitpid(gone, NULL, 0);
    snprintf(p2, sizeof p2, "%s/%d.sock", dir, (int)gone);
    int l1 = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0), l2 = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    CHECK(snprintf(sa.sun_path, sizeof sa.sun_path, "%s", p1) < (int)sizeof sa.sun_path, "path %s", p1);
    CHECK(bind(l1, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(l1, 1) == 0, "bind %s", p1);
    CHECK(snprintf(sa.sun_path, sizeof sa.sun_path, "%s", p2) < (int)sizeof sa.sun_path, "path %s", p2);
    CHECK(bind(l2, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(l2, 1) == 0, "bind %s", p2);
    owner o2;
    if (owner_start(&cfg, &o2)) {
        if (o2.info.pid != o.info.pid)
            CHECK(lstat(o.info.sock, &st) != 0, "the dead owner's socket %s was not removed", o.info.sock);
        CHECK(lstat(p1, &st) == 0, "a live pid's socket was removed");
        CHECK(lstat(p2, &st) == 0, "a socket with a listener was removed");
        snprintf(p3, sizeof p3, "%s/%d.sock", dir, o2.info.pid);
        CHECK(lstat(p3, &st) == 0 && S_ISSOCK(st.st_mode), "the new broker's socket is missing");
        owner_quit(&o2);
    }
    close(l1);
    close(l2);
    remove_tree(dir);
}

static void case_hold_after_kill(void)
{
    char dir[200], pid[16], addr[32], line[256];
    snprintf(dir, sizeof dir, "%s-hold", g_base);
    owner_cfg cfg = {.reg_name = g_reg, .broker_dir = dir, .kinds = VMM_HANDLE_BROKER, .seed = 44};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address + 12345, addr);
    const char *args[] = {"hold", g_reg, pid, addr, "44", "55", NULL};
    int in_w = -1, out_r = -1;
    pid_t c = companion_spawn(args, NULL, NULL, &in_w, &out_r);
    CHECK(c > 0, "spawn");
    if (c <= 0) {
        owner_kill(&o);
        return;
    }
    /* "status 0\nready\n" */
    size_t got = 0;
    long end = now_ms() + 30000;
    line[0] = 0;
    while (!strstr(line, "ready\n") && got < sizeof line - 1 && now_ms() < end) {
        size_t n = read_full(out_r, line + got, 1, (int)(end - now_ms()));
        if (n != 1) break;
        got++;
        line[got] = 0;
    }
    CHECK(strstr(line, "ready\n") != NULL, "companion never became ready: %s", line);
    owner_kill(&o); /* the companion's mapping keeps the memory */
    (void)write_full(in_w, "x", 1);
    close(in_w);
    int st = wait_child(c, 30000);
    CHECK(st == 0, "holding companion: wait status 0x%x (exit %d)", st, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    close(out_r);
    remove_tree(dir);
}

static void case_pidfd(void)
{
    char pid[16], addr[32], out[1024];
    owner_cfg cfg = {.reg_name = g_reg, .kinds = VMM_HANDLE_PIDFD, .seed = 66};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address + 777, addr);
    CHECK(o.info.exported_fd >= 1024, "exported fd %d", o.info.exported_fd);
    CHECK(o.info.sock[0] == 0, "no broker in pidfd mode");
    const char *imp[] = {"import", g_reg, pid, addr, "66", "77", NULL};
    int rc = companion_run(imp, NULL, NULL, out, sizeof out);
    if (rc == VMM_ERR_ACCESS && strstr(out, "ptrace")) {
        printf("skip: pidfd_getfd denied here (ptrace restrictions): %s", out);
    } else {
        CHECK_EQ(rc, 0);
        CHECK(owner_verify(&o, 77), "the owner does not see the pidfd companion's write");
        /* the fd number stays open after a re-publish, but the record tells the old one is gone */
        owner_info cur;
        CHECK(owner_cmd(&o, 'R', 0, &cur, sizeof cur) && cur.rc == 0, "republish failed");
        char gen[32];
        snprintf(gen, sizeof gen, "%llu", (unsigned long long)o.info.generation);
        const char *stale[] = {"try", g_reg, pid, addr, gen, NULL};
        COMPANION(stale, NULL, VMM_ERR_STALE, out);
        const char *fdm[] = {"fd", g_reg, pid, addr, NULL};
        COMPANION(fdm, NULL, 0, out);
    }
    owner_kill(&o);
    const char *dead[] = {"try", g_reg, pid, addr, NULL};
    COMPANION(dead, NULL, VMM_ERR_OWNER_DEAD, out);
}

/* A counter from a FAKECUDA_COUNTERS_AT_EXIT file; -1 when absent. */
static long long counter(const char *path, const char *name)
{
    char buf[4096], key[80];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    snprintf(key, sizeof key, "\n%s=", name);
    memmove(buf + 1, buf, (size_t)n + 1); /* so the first line matches "\n<name>=" too */
    buf[0] = '\n';
    const char *p = strstr(buf, key);
    return p ? strtoll(p + strlen(key), NULL, 10) : -1;
}

/* The companion's driver state at its exit: everything imported was undone. */
static void check_driver_clean(const char *path, const char *what)
{
    static const char *const live[] = {"handles_live", "mappings_live", "reservations_live", "imports_live"};
    for (size_t i = 0; i < sizeof live / sizeof live[0]; i++)
        CHECK(counter(path, live[i]) == 0, "%s: %s=%lld at the companion's exit", what, live[i],
              counter(path, live[i]));
    unlink(path);
}

/* Driver failures: each is VMM_ERR_CUDA naming the call, and the partial work is undone. */
static void case_cuda_failures(void)
{
    char dir[200], pid[16], addr[32], out[1024], cnt[260], cntenv[300];
    snprintf(dir, sizeof dir, "%s-cuda", g_base);
    snprintf(cnt, sizeof cnt, "%s-counters.txt", g_base);
    snprintf(cntenv, sizeof cntenv, "FAKECUDA_COUNTERS_AT_EXIT=%s", cnt);
    owner_cfg cfg = {.reg_name = g_reg, .broker_dir = dir, .kinds = VMM_HANDLE_BROKER, .seed = 3};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address, addr);
    const char *try1[] = {"try", g_reg, pid, addr, NULL};
    static const char *const calls[] = {"cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
                                        "cuMemSetAccess"};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        char fail[96], want[96];
        snprintf(fail, sizeof fail, "FAKECUDA_FAIL=%s:1", calls[i]);
        const char *env[] = {fail, cntenv, NULL};
        COMPANION_ENV(try1, NULL, env, VMM_ERR_CUDA, out);
        snprintf(want, sizeof want, "%s failed: CUDA_ERROR_UNKNOWN (999)", calls[i]);
        CHECK(strstr(out, want) != NULL, "message: %s", out);
        check_driver_clean(cnt, calls[i]);
    }
    /* and a successful import, released, leaves nothing behind either */
    const char *env[] = {cntenv, NULL};
    const char *imp[] = {"import", g_reg, pid, addr, "3", "4", NULL};
    COMPANION_ENV(imp, NULL, env, 0, out);
    check_driver_clean(cnt, "import and release");
    CHECK(owner_verify(&o, 4), "write not seen");
    /* no driver at all */
    const char *nolib[] = {"LD_LIBRARY_PATH=", "LD_PRELOAD=", NULL};
    int rc = companion_run(try1, NULL, nolib, out, sizeof out);
    if (strstr(out, "libcuda.so.1 not found: "))
        CHECK_EQ(rc, VMM_ERR_CUDA);
    else
        printf("skip: a system libcuda.so.1 is installed (%s)\n", out);
    owner_quit(&o);
    remove_tree(dir);
}

typedef struct raw_case {
    owner_info info;
    creds cr;
    int32_t want_status;
    bool want_fd;
} raw_case;

static void raw_as_child(void *arg)
{
    raw_case *rc = arg;
    if (setgroups((size_t)rc->cr.ngroups, rc->cr.groups) != 0 || setresgid(rc->cr.gid, rc->cr.gid, rc->cr.gid) != 0 ||
        setresuid(rc->cr.uid, rc->cr.uid, rc->cr.uid) != 0) {
        CHECK(0, "dropping to uid %u: %s", (unsigned)rc->cr.uid, strerror(errno));
        return;
    }
    CHECK_EQ(geteuid(), rc->cr.uid);
    vmm_broker_request req;
    vmm_broker_reply rep;
    int fd = -1;
    make_request(&req, &rc->info);
    int r = raw_request(rc->info.sock, &req, sizeof req, &rep, &fd);
    CHECK(r == 0, "uid %u: request: %s", (unsigned)rc->cr.uid, strerror(-r));
    CHECK(rep.status == rc->want_status, "uid %u: status %d, expected %d", (unsigned)rc->cr.uid, rep.status,
          rc->want_status);
    CHECK((fd >= 0) == rc->want_fd, "uid %u: fd %d", (unsigned)rc->cr.uid, fd);
    if (fd >= 0) close(fd);
}

static void case_refused_uid(void)
{
    char dir[200], log[220];
    snprintf(dir, sizeof dir, "%s-refuse", g_base);
    snprintf(log, sizeof log, "%s-refuse.log", g_base);
    owner_cfg cfg = {.reg_name = g_reg, .broker_dir = dir, .kinds = VMM_HANDLE_BROKER, .seed = 9, .log_path = log};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    /* Open the filesystem wide, as a careless admin might: the broker's own check must hold. */
    chmod(dir, 0711);
    chmod(o.info.sock, 0666);
    raw_case rc = {.info = o.info, .cr = {.uid = OTHER_UID, .gid = OTHER_GID}, .want_status = -EACCES};
    in_child("refused uid", raw_as_child, &rc);
    CHECK(file_contains(log, "vmmshim: warning: broker: refused uid 54321 (pid "), "no refusal warning in the log");
    /* root is not special: only the owner's own uid */
    if (geteuid() == 0) {
        raw_case same = {.info = o.info, .cr = {.uid = 0, .gid = 0}, .want_status = 0, .want_fd = true};
        in_child("same uid", raw_as_child, &same);
    }
    owner_quit(&o);
    unlink(log);
    remove_tree(dir);
}

static void case_group(void)
{
    char dir[200], log[220], pid[16], addr[32], out[1024], grp[16];
    struct stat st;
    snprintf(dir, sizeof dir, "%s-group", g_base);
    snprintf(log, sizeof log, "%s-group.log", g_base);
    snprintf(grp, sizeof grp, "%d", SHARE_GID);
    owner_cfg cfg = {.reg_name = g_reg_group, .reg_group = grp, .broker_dir = dir, .broker_group = grp,
                     .kinds = VMM_HANDLE_BROKER, .seed = 88, .log_path = log};
    owner o;
    if (!owner_start(&cfg, &o)) return;
    CHECK(mode_of(dir, &st) == 0750 && st.st_gid == SHARE_GID, "group broker dir: mode %o gid %u", mode_of(dir, &st),
          (unsigned)st.st_gid);
    CHECK(mode_of(o.info.sock, &st) == 0660 && st.st_gid == SHARE_GID, "group socket: mode %o gid %u",
          mode_of(o.info.sock, &st), (unsigned)st.st_gid);
    snprintf(pid, sizeof pid, "%d", o.info.pid);
    hex(o.info.address + 99, addr);
    /* another uid, in the group through its supplementary groups: a full import */
    creds member = {.uid = OTHER_UID, .gid = OTHER_GID, .ngroups = 1, .groups = {SHARE_GID}};
    const char *imp[] = {"import", g_reg_group, pid, addr, "88", "99", NULL};
    COMPANION(imp, &member, 0, out);
    CHECK(owner_verify(&o, 99), "the owner does not see the group member's write");
    /* in the group as its primary gid */
    raw_case prim = {.info = o.info, .cr = {.uid = THIRD_UID, .gid = SHARE_GID}, .want_status = 0, .want_fd = true};
    in_child("primary group", raw_as_child, &prim);
    CHECK(!file_contains(log, "refused"), "a group member was refused");
    /* a uid outside the group cannot even reach the socket, and is told so */
    creds outsider = {.uid = THIRD_UID, .gid = THIRD_UID};
    const char *fdm[] = {"fd", g_reg_group, pid, addr, NULL};
    int rc = companion_run(fdm, &outsider, NULL, out, sizeof out);
    CHECK(rc == 40 + VMM_ERR_ACCESS || rc == VMM_ERR_ACCESS, "outsider: exit %d: %s", rc, out);
    owner_quit(&o);
    unlink(log);
    remove_tree(dir);
}

int main(void)
{
    const char *build = getenv("VMMSHIM_TEST_BUILD");
    if (!build || !*build) build = "build";
    snprintf(g_companion, sizeof g_companion, "%s/tests/prog_broker_companion", build);
    if (g_companion[0] != '/') {
        /* the companion runs as other users too: give it an absolute path */
        char cwd[400];
        if (getcwd(cwd, sizeof cwd)) {
            char tmp[600];
            if (snprintf(tmp, sizeof tmp, "%s/%s", cwd, g_companion) < (int)sizeof tmp)
                memcpy(g_companion, tmp, sizeof g_companion);
        }
    }
    g_root = geteuid() == 0;
    snprintf(g_base, sizeof g_base, "/tmp/vmmshim-tb-%d", (int)getpid());
    snprintf(g_reg, sizeof g_reg, "/vmmshim-tb-%d", (int)getpid());
    snprintf(g_reg_group, sizeof g_reg_group, "/vmmshim-tb-%d-g", (int)getpid());

    CHECK(access(g_companion, X_OK) == 0, "companion %s: %s", g_companion, strerror(errno));
    if (!load_driver()) {
        printf("skip: test_broker needs the emulated driver (build/fakecuda/libcuda.so.1 on LD_LIBRARY_PATH)\n");
        CHECK_DONE();
    }
    case_dir_rules();
    case_batches();
    case_broker_basic();
    case_owner_dead();
    case_hold_after_kill();
    case_pidfd();
    case_cuda_failures();
    if (g_root) {
        case_refused_uid();
        case_group();
    } else {
        printf("skip: second-uid cases need root\n");
    }
    shm_unlink(g_reg);
    shm_unlink(g_reg_group);
    CHECK_DONE();
}
