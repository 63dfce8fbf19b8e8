/* vmmctl dump PID [ADDR] -o PATH: an owner's device memory, copied to files.
 *
 * With ADDR, the allocation holding it goes to the file PATH (its requested size, from its
 * start).  Without, PATH becomes a directory: one file per live allocation of PID, and
 * manifest.json, written last, that lists each (dumped with its XXH3-64 checksum, or skipped or
 * failed with the reason), so a directory without one is an incomplete dump.
 *
 * Post-mortem: every allocation is imported before the first byte is copied.  An import keeps
 * the owner's memory alive after the owner exits, so once the imports are made, an owner that
 * is killed mid-dump changes nothing: the dump completes with the bytes the memory held.  The
 * bytes are read while the owner runs, so a buffer it writes meanwhile may be caught mid-change.
 *
 * Files are written through vmm_import_copy, whose pinned buffers let the device-to-host copy of
 * one piece overlap the write of the previous one.  The checksum is XXH3 (`xxhsum -H3 FILE`
 * checks a file), hashed by a second thread while the first writes the same piece: a byte-serial
 * hash such as FNV-1a runs at ~0.65 GB/s, a fifth of what a disk's page cache takes, and would
 * set the dump's pace. */
#include "format.h"
#include "vmmctl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* header-only: vmmctl needs no libxxhash at run time */
#include <xxhash.h>

/* ------------------------------------------------------------------------------------------ */
/* Progress                                                                                    */

/* A bar on stderr while it is a terminal (redrawn at most every 100 ms); nothing otherwise, so
 * logs and pipes get only the summary line. */
typedef struct progress {
    bool tty;
    uint64_t total, done;
    size_t files, files_done;
    double started, drawn;
} progress;

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double gb_per_s(uint64_t bytes, double seconds) { return seconds > 0 ? (double)bytes / seconds / 1e9 : 0; }

static void progress_draw(progress *p)
{
    double now = mono_s();
    if (!p->tty || now - p->drawn < 0.1) return;
    p->drawn = now;
    hbuf done, total;
    fprintf(stderr, "\r\033[Kdump: %s of %s (%.0f%%), %.2f GB/s, %zu of %zu allocation%s",
            vmm__ctl_human(p->done, &done), vmm__ctl_human(p->total, &total),
            p->total ? 100.0 * (double)p->done / (double)p->total : 100.0, gb_per_s(p->done, now - p->started),
            p->files_done, p->files, p->files == 1 ? "" : "s");
    fflush(stderr);
}

static void progress_clear(const progress *p)
{
    if (!p->tty) return;
    fputs("\r\033[K", stderr);
    fflush(stderr);
}

/* ------------------------------------------------------------------------------------------ */
/* Writing one allocation                                                                      */

typedef struct out_file {
    int fd;
    XXH3_state_t *checksum; /* NULL: none wanted */
    int err;                /* errno of the write that failed */
    progress *prog;
} out_file;

typedef struct piece_hash {
    XXH3_state_t *state;
    const void *data;
    size_t length;
} piece_hash;

static void *hash_piece(void *arg)
{
    piece_hash *h = arg;
    XXH3_64bits_update(h->state, h->data, h->length);
    return NULL;
}

/* Below this a thread costs more than the hash it takes off the writer. */
#define HASH_THREAD_MIN (1u << 20)

/* vmm_import_copy's sink: the whole piece goes to the file, whatever write() takes at a time,
 * while a second thread hashes the same (read-only) bytes. */
static int write_piece(void *ctx, const void *data, uint64_t length, uint64_t done)
{
    (void)done; /* the file is written in order */
    out_file *o = ctx;
    piece_hash job = {o->checksum, data, (size_t)length};
    pthread_t hasher;
    bool threaded = o->checksum && length >= HASH_THREAD_MIN && pthread_create(&hasher, NULL, hash_piece, &job) == 0;
    if (o->checksum && !threaded) hash_piece(&job);
    const char *p = data;
    while (length) {
        ssize_t n = write(o->fd, p, length < (uint64_t)SSIZE_MAX ? (size_t)length : (size_t)SSIZE_MAX);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            o->err = n < 0 ? errno : ENOSPC; /* a regular file that takes nothing is full */
            break;
        }
        p += n;
        length -= (uint64_t)n;
        o->prog->done += (uint64_t)n;
    }
    if (threaded) pthread_join(hasher, NULL); /* the piece's buffer is reused once we return */
    if (o->err) return 1;
    progress_draw(o->prog);
    return 0;
}

static int discard_piece(void *ctx, const void *data, uint64_t length, uint64_t done)
{
    (void)ctx, (void)data, (void)length, (void)done;
    return 0;
}

