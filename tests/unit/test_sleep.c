/* Sleep and wake (vmm_pause, vmm_resume: shim/backing/sleep.c), over the emulated driver.
 *
 * The owner is tests/progs/spans under the shim, with VMMSHIM_TAG set; this process is its
 * companion.  Each pause must give the physical memory back before it returns (the emulated
 * driver's live bytes in the owner drop by what the report says), keep every address, mark the
 * records paused, and refuse a companion's import with VMM_ERR_PAUSED; each resume must bring the
 * memory back at the same addresses with the kept bytes, under new chunk ids, so the companion's
 * import cache maps the new memory.  Also: pausing by NULL and by the process's tag, kept and
 * discarded and in a file; pause twice and resume what is not paused (VMM_ERR_STATE); an unknown
 * tag (VMM_ERR_NOT_FOUND); allocating and freeing while paused (a free drops the host copy);
 * resuming on a full device (VMM_ERR_NOMEM, nothing lost) and again once memory was freed; a
 * fork and an exit while paused. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define TAG "sleeper"



static bool find(vmm_registry *reg, uint64_t addr, vmm_alloc_info *out)
{
    return vmm_find(reg, (uint32_t)g_pid, addr, out) == VMM_OK;
}

/* The emulated driver's memory this process (the companion) maps: its memfd mappings. */
static int companion_mappings(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;
    while (f && fgets(line, sizeof line, f)) n += strstr(line, "/memfd:fakecuda") != NULL;
    if (f) fclose(f);
    return n;
}


static int count_procs_fn(void *ctx, const vmm_proc_info *p)
{
    if (p->alive == VMM_OWNER_ALIVE) ++*(int *)ctx;
    return 0;
}

typedef struct owner_allocs {
    uint32_t pid;
    int n;
} owner_allocs;

static int count_allocs_fn(void *ctx, const vmm_alloc_info *a)
{
    owner_allocs *o = ctx;
    o->n += a->pid == o->pid;
    return 0;
}

