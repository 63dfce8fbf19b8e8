/* The options table: parsing of every type, every kind of bad value (one line naming the
 * variable and the value, the default kept), file against environment, STRICT, VERBOSE, and
 * the two documents generated from the table (README table, config/vmmshim.conf).
 *
 *   test_options --markdown   prints the README table (tests/scripts/gen_options_doc.sh)
 *   test_options --conf       prints the sample config file */
#include "core/log.h"
#include "core/options.h"
#include "core/version.h"

#include "check.h"
#include "logcap.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static char tmpdir[64];

static int reload(void)
{
    cap_begin();
    return vmm__opt_reload_for_test();
}

static const char *fmt(vmm__opt_id id)
{
    static char buf[4096];
    vmm__opt_format(id, buf, sizeof buf);
    return buf;
}

static const char *write_temp(const char *name, const char *text)
{
    static char path[4][128];
    static int next;
    char *p = path[next++ % 4];
    snprintf(p, 128, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "w");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
    return p;
}

/* ------------------------------------------------------------------------------------- */

static void test_table(void)
{
    clear_env();
    CHECK_EQ(reload(), 0);
    CHECK(cap_text()[0] == 0, "defaults printed: %s", cap_buf);
    CHECK(strcmp(vmm__opt_name(VMM__OPT_LOG_LEVEL), "VMMSHIM_LOG_LEVEL") == 0, "%s", vmm__opt_name(VMM__OPT_LOG_LEVEL));
    for (int i = 0; i < VMM__OPT_COUNT; i++) {
        vmm__opt_id id = (vmm__opt_id)i;
        CHECK(strncmp(vmm__opt_name(id), "VMMSHIM_", 8) == 0, "%d", i);
        CHECK(vmm__opt_help(id)[0] != 0, "%s has no help", vmm__opt_name(id));
        CHECK(vmm__opt_source_of(id) == VMM__SRC_DEFAULT, "%s", vmm__opt_name(id));
        /* The default text is the canonical form of the default value. */
        CHECK(strcmp(fmt(id), vmm__opt_default_text(id)) == 0, "%s: '%s' vs '%s'", vmm__opt_name(id), fmt(id),
              vmm__opt_default_text(id));
    }
    CHECK_EQ(vmm__opt_bool(VMM__OPT_STRICT), 0);
    CHECK_EQ(vmm__opt_bool(VMM__OPT_VERBOSE), 0);
    CHECK_EQ(vmm__opt_enum(VMM__OPT_LOG_LEVEL), VMM__LOG_WARNING);
    CHECK(strcmp(vmm__opt_str(VMM__OPT_LOG_FILE), "") == 0, "log file");
    CHECK_EQ(vmm__opt_bool(VMM__OPT_ENABLE), 1);
    CHECK_EQ(vmm__opt_int(VMM__OPT_REGISTRY_CAPACITY), 1048576);
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 0, "cache %llu", vmm__opt_size(VMM__OPT_CACHE_SIZE));
    CHECK(vmm__opt_int(VMM__OPT_GIVE_BACK_MS) == 200, "give-back %lld", vmm__opt_int(VMM__OPT_GIVE_BACK_MS));
    CHECK(vmm__opt_size(VMM__OPT_PAUSE_HOST_CACHE) == 64ULL << 30, "pause host cache %llu",
          vmm__opt_size(VMM__OPT_PAUSE_HOST_CACHE));
    CHECK_EQ(vmm__opt_enum(VMM__OPT_EXPORT), VMM__EXPORT_BROKER);
    CHECK_EQ(vmm__opt_enum(VMM__OPT_FABRIC), VMM__FABRIC_AUTO);
    CHECK_EQ(vmm__opt_int(VMM__OPT_FRAMES), 0);
    CHECK(strcmp(vmm__opt_type_name(VMM__OPT_STRICT), "bool") == 0, "type");
    CHECK(strcmp(vmm__opt_type_name(VMM__OPT_FRAMES), "integer") == 0, "type");
    CHECK(strcmp(vmm__opt_type_name(VMM__OPT_CACHE_SIZE), "size") == 0, "type");
    CHECK(strcmp(vmm__opt_type_name(VMM__OPT_FABRIC), "enum") == 0, "type");
    CHECK(strcmp(vmm__opt_type_name(VMM__OPT_TAG), "string") == 0, "type");
    CHECK(strcmp(vmm__opt_default_text(VMM__OPT_CACHE_SIZE), "0") == 0, "default text");
    CHECK(vmm__opt_str(VMM__OPT_COUNT) != NULL && vmm__opt_str(VMM__OPT_STRICT)[0] == 0, "str never NULL");
    CHECK_EQ(vmm__opt_init(), 0);
}

