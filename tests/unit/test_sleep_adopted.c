/* Sleep and wake of the program's own VMM memory (cuMemCreate + cuMemMap: shim/backing/adopt_sleep.c),
 * over the emulated driver.
 *
 * The owner is tests/progs/spans under the shim; this process is its companion.  With
 * VMMSHIM_SLEEP_ADOPTED=1 the owner maps two handles of its own, one released right after mapping
 * (the usual VMM idiom) and one still held, and sees stand-in handle values.  A pause by the
 * process's tag (VMMSHIM_TAG: the untagged memory; a tag nothing carries finds nothing) must give
 * their physical memory back (the emulated driver's live bytes drop by their size), flag their
 * records paused and refuse a companion's import (VMM_ERR_PAUSED, from the record and from the
 * broker); while paused, the program's calls on the held stand-in answer as documented.  A resume
 * brings the same bytes back at the same addresses, imports work again, the retained handle is the
 * stand-in; a discarded pause brings fresh memory back; an unmap and release while paused succeed;
 * at the end the program unmaps and releases all without an error and no handle is left.  With
 * the option off the same memory stays through a pause, counted in bytes_not_shim, and the
 * program's handles are the driver's. */
#include "../fakecuda/fakecuda.h"
#include "check.h"
#include "spawn.h"
#include "spansowner.h"
#include "vmmshim.h"

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>

#define MIB (1ull << 20)
#define PROC_TAG "ownvmm" /* VMMSHIM_TAG: the owner's untagged memory */


/* "V <bytes> <release>" filled with `w <index> <seed>`: the index, or -1; *addr, *handle. */
static int own_filled(uint64_t bytes, int release, uint64_t seed, uint64_t *addr, uint64_t *handle)
{
    char a[256];
    int idx = -1;
    unsigned long long p = 0, h = 0;
    if (!owner_cmd(a, "V %llu %d", (unsigned long long)bytes, release) || sscanf(a, "ok %d 0x%llx 0x%llx", &idx, &p, &h) != 3) {
        fprintf(stderr, "owner: V: %s", a);
        return -1;
    }
    *addr = p;
    *handle = h;
    return owner_cmd(NULL, "w %d %llu", idx, (unsigned long long)seed) ? idx : -1;
}

/* An answer "ok <n> [<n> <n>]" to cmd: how many numbers it had (after "ok"), in v. */
static int ask(const char *cmd, long long v[3])
{
    char a[256];
    v[0] = v[1] = v[2] = -1;
    if (!owner_cmd(a, "%s", cmd)) {
        fprintf(stderr, "owner: %s: %s", cmd, a);
        return 0;
    }
    unsigned long long h = 0;
    if (sscanf(a, "ok %lld 0x%llx %lld", &v[0], &h, &v[2]) == 3) { /* "H": the handle in hex */
        v[1] = (long long)h;
        return 3;
    }
    return sscanf(a, "ok %lld %lld %lld", &v[0], &v[1], &v[2]);
}

static int is_stand_in(uint64_t h) { return (h >> 48) == 0xFA57; }


static void owner_stop(void)
{
    int st = spans_quit();
    CHECK(st == 0, "the owner's exit: 0x%x", st);
}