static int dir_entries(const char *path)
{
    DIR *d = opendir(path);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

int main(void)
{
    spans_setup("sleep");
    setenv("VMMSHIM_TAG", TAG, 1);
    char pause_dir[] = "/tmp/vmmshim-sleep-XXXXXX";
    CHECK(mkdtemp(pause_dir) != NULL, "mkdtemp");
    setenv("VMMSHIM_PAUSE_DIR", pause_dir, 1);
    CHECK(spans_start(), "cannot start the owner");
    /* a large cudaMalloc (a segment of its own), a stream-ordered one, a small one */
    uint64_t a_addr = 0, s_addr = 0, c_addr = 0;
    int a = alloc_filled('a', 24 * MIB, 101, &a_addr), s = alloc_filled('A', 3 * MIB, 102, &s_addr),
        c = alloc_filled('a', 64 * 1024, 103, &c_addr);
    CHECK(a >= 0 && s >= 0 && c >= 0, "the owner could not allocate");
    const unsigned long long live_bytes = 24 * MIB + 3 * MIB + 64 * 1024;
    vmm_registry *reg = NULL; /* the owner's first allocation made it */
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg) CHECK_DONE();
    vmm_alloc_info before;
    CHECK(find(reg, a_addr, &before) && !(before.flags & VMM_ALLOC_PAUSED), "the record before the pause");
    vmm_status st;
    CHECK(import_first_word(reg, a_addr, &st) == word(101, 0) && st == VMM_OK, "import before the pause: %s",
          vmm_last_error());

    /* 1. kept, every allocation (NULL tag) */
    CHECK(companion_mappings() >= 1, "the companion's idle mapping of the chunk it imported");
    owner_mem_t m0 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m1 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    /* its idle mapping would keep the released memory alive: the import cache's reaper lets go */
    int left = companion_mappings();
    for (int waited = 0; left && waited < 2000; waited += 10) {
        usleep(10000);
        left = companion_mappings();
    }
    CHECK(left == 0, "the companion still maps %d memfds of the paused owner's memory", left);
    CHECK(p.kept == live_bytes, "kept %llu bytes, want %llu", p.kept, live_bytes);
    CHECK(p.allocations == 3, "paused %llu allocations, want 3", p.allocations);
    CHECK(p.released >= live_bytes && p.released == m0.phys - m1.phys,
          "released %llu bytes; the device's live bytes went from %llu to %llu", p.released, m0.phys, m1.phys);
    CHECK(m1.phys == 0, "%llu bytes still live on the device after the pause", m1.phys);
    CHECK(m1.host == m0.host + 2, "host allocations %llu -> %llu: the two large copies are pinned", m0.host, m1.host);
    vmm_alloc_info info;
    CHECK(find(reg, a_addr, &info) && (info.flags & VMM_ALLOC_PAUSED), "the record is not marked paused");
    CHECK(find(reg, c_addr, &info) && (info.flags & VMM_ALLOC_PAUSED), "the small record is not marked paused");
    /* a companion's open is refused, clearly, whether or not its cache mapped the chunk before */
    CHECK(import_first_word(reg, a_addr, &st) == 0 && st == VMM_ERR_PAUSED, "import of paused memory: %d: %s", (int)st,
          vmm_last_error());
    CHECK(strstr(vmm_last_error(), "paused") != NULL, "the reason does not say paused: %s", vmm_last_error());
    vmm_imported *range = NULL;
    st = vmm_import_range(reg, (uint32_t)g_pid, s_addr, 4096, &range);
    CHECK(st == VMM_ERR_PAUSED && !range, "range import of paused memory: %d: %s", (int)st, vmm_last_error());
    CHECK(!strcmp(vmm_strerror(VMM_ERR_PAUSED), "the owner paused this memory (vmm_pause)"), "strerror");
    /* the broker refuses too, for a record read before the pause */
    vmm_imported *imp = NULL;
    st = vmm_import_fd(reg, &before, &(int){-1});
    CHECK(st == VMM_ERR_PAUSED, "the broker's answer for a paused segment: %d: %s", (int)st, vmm_last_error());
    (void)imp;

    /* the readers: the process's paused bytes, vmmctl's list and ps */
    vmm_proc_info proc;
    CHECK(vmm_find_proc(reg, (uint32_t)g_pid, &proc) == VMM_OK && proc.bytes_paused == proc.bytes_mapped &&
              proc.bytes_paused >= live_bytes,
          "paused bytes %llu of %llu mapped", (unsigned long long)proc.bytes_paused, (unsigned long long)proc.bytes_mapped);
    char ctl[600], pid_text[16], out[8192], err[2048];
    snprintf(ctl, sizeof ctl, "%s/vmmctl", g_build);
    snprintf(pid_text, sizeof pid_text, "%d", (int)g_pid);
    char *list_argv[] = {ctl, "list", "--pid", pid_text, NULL}, *ps_argv[] = {ctl, "ps", NULL},
         *json_argv[] = {ctl, "ps", "--json", NULL};
    CHECK(spawn_capture(list_argv, NULL, out, sizeof out, err, sizeof err, 30) == 0 && strstr(out, " paused ") &&
              strstr(out, "of it paused"),
          "vmmctl list does not show the paused state: %s%s", out, err);
    CHECK(spawn_capture(ps_argv, NULL, out, sizeof out, err, sizeof err, 30) == 0 && strstr(out, "PAUSED"),
          "vmmctl ps has no PAUSED column: %s%s", out, err);
    char want[64];
    snprintf(want, sizeof want, "\"bytes_paused\": %llu", (unsigned long long)proc.bytes_paused);
    CHECK(spawn_capture(json_argv, NULL, out, sizeof out, err, sizeof err, 30) == 0 && strstr(out, want),
          "vmmctl ps --json lacks %s: %s%s", want, out, err);

    /* pause twice: a clear no-op */
    p = sleep_cmd("P 0");
    CHECK(!p.ok && p.status == VMM_ERR_STATE, "a second pause: %s", p.line);
    p = sleep_cmd("P 0 nosuchtag");
    CHECK(!p.ok && p.status == VMM_ERR_NOT_FOUND, "a pause of an unknown tag: %s", p.line);

    /* allocation and free while paused */
    uint64_t d_addr = 0;
    int d = alloc_filled('a', 8 * MIB, 104, &d_addr);
    CHECK(d >= 0 && verify(d, 104), "an allocation made while paused does not work");
    CHECK(d_addr < a_addr || d_addr >= a_addr + 24 * MIB, "placed in the paused allocation's space");
    CHECK(find(reg, d_addr, &info) && !(info.flags & VMM_ALLOC_PAUSED), "the new allocation's record is marked paused");
    owner_mem_t m2 = owner_mem();
    CHECK(owner_cmd(NULL, "f %d", s), "free of a paused allocation");
    owner_mem_t m3 = owner_mem();
    CHECK(m3.host == m2.host - 1, "the freed allocation's host copy stays (%llu -> %llu)", m2.host, m3.host);
    CHECK(m3.phys == m2.phys, "freeing paused memory changed the device's live bytes: %llu -> %llu", m2.phys, m3.phys);

    /* resume: the same addresses, the same bytes, new chunk ids */
    p = sleep_cmd("R");
    owner_mem_t m4 = owner_mem();
    CHECK(p.ok, "resume: %s", p.line);
    CHECK(p.kept == 24 * MIB + 64 * 1024, "copied back %llu bytes", p.kept);
    CHECK(m4.phys == m3.phys + p.released && p.released >= 24 * MIB, "resume mapped %llu bytes; live %llu -> %llu",
          p.released, m3.phys, m4.phys);
    /* the large allocation's pinned copy stays for its next pause (test_sleep_host); the freed one's went */
    CHECK(m4.host == m0.host + 1, "host allocations after the resume: %llu, want %llu", m4.host, m0.host + 1);
    CHECK(verify(a, 101) && verify(c, 103) && verify(d, 104), "bytes differ after the resume");
    CHECK(find(reg, a_addr, &info) && !(info.flags & VMM_ALLOC_PAUSED) && info.chunk_id != before.chunk_id &&
              info.generation == before.generation,
          "the record after the resume: flags 0x%x, chunk %llu (was %llu)", info.flags,
          (unsigned long long)info.chunk_id, (unsigned long long)before.chunk_id);
    p = sleep_cmd("R");
    CHECK(!p.ok && p.status == VMM_ERR_STATE, "a resume of what is not paused: %s", p.line);
    CHECK(vmm_find_proc(reg, (uint32_t)g_pid, &proc) == VMM_OK && proc.bytes_paused == 0, "paused bytes %llu after the resume",
          (unsigned long long)proc.bytes_paused);
    CHECK(import_first_word(reg, a_addr, &st) == word(101, 0) && st == VMM_OK, "import after the resume: %d: %s", (int)st,
          vmm_last_error());

    /* 2. discarded, by the process's tag; the companion's cached mapping must not serve the old memory */
    m0 = owner_mem();
    p = sleep_cmd("P 1 " TAG);
    m1 = owner_mem();
    CHECK(p.ok && p.kept == 0 && m1.phys == 0 && m1.host == m0.host, "a discarding pause: %s (live %llu, host %llu)",
          p.line, m1.phys, m1.host);
    p = sleep_cmd("R " TAG);
    CHECK(p.ok && p.kept == 0, "resume by tag: %s", p.line);
    CHECK(owner_cmd(NULL, "w %d 201", a) && verify(a, 201), "writing resumed discarded memory");
    CHECK(owner_cmd(NULL, "w %d 203", c) && owner_cmd(NULL, "w %d 204", d), "writing resumed discarded memory");
    CHECK(import_first_word(reg, a_addr, &st) == word(201, 0) && st == VMM_OK,
          "the companion reads the released memory after the resume: %d: %s", (int)st, vmm_last_error());

    /* 3. a full device at resume: an error, nothing lost; then a success once memory is freed */
    p = sleep_cmd("P 0");
    CHECK(p.ok, "pause: %s", p.line);
    uint64_t e_addr = 0;
    int e = alloc_filled('a', 64 * MIB, 105, &e_addr);
    m0 = owner_mem();
    char cmd[64];
    snprintf(cmd, sizeof cmd, "b %llu", m0.phys + 4 * MIB);
    CHECK(e >= 0 && owner_cmd(NULL, "%s", cmd), "could not fill the device");
    p = sleep_cmd("R");
    m1 = owner_mem();
    CHECK(!p.ok && p.status == VMM_ERR_NOMEM && strstr(p.line, "full"), "a resume on a full device: %s", p.line);
    CHECK(m1.phys == m0.phys && m1.host == m0.host, "a failed resume changed memory: live %llu -> %llu, host %llu -> %llu",
          m0.phys, m1.phys, m0.host, m1.host);
    CHECK(find(reg, a_addr, &info) && (info.flags & VMM_ALLOC_PAUSED), "a failed resume unmarked the record");
    CHECK(owner_cmd(NULL, "f %d", e), "free");
    p = sleep_cmd("R");
    CHECK(p.ok, "the resume after a free: %s", p.line);
    CHECK(verify(a, 201) && verify(c, 203) && verify(d, 204), "bytes differ after a failed and a good resume");
    CHECK(owner_cmd(NULL, "b %llu", 8ull << 30), "budget");

    /* 4. kept in a file: unlinked, so the directory shows nothing */
    m0 = owner_mem();
    p = sleep_cmd("P 2");
    m1 = owner_mem();
    CHECK(p.ok && p.kept == 24 * MIB + 64 * 1024 + 8 * MIB && m1.phys == 0 && m1.host <= m0.host + 1,
          "a pause into a file: %s (live %llu, host %llu)", p.line, m1.phys, m1.host);
    CHECK(dir_entries(pause_dir) == 0, "the pause file is visible in %s", pause_dir);
    p = sleep_cmd("R");
    CHECK(p.ok && p.kept == 24 * MIB + 64 * 1024 + 8 * MIB, "a resume from the file: %s", p.line);
    CHECK(verify(a, 201) && verify(c, 203) && verify(d, 204), "bytes differ after the file");

    /* 5. a fork while paused: the child leaves nothing, the parent resumes */
    int procs0 = 0, procs1 = 0;
    vmm_foreach_proc(reg, count_procs_fn, &procs0);
    p = sleep_cmd("P 0");
    char ans[256];
    CHECK(p.ok && owner_cmd(ans, "F") && !strcmp(ans, "ok 0\n"), "a fork while paused: %s", ans);
    vmm_foreach_proc(reg, count_procs_fn, &procs1);
    CHECK(procs1 == procs0, "live owners %d -> %d after the child's exit", procs0, procs1);
    p = sleep_cmd("R");
    CHECK(p.ok && verify(a, 201), "resume after a fork: %s", p.line);

    /* 6. an exit while paused: the records go with the owner */
    p = sleep_cmd("P 0");
    CHECK(p.ok, "pause: %s", p.line);
    owner_allocs oa = {.pid = (uint32_t)g_pid};
    vmm_foreach_alloc(reg, count_allocs_fn, &oa);
    CHECK(oa.n >= 3, "records of the paused owner: %d", oa.n);
    int wst = spans_quit();
    CHECK(wst == 0, "the owner exited with 0x%x while paused", wst);
    oa.n = 0;
    vmm_foreach_alloc(reg, count_allocs_fn, &oa);
    CHECK(oa.n == 0, "%d records left by an owner that exited while paused", oa.n);

    vmm_close(reg);
    rmdir(pause_dir);
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", g_reg);
    unlink(path);
    CHECK_DONE();
}