static void *init_racer(void *arg)
{
    (void)arg;
    return (void *)(long)vmm__opt_init();
}

/* Runs first, before anything has loaded the options. */
static void test_first_init_from_threads(void)
{
    pthread_t t[8];
    void *rc;
    clear_env();
    cap_begin();
    setenv("VMMSHIM_FRAMES", "oops", 1);
    errno = EXDEV;
    CHECK_EQ(vmm__opt_int(VMM__OPT_FRAMES), 0); /* the first use loads, and keeps errno */
    CHECK_EQ(errno, EXDEV);
    for (int i = 0; i < 8; i++) pthread_create(&t[i], NULL, init_racer, NULL);
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], &rc);
        CHECK_EQ((long)rc, 0);
    }
    CHECK_EQ(count_lines(cap_text()), 1); /* loaded exactly once */
    CHECK(strstr(cap_buf, "VMMSHIM_FRAMES='oops'") != NULL, "%s", cap_buf);
    CHECK_EQ(vmm__opt_init(), 0);
    CHECK_EQ(count_lines(cap_text()), 1);
}

static void good(vmm__opt_id id, const char *value, const char *expect)
{
    clear_env();
    setenv(vmm__opt_name(id), value, 1);
    CHECK_EQ(reload(), 0);
    CHECK(cap_text()[0] == 0, "%s='%s' printed: %s", vmm__opt_name(id), value, cap_buf);
    CHECK(strcmp(fmt(id), expect) == 0, "%s='%s' -> '%s', want '%s'", vmm__opt_name(id), value, fmt(id), expect);
    CHECK(vmm__opt_source_of(id) == VMM__SRC_ENV, "%s source", vmm__opt_name(id));
}