/* VMMSHIM_SLEEP_ADOPTED=1: the whole cycle. */
static void with_stand_ins(void)
{
    setenv("VMMSHIM_SLEEP_ADOPTED", "1", 1);
    setenv("VMMSHIM_TAG", PROC_TAG, 1);
    static char defer[] = "FAKECUDA_ASYNC_DEFER=1"; /* a copy not waited for before the unmap is caught */
    g_owner_env[0] = defer;
    CHECK(spans_start(), "cannot start the owner");
    g_owner_env[0] = NULL;
    owner_mem_t m0 = owner_mem();
    uint64_t a_addr = 0, a_h = 0, b_addr = 0, b_h = 0;
    int a = own_filled(4 * MIB, 1, 201, &a_addr, &a_h), b = own_filled(2 * MIB, 0, 202, &b_addr, &b_h);
    CHECK(a >= 0 && b >= 0, "the owner could not map its own memory");
    CHECK(is_stand_in(b_h) && is_stand_in(a_h) && a_h != b_h, "stand-in handles: 0x%llx 0x%llx", (unsigned long long)a_h,
          (unsigned long long)b_h);
    owner_mem_t m1 = owner_mem();
    CHECK_EQ(m1.phys - m0.phys, 6 * MIB);
    long long v[3];
    CHECK(ask("G 1", v) == 3 && v[0] == 0 && v[1] == 0 && v[2] == 0, "properties of the held stand-in: %lld %lld %lld",
          v[0], v[1], v[2]);
    CHECK(ask("H 1", v) == 3 && v[0] == 0 && (uint64_t)v[1] == b_h && v[2] == 0,
          "a retain gives the stand-in (and its release succeeds): %lld 0x%llx %lld", v[0], (unsigned long long)v[1], v[2]);
    CHECK(ask("H 0", v) == 3 && v[0] == 0 && (uint64_t)v[1] == a_h && v[2] == 0,
          "a retain of the released handle's memory gives its stand-in: %lld 0x%llx %lld", v[0],
          (unsigned long long)v[1], v[2]);
    vmm_registry *reg = NULL;
    CHECK(vmm_open(g_reg, &reg) == VMM_OK, "vmm_open: %s", vmm_last_error());
    if (!reg) return;
    vmm_status st;
    CHECK(import_first_word(reg, a_addr, &st) == word(201, 0) && st == VMM_OK, "import before the pause: %d %s", (int)st,
          vmm_last_error());

    vmm_alloc_info before;
    CHECK(vmm_find(reg, (uint32_t)g_pid, b_addr, &before) == VMM_OK && !(before.flags & VMM_ALLOC_PAUSED),
          "the record before the pause");

    /* kept, by the process's tag (the untagged memory) */
    sleep_ans other = sleep_cmd("P 0 nosuchtag");
    CHECK(!other.ok && other.status == VMM_ERR_NOT_FOUND, "a tag nothing carries: %s", other.line);
    CHECK_EQ(owner_mem().phys, m1.phys);
    sleep_ans p = sleep_cmd("P 0 " PROC_TAG);
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    CHECK_EQ(p.released, 6 * MIB);
    CHECK_EQ(p.kept, 6 * MIB);
    CHECK_EQ(p.segments, 2);
    CHECK_EQ(p.allocations, 2);
    CHECK_EQ(p.not_shim, 0);
    CHECK_EQ(m1.phys - m2.phys, 6 * MIB); /* the memory really left the device */
    CHECK_EQ(m2.host - m1.host, 2);       /* a pinned copy each (test_sleep_host: kept across cycles) */
    CHECK_EQ(m2.handles, m0.handles);
    vmm_alloc_info info;
    CHECK(vmm_find(reg, (uint32_t)g_pid, a_addr, &info) == VMM_OK && (info.flags & VMM_ALLOC_PAUSED),
          "the record is flagged paused");
    CHECK(import_first_word(reg, b_addr, &st) == 0 && st == VMM_ERR_PAUSED, "import while paused: %d", (int)st);
    int fd = -1; /* the record as it was before: past the client's own check, the broker answers */
    st = vmm_import_fd(reg, &before, &fd);
    CHECK(st == VMM_ERR_PAUSED && fd < 0, "the broker's answer while paused: %d", (int)st);
    CHECK(ask("G 1", v) == 3 && v[0] == 0 && v[1] == 0 && v[2] == 0, "properties while paused: %lld %lld %lld", v[0],
          v[1], v[2]);
    CHECK(ask("M 1", v) == 1 && v[0] == 400 /* CUDA_ERROR_INVALID_HANDLE */, "cuMemMap of a paused stand-in: %lld", v[0]);
    CHECK(ask("X 1", v) == 1 && v[0] == 400 /* CUDA_ERROR_INVALID_HANDLE */, "export of a paused stand-in: %lld", v[0]);
    CHECK(ask("H 1", v) == 3 && v[0] != 0, "retain at a paused address fails: %lld", v[0]);
    sleep_ans again = sleep_cmd("P 0");
    CHECK(!again.ok && again.status == VMM_ERR_STATE, "pause twice: %s", again.line);

    sleep_ans r = sleep_cmd("R " PROC_TAG);
    owner_mem_t m3 = owner_mem();
    CHECK(r.ok, "resume: %s", r.line);
    CHECK_EQ(r.released, 6 * MIB);
    CHECK_EQ(r.kept, 6 * MIB);
    CHECK_EQ(m3.phys, m1.phys);
    CHECK(m3.host == m2.host && m3.host_freed == m2.host_freed, "the pinned copies stay for the next pause: %llu -> %llu",
          m2.host, m3.host);
    CHECK(verify(a, 201) && verify(b, 202), "the bytes after the resume, at the same addresses");
    CHECK(vmm_find(reg, (uint32_t)g_pid, a_addr, &info) == VMM_OK && !(info.flags & VMM_ALLOC_PAUSED),
          "the record is live again");
    CHECK(import_first_word(reg, a_addr, &st) == word(201, 0) && st == VMM_OK, "import after the resume: %d %s", (int)st,
          vmm_last_error());
    CHECK(ask("H 1", v) == 3 && v[0] == 0 && (uint64_t)v[1] == b_h && v[2] == 0, "a retain after the resume: 0x%llx",
          (unsigned long long)v[1]);
    CHECK(ask("M 1", v) == 1 && v[0] == 0, "cuMemMap of the stand-in after the resume: %lld", v[0]);
    sleep_ans r2 = sleep_cmd("R");
    CHECK(!r2.ok && r2.status == VMM_ERR_STATE, "resume what is not paused: %s", r2.line);

    /* discarded; the released handle's memory unmapped by the program while paused */
    p = sleep_cmd("P 1");
    CHECK(p.ok && p.kept == 0 && p.released == 6 * MIB, "discard pause: %s", p.line);
    CHECK_EQ(owner_mem().phys, m0.phys);
    CHECK(owner_cmd(NULL, "U %d", a), "cuMemUnmap (and cuMemAddressFree) of paused memory succeed");
    CHECK_EQ(owner_mem().host, m2.host - 1); /* the unmapped range's kept buffer went with it */
    r = sleep_cmd("R");
    CHECK(r.ok && r.released == 2 * MIB && r.kept == 0, "resume after the discard: %s", r.line);
    CHECK_EQ(owner_mem().phys - m0.phys, 2 * MIB);
    CHECK(!verify(b, 202), "discarded contents are not the old bytes (fresh memory)");

    /* the held handle released while paused: the resume lets go of its creation reference, so
     * the unmap after it frees the memory */
    CHECK(owner_cmd(NULL, "w %d 203", b), "fill again");
    owner_mem_t before_pause = owner_mem();
    p = sleep_cmd("P 0");
    CHECK_EQ(owner_mem().host_made, before_pause.host_made); /* into the buffer of the first cycle */
    CHECK(p.ok && p.released == 2 * MIB, "pause of what is left: %s", p.line);
    CHECK(ask("L 1", v) == 1 && v[0] == 0, "cuMemRelease of a paused stand-in: %lld", v[0]);
    CHECK(ask("L 1", v) == 1 && v[0] != 0, "a second cuMemRelease fails as the driver's would: %lld", v[0]);
    r = sleep_cmd("R");
    CHECK(r.ok && r.released == 2 * MIB, "resume: %s", r.line);
    CHECK(verify(b, 203), "the bytes of memory whose handle was released while paused");
    CHECK(owner_cmd(NULL, "U %d", b), "unmap after the resume");
    owner_mem_t m4 = owner_mem();
    CHECK_EQ(m4.phys, m0.phys);
    CHECK_EQ(m4.handles, m0.handles); /* nothing leaked: the driver holds no handle of it */
    CHECK_EQ(m4.host, m0.host);       /* nor a host buffer */
    sleep_ans none = sleep_cmd("P 0");
    CHECK(!none.ok, "nothing left to pause: %s", none.line);
    vmm_close(reg);
    owner_stop();
}

