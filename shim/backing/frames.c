/* Call-site frames.  The unwinder gives return addresses, which the records carry; a person wants
 * `module+0xoffset (function)`, and wants it after the owner is gone too, when its address space
 * can no longer be asked.  So each address is resolved once per process, with dladdr, and
 * appended as one line to this process's frames file beside the registry (layout.h, FRAMES).
 * That is done outside every lock of the shim, since dladdr and the unwinder take the loader
 * lock, and without allocating: a fixed table remembers the addresses written, and lines are
 * formatted in one static buffer. */
#include "backing/frames.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/log.h"
#include "hooks/real.h"

#define SEEN_BITS 13
#define SEEN_SLOTS (1u << SEEN_BITS) /* past three quarters full, new addresses are left unwritten */
#define SHIM_FRAMES 8                /* room for the shim's own frames above the caller's */

static struct {
    int depth;                        /* frames asked for; 0: all of this is off */
    int (*backtrace)(void **, int);
    uintptr_t self_lo, self_hi;       /* the shim's own code: its frames are not the call site */
    uintptr_t main_base;              /* where dladdr says the program is mapped */
    char exe[PATH_MAX];               /* the program's path: dladdr names it by argv[0], maybe relative */
    char name[256];                   /* this process's frames file; "" when it has none */
    int fd;
    unsigned n_seen;
    uint64_t seen[SEEN_SLOTS];        /* addresses written (or being written); 0: empty */
    pthread_mutex_t line_lock;        /* line[] */
    char line[PATH_MAX + 640];
} F = {.fd = -1, .line_lock = PTHREAD_MUTEX_INITIALIZER};

/* libunwind exports _Unwind_* and a weak backtrace(): loaded globally it would take over the
 * host's C++ exception unwinding.  So it is opened privately, from beside the shim, and only
 * when call-site frames are asked for. */
static void load_unwinder(void)
{
    Dl_info self;
    char path[PATH_MAX];
    void *h = NULL;
    if (dladdr((void *)&F, &self) && self.dli_fname) {
        snprintf(path, sizeof path, "%s", self.dli_fname);
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s/libunwind.so.8", dirname(path));
        h = dlopen(dir, RTLD_NOW | RTLD_LOCAL);
    }
    if (!h) h = dlopen("libunwind.so.8", RTLD_NOW | RTLD_LOCAL);
    void *fn = h ? vmm__real_dlsym(h, "unw_backtrace") : NULL;
    memcpy(&F.backtrace, &fn, sizeof fn);
    if (!F.backtrace) vmm__log(VMM__LOG_WARNING, "VMMSHIM_FRAMES needs libunwind.so.8 beside the shim; frames are not recorded");
}

/* The shim's address range, and where the program is: the first object the loader lists. */
static int note_object(struct dl_phdr_info *info, size_t size, void *first)
{
    (void)size;
    uintptr_t lo = UINTPTR_MAX, hi = 0, here = (uintptr_t)&note_object;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        uintptr_t a = info->dlpi_addr + ph->p_vaddr;
        if (a < lo) lo = a;
        if (a + ph->p_memsz > hi) hi = a + ph->p_memsz;
    }
    if (*(bool *)first) F.main_base = lo & ~((uintptr_t)getpagesize() - 1);
    *(bool *)first = false;
    if (here >= lo && here < hi) F.self_lo = lo, F.self_hi = hi;
    return 0;
}

static void open_file(const vmm__reg *r)
{
    F.fd = -1;
    F.name[0] = 0;
    if (snprintf(F.name, sizeof F.name, VMM_REG_FRAMES_NAME, r->name, r->pid, (unsigned long long)r->start_time) >=
        (int)sizeof F.name) {
        F.name[0] = 0;
        return;
    }
    /* A file someone else made under this name is not written to (nor truncated). */
    int fd = shm_open(F.name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    struct stat st, reg;
    int err = fd < 0 ? errno : fstat(fd, &st) != 0 ? errno : 0;
    if (!err && (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0007))) err = EEXIST;
    if (!err && ftruncate(fd, 0) != 0) err = errno; /* an earlier image of this process (exec) left it */
    if (err) {
        char eb[128];
        vmm__log(VMM__LOG_WARNING, "VMMSHIM_FRAMES: cannot make %s (%s); call sites are named only while the process lives",
                 F.name, vmm__strerror(err, eb, sizeof eb));
        if (fd >= 0) close(fd);
        F.name[0] = 0;
        return;
    }
    /* whoever may read the records may read where they were made */
    if (fstat(r->fd, &reg) == 0 && (reg.st_mode & 0060) && fchown(fd, (uid_t)-1, reg.st_gid) == 0)
        (void)fchmod(fd, reg.st_mode & 0660);
    else
        (void)fchmod(fd, 0600);
    static const char header[] = VMM_REG_FRAMES_HEADER "\n";
    if (write(fd, header, sizeof header - 1) != (ssize_t)(sizeof header - 1)) {
        close(fd);
        shm_unlink(F.name);
        F.name[0] = 0;
        return;
    }
    F.fd = fd;
}