static void test_good_values(void)
{
    static const char *const yes[] = {"1", "true", "TRUE", "Yes", "on", " on "};
    static const char *const no[] = {"0", "false", "No", "OFF", "no"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) good(VMM__OPT_STRICT, yes[i], "1");
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) good(VMM__OPT_ENABLE, no[i], "0");
    CHECK_EQ(vmm__opt_bool(VMM__OPT_ENABLE), 0);

    good(VMM__OPT_REGISTRY_CAPACITY, "2048", "2048");
    CHECK_EQ(vmm__opt_int(VMM__OPT_REGISTRY_CAPACITY), 2048);
    good(VMM__OPT_REGISTRY_CAPACITY, "1024", "1024");
    good(VMM__OPT_REGISTRY_CAPACITY, "16777216", "16777216");
    good(VMM__OPT_REGISTRY_CAPACITY, "+4096", "4096");
    good(VMM__OPT_FRAMES, " 8 ", "8");
    CHECK_EQ(vmm__opt_int(VMM__OPT_FRAMES), 8);
    good(VMM__OPT_FRAMES, "0", "0");

    good(VMM__OPT_CACHE_SIZE, "0", "0");
    good(VMM__OPT_CACHE_SIZE, "4096", "4K");
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 4096, "%llu", vmm__opt_size(VMM__OPT_CACHE_SIZE));
    good(VMM__OPT_CACHE_SIZE, "1000", "1000");
    good(VMM__OPT_CACHE_SIZE, "2k", "2K");
    good(VMM__OPT_CACHE_SIZE, "1536K", "1536K");
    good(VMM__OPT_CACHE_SIZE, "3M", "3M");
    good(VMM__OPT_CACHE_SIZE, "512MiB", "512M");
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 512ULL << 20, "%llu", vmm__opt_size(VMM__OPT_CACHE_SIZE));
    good(VMM__OPT_CACHE_SIZE, "2gib", "2G");
    good(VMM__OPT_CACHE_SIZE, "1 G", "1G");
    good(VMM__OPT_CACHE_SIZE, "8GB", "8G");
    good(VMM__OPT_CACHE_SIZE, "1T", "1T");
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 1ULL << 40, "%llu", vmm__opt_size(VMM__OPT_CACHE_SIZE));
    good(VMM__OPT_PAUSE_HOST_CACHE, "0", "0");
    good(VMM__OPT_PAUSE_HOST_CACHE, "256M", "256M");
    CHECK(vmm__opt_size(VMM__OPT_PAUSE_HOST_CACHE) == 256ULL << 20, "%llu", vmm__opt_size(VMM__OPT_PAUSE_HOST_CACHE));

    good(VMM__OPT_LOG_LEVEL, "debug", "debug");
    CHECK_EQ(vmm__opt_enum(VMM__OPT_LOG_LEVEL), VMM__LOG_DEBUG);
    good(VMM__OPT_LOG_LEVEL, "INFO", "info");
    CHECK_EQ(vmm__opt_enum(VMM__OPT_LOG_LEVEL), VMM__LOG_INFO);
    good(VMM__OPT_LOG_LEVEL, "error", "error");
    good(VMM__OPT_EXPORT, "pidfd", "pidfd");
    CHECK_EQ(vmm__opt_enum(VMM__OPT_EXPORT), VMM__EXPORT_PIDFD);
    good(VMM__OPT_FABRIC, "Off", "off");
    CHECK_EQ(vmm__opt_enum(VMM__OPT_FABRIC), VMM__FABRIC_OFF);

    good(VMM__OPT_TAG, "job-42", "job-42");
    CHECK(strcmp(vmm__opt_str(VMM__OPT_TAG), "job-42") == 0, "%s", vmm__opt_str(VMM__OPT_TAG));
    good(VMM__OPT_TAG, "0123456789012345678901234567890", "0123456789012345678901234567890"); /* 31 */
    good(VMM__OPT_REGISTRY, "/my-registry", "/my-registry");
    good(VMM__OPT_REGISTRY, "my-registry", "/my-registry"); /* the client library's reading too */
    good(VMM__OPT_REGISTRY, "", "");
    good(VMM__OPT_BROKER_DIR, "/run/user/1000/vmm", "/run/user/1000/vmm");
    good(VMM__OPT_REGISTRY_GROUP, "video", "video");
    good(VMM__OPT_BROKER_GROUP, "1234", "1234");
    good(VMM__OPT_LOG_FILE, "relative.log", "relative.log");

    /* An empty non-string variable is "not set". */
    clear_env();
    setenv("VMMSHIM_CACHE_SIZE", "", 1);
    CHECK_EQ(reload(), 0);
    CHECK(cap_text()[0] == 0, "%s", cap_buf);
    CHECK(vmm__opt_source_of(VMM__OPT_CACHE_SIZE) == VMM__SRC_DEFAULT, "empty is unset");
}

/* One line, naming the variable and the value, and the default is what stays. */
static void bad(vmm__opt_id id, const char *value, const char *why)
{
    char quoted[256];
    clear_env();
    setenv(vmm__opt_name(id), value, 1);
    CHECK_EQ(reload(), 0);
    const char *t = cap_text();
    snprintf(quoted, sizeof quoted, "%s='%s'", vmm__opt_name(id), value);
    CHECK_EQ(count_lines(t), 1);
    CHECK(strncmp(t, "vmmshim: warning: ", 18) == 0, "%s", t);
    CHECK(strstr(t, quoted) != NULL, "%s not in %s", quoted, t);
    CHECK(strstr(t, why) != NULL, "'%s' not in %s", why, t);
    CHECK(strstr(t, "; using default ") != NULL, "%s", t);
    CHECK(strcmp(fmt(id), vmm__opt_default_text(id)) == 0, "%s='%s' kept '%s'", vmm__opt_name(id), value, fmt(id));
    CHECK(vmm__opt_source_of(id) == VMM__SRC_DEFAULT, "%s source", vmm__opt_name(id));
}