/* More than a mark's worth of copies (128 MiB) over several handles, the copies held back until a
 * synchronization: the handles a mark covers go while the later copies still move (one released
 * before its copy makes the owner fault or read wrong bytes); marks were taken, every byte comes
 * back, and nothing is left after the program unmaps it all. */
static void marks(void)
{
    setenv("VMMSHIM_SLEEP_ADOPTED", "1", 1);
    static char defer[] = "FAKECUDA_ASYNC_DEFER=1";
    g_owner_env[0] = defer;
    CHECK(spans_start(), "cannot start the owner");
    g_owner_env[0] = NULL;
    owner_mem_t m0 = owner_mem();
    int idx[5];
    uint64_t addr, h;
    for (int i = 0; i < 5; i++) idx[i] = own_filled(48 * MIB, 1, 300 + (uint64_t)i, &addr, &h);
    CHECK(idx[0] >= 0 && idx[4] >= 0, "the owner could not map its own memory");
    owner_mem_t m1 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok && p.kept == 5 * 48 * MIB && m2.phys == m0.phys, "pause: %s", p.line);
    CHECK(m2.event_records > m1.event_records, "no mark taken: %llu events recorded", m2.event_records - m1.event_records);
    sleep_ans r = sleep_cmd("R");
    CHECK(r.ok, "resume: %s", r.line);
    int same = 1;
    for (int i = 0; i < 5; i++) same &= verify(idx[i], 300 + (uint64_t)i);
    CHECK(same, "bytes differ after a pause released handles under its marks");
    for (int i = 0; i < 5; i++) owner_cmd(NULL, "U %d", idx[i]);
    CHECK_EQ(owner_mem().phys, m0.phys);
    owner_stop();
}