/* Page-locking the staging buffers is a one-time cost of the process (about 0.5 ms per MiB), as
 * allocating its pinned buffer is for any program measuring device-to-host bandwidth: a first
 * copy of up to 64 MiB (the copy's piece size is a quarter of it, at most 16 MiB) makes them
 * before the clock starts, and its time is reported on its own.  Seconds it took. */
static double stage_buffers(vmm_imported *imp)
{
    double t0 = mono_s();
    uint64_t size = vmm_import_size(imp);
    (void)vmm_import_copy(imp, 0, size < (64u << 20) ? size : 64u << 20, discard_piece, NULL);
    return mono_s() - t0;
}

/* Copy the import's bytes into fd.  EXIT_OK, or the error printed (naming `path`). */
static int write_import(vmm_imported *imp, int fd, const char *path, out_file *o)
{
    o->fd = fd;
    if (o->checksum) XXH3_64bits_reset(o->checksum);
    o->err = 0;
    vmm_status st = vmm_import_copy(imp, 0, vmm_import_size(imp), write_piece, o);
    if (st == VMM_OK && close(fd) != 0) o->err = errno; /* NFS and friends report here */
    else if (st != VMM_OK) close(fd);
    if (st == VMM_OK && !o->err) return EXIT_OK;
    progress_clear(o->prog);
    if (o->err) return vmm__ctl_error("writing %s: %s", path, strerror(o->err));
    return vmm__ctl_error("copying to %s: %s", path, vmm_last_error());
}

/* ------------------------------------------------------------------------------------------ */
/* The owner and what to dump                                                                  */

enum { TO_DUMP, DUMPED, SKIPPED, FAILED };

typedef struct target {
    vmm_alloc_info a;
    vmm_imported *imp;
    int state;
    char reason[320]; /* SKIPPED, FAILED */
    char file[32];    /* DUMPED */
    uint64_t xxh3;
} target;

typedef struct dump_job {
    uint32_t pid;
    vmm_proc_info proc;
    target *t;
    size_t n, cap;
    bool out_of_memory;
} dump_job;

/* The live owner, or the error printed: a dead one's memory can no longer be imported. */
static int find_owner(vmm_registry *reg, dump_job *j)
{
    vmm_status st = vmm_find_proc(reg, j->pid, &j->proc);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    if (j->proc.alive == VMM_OWNER_DEAD)
        return vmm__ctl_error("pid %u has exited: the memory of a dead process cannot be imported any more "
                              "(its records stay until `vmmctl gc`)",
                              j->pid);
    return EXIT_OK;
}

static int add_target(void *ctx, const vmm_alloc_info *a)
{
    dump_job *j = ctx;
    /* a pid's earlier process may have left records that gc has not reclaimed yet */
    if (a->pid != j->pid || a->owner_start_time != j->proc.start_time || a->owner_pidns != j->proc.pidns) return 0;
    if (j->n == j->cap) {
        size_t cap = j->cap ? 2 * j->cap : 64;
        target *t = realloc(j->t, cap * sizeof *t);
        if (!t) {
            j->out_of_memory = true;
            return 1;
        }
        j->t = t;
        j->cap = cap;
    }
    memset(&j->t[j->n], 0, sizeof j->t[j->n]);
    j->t[j->n++].a = *a;
    return 0;
}

static int by_address(const void *x, const void *y)
{
    const target *a = x, *b = y;
    return a->a.address < b->a.address ? -1 : a->a.address > b->a.address;
}

/* Import one target.  Not exportable and freed-since-listed are skipped (the caller decides
 * whether that fails the dump); anything else fails it. */
static void import_target(vmm_registry *reg, target *t)
{
    const vmm_alloc_info *a = &t->a;
    if (!(a->handle_kinds & (VMM_KIND_BROKER | VMM_KIND_PIDFD))) {
        t->state = SKIPPED;
        snprintf(t->reason, sizeof t->reason, "%s",
                 a->handle_kinds & VMM_KIND_FABRIC ? "not exportable as an fd (only a FABRIC handle)"
                 : a->api == VMM_FROM_CU_MEM_MAP
                     ? "not exportable (the driver refused an exportable handle type for this mapping)"
                     : "not exportable (made by the real allocator: the device was full, or its stream was "
                       "being captured)");
        return;
    }
    if (a->owner_alive == VMM_OWNER_DEAD) { /* of a kept process, but not held by its keeper */
        t->state = SKIPPED;
        snprintf(t->reason, sizeof t->reason, "its owner died before a keeper held it (vmmctl keep holds an "
                                              "allocation once it has lived for its settle time)");
        return;
    }
    vmm_status st = vmm_import(reg, a, &t->imp);
    if (st == VMM_OK) return;
    t->state = st == VMM_ERR_STALE ? SKIPPED : FAILED;
    if (st == VMM_ERR_STALE)
        snprintf(t->reason, sizeof t->reason, "freed before it could be imported (%s)", vmm_last_error());
    else
        snprintf(t->reason, sizeof t->reason, "%s", *vmm_last_error() ? vmm_last_error() : vmm_strerror(st));
}