static void test_bad_values(void)
{
    char long_name[260];

    /* The exact wording, once. */
    clear_env();
    setenv("VMMSHIM_CACHE_SIZE", "12Q", 1);
    CHECK_EQ(reload(), 0);
    CHECK(strcmp(cap_text(), "vmmshim: warning: VMMSHIM_CACHE_SIZE='12Q' is not a size (use bytes or K/M/G/T "
                             "suffix, 0..1T); using default 0\n") == 0, "%s", cap_buf);

    bad(VMM__OPT_VERBOSE, "maybe", "is not a boolean (use 1/0, true/false, yes/no, on/off)");
    bad(VMM__OPT_ENABLE, "2", "is not a boolean");
    bad(VMM__OPT_STRICT, "yes please", "is not a boolean");

    bad(VMM__OPT_REGISTRY_CAPACITY, "lots", "is not an integer (use 1024..16777216)");
    bad(VMM__OPT_REGISTRY_CAPACITY, "12abc", "is not an integer");
    bad(VMM__OPT_REGISTRY_CAPACITY, "0x1000", "is not an integer");
    bad(VMM__OPT_REGISTRY_CAPACITY, "1023", "is out of range (use 1024..16777216)");
    bad(VMM__OPT_REGISTRY_CAPACITY, "16777217", "is out of range");
    bad(VMM__OPT_REGISTRY_CAPACITY, "99999999999999999999999", "is out of range");
    bad(VMM__OPT_FRAMES, "9", "is out of range (use 0..8)");
    bad(VMM__OPT_FRAMES, "-1", "is out of range");
    bad(VMM__OPT_FRAMES, "-", "is not an integer");

    bad(VMM__OPT_CACHE_SIZE, "12Q", "is not a size (use bytes or K/M/G/T suffix, 0..1T)");
    bad(VMM__OPT_CACHE_SIZE, "1.5G", "is not a size");
    bad(VMM__OPT_CACHE_SIZE, "-1", "is not a size");
    bad(VMM__OPT_CACHE_SIZE, "G", "is not a size");
    bad(VMM__OPT_CACHE_SIZE, "1KK", "is not a size");
    bad(VMM__OPT_CACHE_SIZE, "99999999999T", "is out of range (use bytes or K/M/G/T suffix, 0..1T)");
    bad(VMM__OPT_CACHE_SIZE, "99999999999999999999999", "is out of range");
    bad(VMM__OPT_CACHE_SIZE, "2T", "is out of range");
    bad(VMM__OPT_CACHE_SIZE, "1025G", "is out of range");
    /* the pinned memory kept between pauses: a bad value keeps the default (64G), in one line */
    bad(VMM__OPT_PAUSE_HOST_CACHE, "lots", "is not a size (use bytes or K/M/G/T suffix, 0..1T)");
    bad(VMM__OPT_PAUSE_HOST_CACHE, "-1", "is not a size");
    bad(VMM__OPT_PAUSE_HOST_CACHE, "2T", "is out of range");

    bad(VMM__OPT_LOG_LEVEL, "verbose", "is not one of error|warning|info|debug");
    bad(VMM__OPT_EXPORT, "fd", "is not one of broker|pidfd");
    bad(VMM__OPT_FABRIC, "on", "is not one of auto|off");

    bad(VMM__OPT_REGISTRY, "a/b", "is not a valid shm name");
    bad(VMM__OPT_REGISTRY, "/a/b", "is not a valid shm name");
    bad(VMM__OPT_REGISTRY, "/", "is not a valid shm name");
    long_name[0] = '/';
    memset(long_name + 1, 'r', 200);
    long_name[201] = 0; /* 201 chars */
    clear_env();
    setenv("VMMSHIM_REGISTRY", long_name, 1);
    CHECK_EQ(reload(), 0);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strstr(cap_buf, "is not a valid shm name") && strstr(cap_buf, "VMMSHIM_REGISTRY='/rrrr"), "%s", cap_buf);
    CHECK(strstr(cap_buf, "...'") != NULL, "long value shortened: %s", cap_buf);
    long_name[200] = 0; /* 200 chars: fine */
    good(VMM__OPT_REGISTRY, long_name, long_name);
    good(VMM__OPT_REGISTRY, long_name + 1, long_name); /* 199 without the '/': the same 200 */
    memset(long_name, 'r', 200); /* 200 without the '/': 201 with it */
    clear_env();
    setenv("VMMSHIM_REGISTRY", long_name, 1);
    CHECK_EQ(reload(), 0);
    CHECK(count_lines(cap_text()) == 1 && strstr(cap_buf, "is not a valid shm name") && fmt(VMM__OPT_REGISTRY)[0] == 0,
          "%s", cap_buf);

    bad(VMM__OPT_TAG, "01234567890123456789012345678901", "is too long (at most 31 bytes)");
    bad(VMM__OPT_BROKER_DIR, "relative/dir", "is not an absolute path");

    /* A newline inside the value cannot split the warning. */
    clear_env();
    setenv("VMMSHIM_FRAMES", "1\n2", 1);
    CHECK_EQ(reload(), 0);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strstr(cap_buf, "VMMSHIM_FRAMES='1 2'") != NULL, "%s", cap_buf);

    /* Several bad values: one line each. */
    clear_env();
    setenv("VMMSHIM_FRAMES", "x", 1);
    setenv("VMMSHIM_TAG", "01234567890123456789012345678901234", 1);
    setenv("VMMSHIM_FABRIC", "maybe", 1);
    CHECK_EQ(reload(), 0);
    CHECK_EQ(count_lines(cap_text()), 3);
}