/* vmm_pause_prepare pins ahead for the program's own memory too: the pause after it pins nothing,
 * and its bytes come back. */
static void prepared(void)
{
    setenv("VMMSHIM_SLEEP_ADOPTED", "1", 1);
    CHECK(spans_start(), "cannot start the owner");
    uint64_t addr, h;
    uint64_t a_addr;
    int a = own_filled(6 * MIB, 1, 601, &a_addr, &h), b = own_filled(4 * MIB, 0, 602, &addr, &h);
    CHECK(a >= 0 && b >= 0, "the owner could not map its own memory");
    owner_mem_t m0 = owner_mem();
    char line[256];
    unsigned long long ready = 0;
    CHECK(owner_cmd(line, "Q") && sscanf(line, "ok %llu", &ready) == 1 && ready == 10 * MIB, "prepare: %s", line);
    owner_mem_t m1 = owner_mem();
    CHECK_EQ(m1.host_made - m0.host_made, 2);
    int o = -1;
    CHECK(owner_cmd(line, "O %llx 4096", (unsigned long long)(a_addr + 5 * MIB)) && sscanf(line, "ok %d", &o) == 1 && o == 0,
          "awake: no paused memory there: %s", line);
    sleep_ans p = sleep_cmd("P 0");
    CHECK(p.ok && p.kept == 10 * MIB && owner_mem().host_made == m1.host_made, "the pause after: %s", p.line);
    CHECK(owner_cmd(line, "O %llx 4096", (unsigned long long)(a_addr + 5 * MIB)) && sscanf(line, "ok %d", &o) == 1 && o == 1,
          "paused: vmm_paused_overlaps finds the program's own paused range: %s", line);
    int st = -1;
    unsigned long long bytes = 0, first = 0;
    uint64_t want = word(601, 5 * MIB / 8);
    CHECK(owner_cmd(line, "C %llx", (unsigned long long)(a_addr + 5 * MIB)) &&
              sscanf(line, "ok %d %llu 0x%llx", &st, &bytes, &first) == 3 && st == 0 && bytes == MIB && first == want,
          "paused: vmm_sleep_host finds the kept copy of the byte 5 MiB in, 1 MiB left of it: %s", line);
    sleep_ans r = sleep_cmd("R");
    CHECK(r.ok && verify(a, 601) && verify(b, 602), "resume: %s", r.line);
    CHECK(owner_cmd(line, "O %llx 4096", (unsigned long long)(a_addr + 5 * MIB)) && sscanf(line, "ok %d", &o) == 1 && o == 0,
          "resumed: none again: %s", line);
    CHECK(owner_cmd(line, "C %llx", (unsigned long long)(a_addr + 5 * MIB)) &&
              sscanf(line, "ok %d %llu 0x%llx", &st, &bytes, &first) == 3 && st == 0 && first == want,
          "resumed: the buffer kept for the next pause still holds the last pause's bytes: %s", line);
    unsigned long long freed = 0;
    CHECK(owner_cmd(line, "D") && sscanf(line, "ok %llu", &freed) == 1 && freed == 10 * MIB,
          "vmm_sleep_drop_host frees both kept buffers: %s", line);
    CHECK(owner_mem().host_freed - m1.host_freed == 2, "the two pinned buffers were given back");
    CHECK(owner_cmd(line, "C %llx", (unsigned long long)(a_addr + 5 * MIB)) &&
              sscanf(line, "ok %d", &st) == 1 && st == VMM_ERR_NOT_FOUND,
          "after the drop no host copy is left: %s", line);
    CHECK(owner_cmd(NULL, "U %d", a) && owner_cmd(NULL, "U %d", b), "unmap and release");
    owner_stop();
}