/* ------------------------------------------------------------------------------------------ */
/* The manifest                                                                                */

static void iso_time(uint64_t ns, char *buf, size_t len)
{
    time_t secs = (time_t)(ns / 1000000000ull);
    struct tm tm;
    gmtime_r(&secs, &tm);
    strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

typedef struct dump_totals {
    uint64_t taken_ns, bytes;
    double seconds, stage_seconds;
    size_t dumped, skipped, failed;
} dump_totals;

/* One allocation per line, so that a reader with grep finds each whole. */
static void manifest_entry(FILE *f, const target *t, bool last)
{
    const vmm_alloc_info *a = &t->a;
    char id[33];
    vmm__ctl_hex(a->alloc_id, sizeof a->alloc_id, id);
    fprintf(f, "    {\"address\": %llu, \"address_hex\": \"0x%llx\", \"size\": %llu, \"api\": \"%s\", \"device\": %u, "
               "\"tag\": ",
            (unsigned long long)a->address, (unsigned long long)a->address, (unsigned long long)a->requested_size,
            vmm__ctl_api_name(a->api), a->device);
    vmm__ctl_json_str(f, a->tag);
    fprintf(f, ", \"id\": \"%s\", \"generation\": %llu, \"status\": \"%s\", ", id, (unsigned long long)a->generation,
            t->state == DUMPED ? "dumped" : t->state == SKIPPED ? "skipped" : "failed");
    if (t->state == DUMPED)
        fprintf(f, "\"file\": \"%s\", \"xxh3_64\": \"%016llx\", \"reason\": null}", t->file,
                (unsigned long long)t->xxh3);
    else {
        fputs("\"file\": null, \"xxh3_64\": null, \"reason\": ", f);
        vmm__ctl_json_str(f, t->reason);
        fputc('}', f);
    }
    fputs(last ? "\n" : ",\n", f);
}

/* A kept process (vmmctl keep): who keeps it, and how it ended. */
static void manifest_keeper(FILE *f, vmm_registry *reg, const dump_job *j)
{
    vmm_keeper_info k;
    if (vmm_keeper_of(reg, j->pid, &k) != VMM_OK) {
        fputs("  \"kept_by\": null,\n  \"owner_ended\": null,\n  \"owner_ended_at\": null,\n", f);
        return;
    }
    char how[80], when[32] = "";
    vmm__ctl_end_text(k.end_kind, k.end_value, how, sizeof how);
    fprintf(f, "  \"kept_by\": %u,\n  \"owner_ended\": ", k.keeper_pid);
    if (k.state == VMM_KEEPER_KEPT) vmm__ctl_json_str(f, how);
    else fputs("null", f);
    if (k.ended_ns) iso_time(k.ended_ns, when, sizeof when);
    fprintf(f, ",\n  \"owner_ended_at\": ");
    if (k.ended_ns) fprintf(f, "\"%s\"", when);
    else fputs("null", f);
    fputs(",\n", f);
}

static int write_manifest(vmm_registry *reg, int dir, const char *path, const dump_job *j, const dump_totals *tot,
                          bool owner_alive)
{
    char when[32];
    iso_time(tot->taken_ns, when, sizeof when);
    int fd = openat(dir, "manifest.json", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        int e = errno;
        if (fd >= 0) close(fd);
        return vmm__ctl_error("writing %s/manifest.json: %s", path, strerror(e));
    }
    fprintf(f, "{\n  \"pid\": %u,\n  \"cmdline\": ", j->pid);
    vmm__ctl_json_str(f, j->proc.cmdline);
    fprintf(f, ",\n  \"owner_start_time\": %llu,\n  \"owner_alive_after\": %s,\n", (unsigned long long)j->proc.start_time,
            owner_alive ? "true" : "false");
    manifest_keeper(f, reg, j);
    fprintf(f, "  \"taken\": \"%s\",\n"
               "  \"taken_ns\": %llu,\n  \"seconds\": %.3f,\n  \"bytes\": %llu,\n  \"dumped\": %zu,\n"
               "  \"skipped\": %zu,\n  \"failed\": %zu,\n  \"allocations\": [\n",
            when, (unsigned long long)tot->taken_ns, tot->seconds, (unsigned long long)tot->bytes, tot->dumped,
            tot->skipped, tot->failed);
    for (size_t i = 0; i < j->n; i++) manifest_entry(f, &j->t[i], i + 1 == j->n);
    fputs("  ]\n}\n", f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return vmm__ctl_error("writing %s/manifest.json: %s", path, strerror(errno));
    return EXIT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* The command                                                                                 */

/* PATH as a new directory, or an empty one; its fd, or -1 with the error printed. */
static int make_dir(const char *path)
{
    if (mkdir(path, 0700) != 0 && errno != EEXIST) {
        vmm__ctl_error("cannot create directory %s: %s", path, strerror(errno));
        return -1;
    }
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(dup(fd)) : NULL;
    bool empty = d != NULL;
    for (struct dirent *e; d && (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = false;
    if (d) closedir(d);
    if (fd >= 0 && empty) return fd;
    if (fd >= 0) close(fd);
    vmm__ctl_error("%s exists and is not an empty directory (a whole-process dump makes one)", path);
    return -1;
}

static void print_summary(const dump_job *j, const char *path, const dump_totals *tot, double import_s)
{
    hbuf h;
    printf("dumped %zu allocation%s of pid %u to %s: %llu bytes (%s) in %.3f s, %.2f GB/s (importing took %.3f s, "
           "pinning the staging buffers %.3f s before)",
           tot->dumped, tot->dumped == 1 ? "" : "s", j->pid, path, (unsigned long long)tot->bytes,
           vmm__ctl_human(tot->bytes, &h), tot->seconds, gb_per_s(tot->bytes, tot->seconds), import_s,
           tot->stage_seconds);
    if (tot->skipped || tot->failed) printf("; %zu skipped, %zu failed", tot->skipped, tot->failed);
    putchar('\n');
}

/* ADDR given: one allocation to the file PATH. */
static int dump_one(vmm_registry *reg, dump_job *j, uint64_t addr, const char *path, progress *prog)
{
    vmm_alloc_info a;
    vmm_status st = vmm_find(reg, j->pid, addr, &a);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    target t = {.a = a};
    double t0 = mono_s();
    import_target(reg, &t);
    if (t.state != TO_DUMP)
        return vmm__ctl_error("pid %u's allocation at 0x%llx: %s", j->pid, (unsigned long long)a.address, t.reason);
    double import_s = mono_s() - t0;
    dump_totals tot = {0};
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        vmm_import_release(t.imp);
        return vmm__ctl_error("cannot open %s: %s", path, strerror(e));
    }
    struct stat sb;
    bool regular = fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode);
    tot.stage_seconds = stage_buffers(t.imp);
    prog->total = vmm_import_size(t.imp);
    prog->files = 1;
    prog->started = mono_s();
    out_file o = {.prog = prog};
    int rc = write_import(t.imp, fd, path, &o);
    tot.seconds = mono_s() - prog->started;
    vmm_import_release(t.imp);
    if (rc) {
        if (regular) unlink(path); /* no partial copy that could pass for the allocation */
        return rc;
    }
    progress_clear(prog);
    tot.dumped = 1;
    tot.bytes = prog->done;
    print_summary(j, path, &tot, import_s);
    return EXIT_OK;
}

/* No ADDR: every live allocation of the owner into the directory PATH. */
static int dump_all(vmm_registry *reg, dump_job *j, const char *path, progress *prog)
{
    vmm_status st = vmm_foreach_alloc(reg, add_target, j);
    if (st != VMM_OK) return vmm__ctl_api_error(st);
    if (j->out_of_memory) return vmm__ctl_error("out of memory listing pid %u's allocations", j->pid);
    qsort(j->t, j->n, sizeof *j->t, by_address);
    int dir = make_dir(path);
    if (dir < 0) return EXIT_PROBLEMS;
    /* every import before any copy: from here on the owner's exit changes nothing */
    double t0 = mono_s();
    for (size_t i = 0; i < j->n; i++) import_target(reg, &j->t[i]);
    double import_s = mono_s() - t0;
    dump_totals tot = {.taken_ns = vmm__ctl_now_ns()};
    vmm_imported *largest = NULL;
    for (size_t i = 0; i < j->n; i++)
        if (j->t[i].state == TO_DUMP) {
            prog->total += vmm_import_size(j->t[i].imp);
            prog->files++;
            if (!largest || vmm_import_size(j->t[i].imp) > vmm_import_size(largest)) largest = j->t[i].imp;
        }
    if (largest) tot.stage_seconds = stage_buffers(largest);
    XXH3_state_t *checksum = XXH3_createState();
    if (!checksum) {
        close(dir);
        return vmm__ctl_error("out of memory for the checksum's state");
    }
    prog->started = mono_s();
    int rc = EXIT_OK;
    for (size_t i = 0; i < j->n; i++) {
        target *t = &j->t[i];
        if (t->state != TO_DUMP) continue;
        if (rc == EXIT_OK) {
            snprintf(t->file, sizeof t->file, "0x%llx.bin", (unsigned long long)t->a.address);
            char shown[PATH_MAX + 40];
            snprintf(shown, sizeof shown, "%s/%s", path, t->file);
            int fd = openat(dir, t->file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
            out_file o = {.checksum = checksum, .prog = prog};
            if (fd < 0)
                rc = vmm__ctl_error("cannot create %s: %s", shown, strerror(errno));
            else if ((rc = write_import(t->imp, fd, shown, &o)) != EXIT_OK)
                unlinkat(dir, t->file, 0);
            t->xxh3 = XXH3_64bits_digest(checksum);
            t->state = rc == EXIT_OK ? DUMPED : FAILED;
            prog->files_done++;
        }
        /* after a failed write or copy the rest would fail alike: they are only released */
        vmm_import_release(t->imp);
        t->imp = NULL;
    }
    tot.seconds = mono_s() - prog->started;
    tot.bytes = prog->done;
    XXH3_freeState(checksum);
    progress_clear(prog);
    if (rc) {
        close(dir);
        return rc;
    }
    for (size_t i = 0; i < j->n; i++) {
        const target *t = &j->t[i];
        if (t->state == DUMPED) {
            tot.dumped++;
        } else if (t->state == SKIPPED) {
            tot.skipped++;
            fprintf(stderr, "vmmctl: skipped pid %u's allocation at 0x%llx: %s\n", j->pid,
                    (unsigned long long)t->a.address, t->reason);
        } else {
            tot.failed++;
            vmm__ctl_error("pid %u's allocation at 0x%llx could not be dumped: %s", j->pid,
                           (unsigned long long)t->a.address, t->reason);
        }
    }
    vmm_proc_info after;
    bool alive = vmm_find_proc(reg, j->pid, &after) == VMM_OK && after.start_time == j->proc.start_time &&
                 after.alive != VMM_OWNER_DEAD && after.alive != VMM_OWNER_KEPT;
    rc = write_manifest(reg, dir, path, j, &tot, alive);
    close(dir);
    if (rc) return rc;
    print_summary(j, path, &tot, import_s);
    return tot.failed ? EXIT_PROBLEMS : EXIT_OK;
}

int vmm__ctl_cmd_dump(int argc, char **argv)
{
    const char *args[2] = {0}, *path = NULL;
    int pos = 0;
    for (int i = 0; i < argc; i++) {
        if (vmm__ctl_take_registry(argc, argv, &i)) continue;
        if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--output")) {
            if (i + 1 >= argc) vmm__ctl_usage_error("dump: %s needs a path", argv[i]);
            path = argv[++i];
        } else if (!strncmp(argv[i], "--output=", 9)) {
            path = argv[i] + 9;
        } else if (argv[i][0] == '-') {
            vmm__ctl_usage_error("dump: unknown option '%s'", argv[i]);
        } else {
            if (pos == 2) vmm__ctl_usage_error("dump: too many arguments");
            args[pos++] = argv[i];
        }
    }
    if (pos == 0) vmm__ctl_usage_error("dump needs a PID");
    if (!path || !*path) vmm__ctl_usage_error("dump needs -o PATH");
    dump_job j = {.pid = vmm__ctl_parse_pid(args[0])};
    uint64_t addr = pos == 2 ? vmm__ctl_parse_addr(args[1]) : 0;
    /* a closed reader of -o /dev/stdout is a write error to report, not a silent death */
    signal(SIGPIPE, SIG_IGN);
    vmm_registry *reg;
    int rc = vmm__ctl_open_registry(&reg, false);
    if (rc) return rc;
    progress prog = {.tty = isatty(STDERR_FILENO) == 1};
    rc = find_owner(reg, &j);
    if (rc == EXIT_OK) rc = addr ? dump_one(reg, &j, addr, path, &prog) : dump_all(reg, &j, path, &prog);
    free(j.t);
    vmm_close(reg);
    if (fflush(stdout) != 0 && rc == EXIT_OK) rc = vmm__ctl_error("writing the output: %s", strerror(errno));
    return rc;
}