static void test_file_and_env(void)
{
    const char *path = write_temp("good.conf",
        "# a comment\n"
        "\n"
        "   # an indented comment\n"
        "log_level = info\n"
        "VMMSHIM_FRAMES = 4\n"
        "Cache_Size = 2G   # trailing comment\n"
        "tag = \"a b # c\"\n"
        "registry_capacity=4096\r\n"
        "vmmshim_export = pidfd");
    clear_env();
    setenv("VMMSHIM_CONFIG", path, 1);
    setenv("VMMSHIM_FRAMES", "6", 1);
    CHECK_EQ(reload(), 0);
    CHECK(cap_text()[0] == 0, "%s", cap_buf);
    CHECK(strcmp(fmt(VMM__OPT_LOG_LEVEL), "info") == 0, "%s", fmt(VMM__OPT_LOG_LEVEL));
    CHECK(vmm__opt_source_of(VMM__OPT_LOG_LEVEL) == VMM__SRC_FILE, "log level source");
    CHECK_EQ(vmm__opt_int(VMM__OPT_FRAMES), 6);
    CHECK(vmm__opt_source_of(VMM__OPT_FRAMES) == VMM__SRC_ENV, "env wins");
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 2ULL << 30, "%llu", vmm__opt_size(VMM__OPT_CACHE_SIZE));
    CHECK(vmm__opt_source_of(VMM__OPT_CACHE_SIZE) == VMM__SRC_FILE, "cache source");
    CHECK(strcmp(vmm__opt_str(VMM__OPT_TAG), "a b # c") == 0, "'%s'", vmm__opt_str(VMM__OPT_TAG));
    CHECK_EQ(vmm__opt_int(VMM__OPT_REGISTRY_CAPACITY), 4096);
    CHECK_EQ(vmm__opt_enum(VMM__OPT_EXPORT), VMM__EXPORT_PIDFD);
    CHECK(strcmp(vmm__opt_str(VMM__OPT_CONFIG), path) == 0, "%s", vmm__opt_str(VMM__OPT_CONFIG));
    CHECK(vmm__opt_source_of(VMM__OPT_CONFIG) == VMM__SRC_ENV, "config source");
    CHECK(vmm__opt_source_of(VMM__OPT_FABRIC) == VMM__SRC_DEFAULT, "untouched");

    /* A bad value in the environment falls back to the file's value, and says so. */
    setenv("VMMSHIM_CACHE_SIZE", "12Q", 1);
    CHECK_EQ(reload(), 0);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strstr(cap_buf, "VMMSHIM_CACHE_SIZE='12Q' is not a size") && strstr(cap_buf, "; using 2G from "),
          "%s", cap_buf);
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 2ULL << 30 && vmm__opt_source_of(VMM__OPT_CACHE_SIZE) == VMM__SRC_FILE,
          "file value kept");

    /* Unknown key, malformed line, bad value, CONFIG inside a file: a file:line warning each. */
    char where[160];
    path = write_temp("bad.conf",
        "log_level = debug\n"
        "bogus_key = 1\n"
        "this line is malformed\n"
        "frames = 99\n"
        "config = /etc/other.conf\n"
        "log level = info\n");
    clear_env();
    setenv("VMMSHIM_CONFIG", path, 1);
    CHECK_EQ(reload(), 0);
    const char *t = cap_text();
    CHECK_EQ(count_lines(t), 5);
    snprintf(where, sizeof where, "vmmshim: warning: %s:2: unknown option 'bogus_key'; line ignored\n", path);
    CHECK(strstr(t, where) != NULL, "%s not in %s", where, t);
    snprintf(where, sizeof where, "vmmshim: warning: %s:3: expected 'key = value'; line ignored\n", path);
    CHECK(strstr(t, where) != NULL, "%s not in %s", where, t);
    snprintf(where, sizeof where, "vmmshim: warning: %s:4: VMMSHIM_FRAMES='99' is out of range (use 0..8); using default 0\n", path);
    CHECK(strstr(t, where) != NULL, "%s not in %s", where, t);
    snprintf(where, sizeof where, "%s:5: VMMSHIM_CONFIG is read only from the environment", path);
    CHECK(strstr(t, where) != NULL, "%s not in %s", where, t);
    snprintf(where, sizeof where, "%s:6: expected 'key = value'", path);
    CHECK(strstr(t, where) != NULL, "%s not in %s", where, t);
    CHECK_EQ(vmm__opt_enum(VMM__OPT_LOG_LEVEL), VMM__LOG_DEBUG); /* the good line still counts */

    /* A file that cannot be read. */
    clear_env();
    setenv("VMMSHIM_CONFIG", "/nonexistent/vmmshim.conf", 1);
    CHECK_EQ(reload(), 0);
    CHECK(strcmp(cap_text(), "vmmshim: warning: /nonexistent/vmmshim.conf: cannot read config file (No such "
                             "file or directory); file ignored\n") == 0, "%s", cap_buf);
    CHECK(strcmp(vmm__opt_str(VMM__OPT_CONFIG), "/nonexistent/vmmshim.conf") == 0, "config kept");

    /* A file over 64 KiB is refused whole rather than half read. */
    static char big[70 * 1024];
    memset(big, '#', sizeof big - 1);
    big[sizeof big - 1] = 0;
    path = write_temp("big.conf", big);
    setenv("VMMSHIM_CONFIG", path, 1);
    CHECK_EQ(reload(), 0);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strstr(cap_buf, "larger than 64 KiB") != NULL, "%s", cap_buf);
}