/* Memory the program exported itself (NCCL's buffers, which its peers map) stays through a pause,
 * reported in bytes_not_shim, while its other memory goes. */
static void shared(void)
{
    setenv("VMMSHIM_SLEEP_ADOPTED", "1", 1);
    CHECK(spans_start(), "cannot start the owner");
    owner_mem_t m0 = owner_mem();
    uint64_t a_addr = 0, a_h = 0, b_addr = 0, b_h = 0;
    int a = own_filled(4 * MIB, 0, 401, &a_addr, &a_h), b = own_filled(2 * MIB, 0, 402, &b_addr, &b_h);
    CHECK(a >= 0 && b >= 0, "the owner could not map its own memory");
    long long v[3];
    CHECK(ask("X 1", v) == 1 && v[0] == 0, "export of the held stand-in: %lld", v[0]);
    owner_mem_t m1 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    CHECK_EQ(p.released, 4 * MIB);
    CHECK_EQ(p.not_shim, 2 * MIB);
    CHECK_EQ(m1.phys - m2.phys, 4 * MIB); /* the exported handle's memory stayed on the device */
    CHECK(verify(b, 402), "the exported memory stays mapped and readable while the rest sleeps");
    CHECK(ask("X 1", v) == 1 && v[0] == 0, "it can be exported again while the rest sleeps: %lld", v[0]);
    sleep_ans r = sleep_cmd("R");
    CHECK(r.ok && r.released == 4 * MIB && r.not_shim == 2 * MIB, "resume: %s", r.line);
    CHECK(verify(a, 401) && verify(b, 402), "both after the resume");
    CHECK(owner_cmd(NULL, "U %d", a) && owner_cmd(NULL, "U %d", b), "unmap and release");
    CHECK_EQ(owner_mem().phys, m0.phys);
    owner_stop();
}

/* Memory NCCL makes (code in a library named libnccl*: its kernels, proxy and peers use it at any
 * time) gets no stand-in and stays through a pause of everything, reported in bytes_not_shim, while
 * the same kind of memory made by the program goes. */