void vmm__frames_init(int depth, const vmm__reg *r)
{
    F.depth = depth < 0 ? 0 : depth > 8 ? 8 : depth;
    if (!F.depth) return;
    load_unwinder();
    if (!F.backtrace) return;
    bool first = true;
    dl_iterate_phdr(note_object, &first);
    ssize_t n = readlink("/proc/self/exe", F.exe, sizeof F.exe - 1);
    F.exe[n > 0 ? n : 0] = 0;
    open_file(r);
}

/* True for the one caller that puts pc into the table: it writes pc's line. */
static bool first_sight(uint64_t pc)
{
    uint64_t mask = SEEN_SLOTS - 1, i = (pc * 0x9e3779b97f4a7c15ull) >> (64 - SEEN_BITS);
    for (unsigned probe = 0; probe < SEEN_SLOTS; probe++, i = (i + 1) & mask) {
        uint64_t e = __atomic_load_n(&F.seen[i], __ATOMIC_RELAXED);
        if (e == pc) return false;
        if (e != 0) continue;
        if (__atomic_load_n(&F.n_seen, __ATOMIC_RELAXED) >= SEEN_SLOTS / 4 * 3) return false;
        if (__atomic_compare_exchange_n(&F.seen[i], &e, pc, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            __atomic_add_fetch(&F.n_seen, 1, __ATOMIC_RELAXED);
            return true;
        }
        if (e == pc) return false; /* another thread took the slot for the same address */
    }
    return false;
}

/* One line: "0x<address> 0x<offset in module> <function, or ?> <module path>". */
static void write_frame(uint64_t pc)
{
    Dl_info info;
    const ElfW(Sym) *sym = NULL;
    uintptr_t at = (uintptr_t)pc - 1; /* a return address may lie just past its function's end */
    if (!dladdr1((void *)at, &info, (void **)&sym, RTLD_DL_SYMENT) || !info.dli_fbase) return; /* no module: JIT code */
    uintptr_t base = (uintptr_t)info.dli_fbase;
    const char *path = base == F.main_base && F.exe[0] ? F.exe : info.dli_fname && info.dli_fname[0] ? info.dli_fname : "?";
    /* dladdr gives the nearest exported symbol below, which for a static function is another
     * function's: only a symbol whose extent covers the address names it */
    bool named = sym && info.dli_sname && info.dli_saddr && at - (uintptr_t)info.dli_saddr < sym->st_size;
    pthread_mutex_lock(&F.line_lock);
    int n = snprintf(F.line, sizeof F.line, "0x%llx 0x%llx ", (unsigned long long)pc, (unsigned long long)(pc - base));
    size_t len = (size_t)n;
    for (const char *s = named ? info.dli_sname : "?"; *s && len < 512; s++) /* one word, whatever it holds */
        F.line[len++] = *s == ' ' || *s == '\n' || *s == '\t' ? '?' : *s;
    F.line[len++] = ' ';
    for (const char *s = path; *s && len < sizeof F.line - 1; s++) F.line[len++] = *s == '\n' ? '?' : *s;
    F.line[len++] = '\n';
    for (const char *p = F.line; len;) {
        ssize_t w = write(F.fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        p += w, len -= (size_t)w;
    }
    pthread_mutex_unlock(&F.line_lock);
}

void vmm__frames_capture(vmm__frames *f)
{
    f->n = 0;
    if (!F.depth || !F.backtrace) return;
    int saved = errno; /* the hook's caller reads errno */
    void *pcs[8 + SHIM_FRAMES];
    int n = F.backtrace(pcs, F.depth + SHIM_FRAMES), i = 0;
    while (i < n && (uintptr_t)pcs[i] >= F.self_lo && (uintptr_t)pcs[i] < F.self_hi) i++;
    for (; i < n && f->n < (uint32_t)F.depth; i++) {
        uint64_t pc = (uint64_t)(uintptr_t)pcs[i];
        f->pc[f->n++] = pc;
        if (F.fd >= 0 && first_sight(pc)) write_frame(pc);
    }
    errno = saved;
}

void vmm__frames_after_fork(const vmm__reg *r)
{
    if (!F.depth || !F.backtrace) return;
    if (F.fd >= 0) close(F.fd); /* the child's copy; the parent writes on through its own */
    memset(F.seen, 0, sizeof F.seen);
    F.n_seen = 0;
    pthread_mutex_init(&F.line_lock, NULL);
    open_file(r);
}

void vmm__frames_exit(void)
{
    /* Unlinked, not closed: a thread still allocating writes on into the unlinked file rather
     * than into whatever the program opens under the same number next. */
    if (F.name[0]) shm_unlink(F.name);
    F.name[0] = 0;
}