static void test_strict(void)
{
    clear_env();
    setenv("VMMSHIM_STRICT", "1", 1);
    setenv("VMMSHIM_CACHE_SIZE", "12Q", 1);
    CHECK_EQ(reload(), -1);
    CHECK(strcmp(cap_text(), "vmmshim: error: VMMSHIM_CACHE_SIZE='12Q' is not a size (use bytes or K/M/G/T "
                             "suffix, 0..1T); refused (VMMSHIM_STRICT=1)\n") == 0, "%s", cap_buf);
    CHECK(vmm__opt_size(VMM__OPT_CACHE_SIZE) == 0, "default kept");
    CHECK_EQ(vmm__opt_bool(VMM__OPT_STRICT), 1);
    CHECK_EQ(vmm__opt_init(), -1);

    /* Strict with nothing wrong. */
    unsetenv("VMMSHIM_CACHE_SIZE");
    CHECK_EQ(reload(), 0);
    CHECK(cap_text()[0] == 0, "%s", cap_buf);
    CHECK_EQ(vmm__opt_init(), 0);

    /* STRICT from the file applies to the environment's values and to the file itself. */
    const char *path = write_temp("strict.conf", "frames = 2\nstrict = yes\n");
    clear_env();
    setenv("VMMSHIM_CONFIG", path, 1);
    setenv("VMMSHIM_EXPORT", "carrier-pigeon", 1);
    CHECK_EQ(reload(), -1);
    CHECK_EQ(count_lines(cap_text()), 1);
    CHECK(strstr(cap_buf, "vmmshim: error: VMMSHIM_EXPORT='carrier-pigeon'") && strstr(cap_buf, "refused"),
          "%s", cap_buf);
    CHECK_EQ(vmm__opt_enum(VMM__OPT_EXPORT), VMM__EXPORT_BROKER);
    CHECK(vmm__opt_source_of(VMM__OPT_STRICT) == VMM__SRC_FILE && vmm__opt_bool(VMM__OPT_STRICT), "strict from file");

    path = write_temp("strict2.conf", "frames = 2\nunknown_thing = 3\nstrict = 1\n");
    setenv("VMMSHIM_CONFIG", path, 1);
    unsetenv("VMMSHIM_EXPORT");
    CHECK_EQ(reload(), -1);
    CHECK(count_lines(cap_text()) == 1 && strstr(cap_buf, "vmmshim: error: ") &&
          strstr(cap_buf, ":2: unknown option 'unknown_thing'; refused (VMMSHIM_STRICT=1)"), "%s", cap_buf);
    CHECK_EQ(vmm__opt_int(VMM__OPT_FRAMES), 2);

    /* The environment's STRICT wins over the file's. */
    setenv("VMMSHIM_STRICT", "0", 1);
    CHECK_EQ(reload(), 0);
    CHECK(strncmp(cap_text(), "vmmshim: warning: ", 18) == 0, "%s", cap_buf);

    clear_env();
    setenv("VMMSHIM_STRICT", "on", 1);
    setenv("VMMSHIM_CONFIG", "/nonexistent/x.conf", 1);
    CHECK_EQ(reload(), -1);
    CHECK(strstr(cap_text(), "vmmshim: error: /nonexistent/x.conf: cannot read config file") != NULL, "%s", cap_buf);

    clear_env();
    setenv("VMMSHIM_STRICT", "1", 1);
    setenv("VMMSHIM_TAG", "this tag is much longer than thirty-one bytes", 1);
    CHECK_EQ(reload(), -1);
    CHECK(strcmp(vmm__opt_str(VMM__OPT_TAG), "") == 0, "tag default");
}