static void comm(void)
{
    setenv("VMMSHIM_SLEEP_ADOPTED", "1", 1);
    char lib[600];
    snprintf(lib, sizeof lib, "%s/tests/libnccl-standin.so", g_build);
    setenv("VMMSHIM_TEST_NCCL_LIB", lib, 1);
    CHECK(spans_start(), "cannot start the owner");
    owner_mem_t m0 = owner_mem();
    uint64_t a_addr = 0, a_h = 0;
    int a = own_filled(4 * MIB, 1, 501, &a_addr, &a_h);
    char line[256];
    int c = -1;
    CHECK(owner_cmd(line, "N %llu", (unsigned long long)(2 * MIB)) && sscanf(line, "ok %d", &c) == 1, "N: %s", line);
    CHECK(a >= 0 && c >= 0 && owner_cmd(NULL, "w %d 502", c), "the owner could not map its memory");
    CHECK(is_stand_in(a_h), "the program's own handle is a stand-in: 0x%llx", (unsigned long long)a_h);
    owner_mem_t m1 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m2 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    CHECK_EQ(p.released, 4 * MIB);
    CHECK_EQ(p.not_shim, 2 * MIB);
    CHECK_EQ(m1.phys - m2.phys, 4 * MIB); /* NCCL's memory stayed on the device */
    CHECK(verify(c, 502), "NCCL's memory stays mapped and readable while the rest sleeps");
    sleep_ans r = sleep_cmd("R");
    CHECK(r.ok && r.released == 4 * MIB && r.not_shim == 2 * MIB, "resume: %s", r.line);
    CHECK(verify(a, 501) && verify(c, 502), "both after the resume");
    CHECK_EQ(owner_mem().phys - m0.phys, 6 * MIB);
    owner_stop();
    unsetenv("VMMSHIM_TEST_NCCL_LIB");
}

/* VMMSHIM_SLEEP_ADOPTED=0 (the default): the program's memory stays, reported. */
static void without(void)
{
    unsetenv("VMMSHIM_SLEEP_ADOPTED");
    CHECK(spans_start(), "cannot start the owner");
    owner_mem_t m0 = owner_mem();
    uint64_t c_addr = 0, a_addr = 0, a_h = 0, b_addr = 0, b_h = 0;
    int c = alloc_filled('a', 1 * MIB, 300, &c_addr);
    owner_mem_t m1 = owner_mem();
    int a = own_filled(4 * MIB, 1, 301, &a_addr, &a_h), b = own_filled(2 * MIB, 0, 302, &b_addr, &b_h);
    CHECK(a >= 0 && b >= 0 && c >= 0, "the owner could not allocate");
    CHECK(!is_stand_in(a_h) && !is_stand_in(b_h), "the driver's handles: 0x%llx 0x%llx", (unsigned long long)a_h,
          (unsigned long long)b_h);
    owner_mem_t m2 = owner_mem();
    sleep_ans p = sleep_cmd("P 0");
    owner_mem_t m3 = owner_mem();
    CHECK(p.ok, "pause: %s", p.line);
    CHECK_EQ(p.not_shim, 6 * MIB);
    CHECK_EQ(p.released, m1.phys - m0.phys); /* the pool's memory only */
    CHECK_EQ(m3.phys - m0.phys, 6 * MIB);
    CHECK(verify(a, 301) && verify(b, 302), "the program's own memory was left alone");
    sleep_ans r = sleep_cmd("R");
    CHECK(r.ok && r.not_shim == 6 * MIB, "resume: %s", r.line);
    CHECK_EQ(owner_mem().phys, m2.phys);
    CHECK(verify(c, 300), "the pool's bytes after the resume");
    CHECK(owner_cmd(NULL, "U %d", a) && owner_cmd(NULL, "U %d", b), "unmap and release");
    CHECK_EQ(owner_mem().phys, m1.phys);
    owner_stop();
}

int main(void)
{
    spans_setup("sleepad");
    with_stand_ins();
    marks();
    prepared();
    shared();
    comm();
    without();
    char path[128];
    snprintf(path, sizeof path, "/dev/shm%s", g_reg);
    unlink(path);
    CHECK_DONE();
}