static void test_verbose(void)
{
    char want[512], val[256];
    const char *path = write_temp("verbose.conf", "frames = 3\n");
    clear_env();
    setenv("VMMSHIM_VERBOSE", "1", 1);
    setenv("VMMSHIM_TAG", "run7", 1);
    setenv("VMMSHIM_CONFIG", path, 1);
    CHECK_EQ(reload(), 0);
    const char *t = cap_text();
    CHECK_EQ(count_lines(t), 1 + VMM__OPT_COUNT);
    snprintf(want, sizeof want, "vmmshim: info: vmmshim %s (options: 3 from the environment, 1 from %s, %d defaults)\n",
             VMM_VERSION_STRING, path, VMM__OPT_COUNT - 4);
    CHECK(strncmp(t, want, strlen(want)) == 0, "%s", t);
    for (int i = 0; i < VMM__OPT_COUNT; i++) {
        vmm__opt_id id = (vmm__opt_id)i;
        vmm__opt_format(id, val, sizeof val);
        snprintf(want, sizeof want, "vmmshim: info:   %s = %s (%s)\n", vmm__opt_name(id), val[0] ? val : "''",
                 vmm__opt_source_name(vmm__opt_source_of(id)));
        CHECK(strstr(t, want) != NULL, "'%s' not in %s", want, t);
    }
    CHECK(strstr(t, "VMMSHIM_TAG = run7 (env)") && strstr(t, "VMMSHIM_FRAMES = 3 (file)") &&
          strstr(t, "VMMSHIM_FABRIC = auto (default)"), "%s", t);

    /* `vmmctl config`: a header and one row per option. */
    cap_begin();
    vmm__opt_print_table(cap_fd, true);
    t = cap_text();
    CHECK_EQ(count_lines(t), 1 + VMM__OPT_COUNT);
    CHECK(strstr(t, "VARIABLE") && strstr(t, "SOURCE") && strstr(t, "VMMSHIM_TAG") && strstr(t, "run7"), "%s", t);
    cap_begin();
    vmm__opt_print_table(cap_fd, false);
    CHECK(count_lines(cap_text()) == 1 + VMM__OPT_COUNT && !strstr(cap_buf, "SOURCE"), "%s", cap_buf);
    clear_env();
    reload();
}

/* ------------------------------------------------------------------------------------- */
/* The documents generated from the table                                                 */

static char *read_file(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t n = fread(buf, 1, cap - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

static const char *srcdir(void)
{
    const char *s = getenv("VMMSHIM_TEST_SRCDIR");
    return s && s[0] ? s : ".";
}

static void test_readme(void)
{
    static char readme[256 * 1024];
    char path[4096];
    const char *begin = "<!-- options:begin -->", *end = "<!-- options:end -->";

    cap_begin();
    vmm__opt_print_markdown(cap_fd);
    const char *md = cap_text();
    CHECK_EQ(count_lines(md), 2 + VMM__OPT_COUNT);
    for (const char *l = md; *l;) { /* four columns: no stray '|' in a help line */
        int bars = 0;
        for (; *l && *l != '\n'; l++) bars += *l == '|';
        l += *l == '\n';
        CHECK_EQ(bars, 5);
    }

    snprintf(path, sizeof path, "%s/README.md", srcdir());
    if (!read_file(path, readme, sizeof readme)) {
        CHECK(0, "%s missing: it must hold the options table between %s and %s", path, begin, end);
        return;
    }
    char *b = strstr(readme, begin), *e = b ? strstr(b, end) : NULL;
    CHECK(b && e, "%s lacks the markers %s ... %s around the options table", path, begin, end);
    if (!b || !e) return;
    b += strlen(begin);
    while (b < e && (*b == '\n' || *b == ' ' || *b == '\r')) b++;
    while (e > b && (e[-1] == '\n' || e[-1] == ' ' || e[-1] == '\r')) e--;
    *e = 0;
    size_t mlen = strlen(md);
    CHECK(strlen(b) == mlen - 1 && strncmp(b, md, mlen - 1) == 0,
          "the options table in %s is out of date; run tests/scripts/gen_options_doc.sh and paste "
          "config/docs-options.md.\n--- README ---\n%s\n--- generated ---\n%s", path, b, md);
}

static void lower(char *s)
{
    for (; *s; s++) if (*s >= 'A' && *s <= 'Z') *s = (char)(*s - 'A' + 'a');
}

static void test_sample_conf(void)
{
    static char conf[64 * 1024];
    char path[4096];
    bool seen[VMM__OPT_COUNT] = {false}, helped[VMM__OPT_COUNT] = {false};

    snprintf(path, sizeof path, "%s/config/vmmshim.conf", srcdir());
    if (!read_file(path, conf, sizeof conf)) {
        CHECK(0, "%s missing", path);
        return;
    }
    for (char *line = strtok(conf, "\n"); line; line = strtok(NULL, "\n")) {
        char *p = line, key[128], val[256];
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '#') {
            CHECK(*p == 0, "%s: not commented out: %s", path, line);
            continue;
        }
        p++;
        while (*p == ' ') p++;
        for (int i = 0; i < VMM__OPT_COUNT; i++)
            if (strcmp(p, vmm__opt_help((vmm__opt_id)i)) == 0) helped[i] = true;
        char *eq = strchr(p, '=');
        if (!eq || (size_t)(eq - p) >= sizeof key) continue;
        snprintf(key, sizeof key, "%.*s", (int)(eq - p), p);
        for (char *k = key + strlen(key); k > key && k[-1] == ' '; ) *--k = 0;
        snprintf(val, sizeof val, "%s", eq + 1);
        char *v = val;
        while (*v == ' ') v++;
        for (char *z = v + strlen(v); z > v && z[-1] == ' '; ) *--z = 0;
        lower(key);
        for (int i = 0; i < VMM__OPT_COUNT; i++) {
            char name[64];
            snprintf(name, sizeof name, "%s", vmm__opt_name((vmm__opt_id)i));
            lower(name);
            if (strcmp(key, name) != 0 && strcmp(key, name + 8) != 0) continue;
            seen[i] = true;
            CHECK(strcmp(v, vmm__opt_default_text((vmm__opt_id)i)) == 0, "%s: %s = '%s', default is '%s'", path,
                  key, v, vmm__opt_default_text((vmm__opt_id)i));
        }
    }
    for (int i = 0; i < VMM__OPT_COUNT; i++) {
        CHECK(seen[i], "%s does not list %s at its default", path, vmm__opt_name((vmm__opt_id)i));
        CHECK(helped[i], "%s lacks the help line of %s: # %s", path, vmm__opt_name((vmm__opt_id)i),
              vmm__opt_help((vmm__opt_id)i));
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--markdown") == 0) {
        vmm__opt_print_markdown(STDOUT_FILENO);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--conf") == 0) {
        vmm__opt_print_conf(STDOUT_FILENO);
        return 0;
    }
    cap_fd = memfd_create("test_options", MFD_CLOEXEC);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/vmmshim-test-options-XXXXXX");
    if (cap_fd < 0 || !mkdtemp(tmpdir)) {
        perror("setup");
        return 1;
    }

    test_first_init_from_threads();
    test_table();
    test_good_values();
    test_bad_values();
    test_file_and_env();
    test_strict();
    test_verbose();
    test_readme();
    test_sample_conf();

    static const char *const made[] = {"good.conf", "bad.conf", "big.conf", "strict.conf", "strict2.conf",
                                       "verbose.conf"};
    for (size_t i = 0; i < sizeof made / sizeof *made; i++) {
        char path[128];
        snprintf(path, sizeof path, "%s/%s", tmpdir, made[i]);
        unlink(path);
    }
    rmdir(tmpdir);
    CHECK_DONE();
}
