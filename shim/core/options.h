/* Every VMMSHIM_* setting, declared once in the table in options.c and read through the
 * typed getters below.  The getters initialise lazily, so they may be called from anywhere
 * (constructors, CUDA hooks, the client library, vmmctl); nothing here allocates heap memory. */
#ifndef VMM_CORE_OPTIONS_H
#define VMM_CORE_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>

typedef enum {
    VMM__OPT_STRICT,
    VMM__OPT_VERBOSE,
    VMM__OPT_LOG_LEVEL,
    VMM__OPT_LOG_FILE,
    VMM__OPT_CONFIG,
    VMM__OPT_ENABLE,
    VMM__OPT_REGISTRY,
    VMM__OPT_REGISTRY_GROUP,
    VMM__OPT_REGISTRY_CAPACITY,
    VMM__OPT_CACHE_SIZE,
    VMM__OPT_GIVE_BACK_MS,
    VMM__OPT_GIVE_BACK_HOLD,
    VMM__OPT_ISOLATE,
    VMM__OPT_ADOPT,
    VMM__OPT_EXPORT,
    VMM__OPT_PREEXPORT_MS,
    VMM__OPT_PREEXPORT_FDS,
    VMM__OPT_BROKER_DIR,
    VMM__OPT_BROKER_GROUP,
    VMM__OPT_FABRIC,
    VMM__OPT_TAG,
    VMM__OPT_FRAMES,
    VMM__OPT_STATS,
    VMM__OPT_PAUSE_DIR,
    VMM__OPT_PAUSE_HOLD_WAIT_MS,
    VMM__OPT_PAUSE_HOST_CACHE,
    VMM__OPT_REMOTE_PAUSE,
    VMM__OPT_SLEEP_ADOPTED,
    VMM__OPT_PAUSE_GUARD,
    VMM__OPT_COUNT
} vmm__opt_id;

typedef enum { VMM__SRC_DEFAULT, VMM__SRC_FILE, VMM__SRC_ENV } vmm__opt_source;

/* Indices returned by vmm__opt_enum(); VMMSHIM_LOG_LEVEL's indices are vmm__log_level. */
enum { VMM__EXPORT_BROKER, VMM__EXPORT_PIDFD };
enum { VMM__FABRIC_AUTO, VMM__FABRIC_OFF };

/* Idempotent and thread-safe.  Returns 0, or -1 when VMMSHIM_STRICT=1 refused a bad value
 * or config file; the refused options still hold their defaults. */
int vmm__opt_init(void);

bool vmm__opt_bool(vmm__opt_id id);
long long vmm__opt_int(vmm__opt_id id);
unsigned long long vmm__opt_size(vmm__opt_id id);
int vmm__opt_enum(vmm__opt_id id);     /* index into the option's value list */
const char *vmm__opt_str(vmm__opt_id id); /* never NULL; "" when unset */

const char *vmm__opt_name(vmm__opt_id id);         /* "VMMSHIM_LOG_LEVEL" */
int vmm__opt_format(vmm__opt_id id, char *buf, size_t len); /* like snprintf; -1 for a bad id */
vmm__opt_source vmm__opt_source_of(vmm__opt_id id);
const char *vmm__opt_source_name(vmm__opt_source src); /* "default", "file", "env" */
const char *vmm__opt_help(vmm__opt_id id);
const char *vmm__opt_type_name(vmm__opt_id id);    /* "bool", "integer", "size", "enum", "string" */
const char *vmm__opt_default_text(vmm__opt_id id); /* "1G", "warning", "" */

/* `vmmctl config`: one row per option: name, value, [source,] help. */
void vmm__opt_print_table(int fd, bool with_source);
/* The README table (| Variable | Type | Default | Meaning |), generated so it cannot drift. */
void vmm__opt_print_markdown(int fd);
/* The sample config file: every option commented out at its default, help as a comment. */
void vmm__opt_print_conf(int fd);

/* Re-reads the environment and config file as if the process had just started; tests only. */
int vmm__opt_reload_for_test(void);

/* For log.c: true when the option values may be read now.  Initialises them if needed, but
 * answers false instead when this thread is the one initialising them (their own warnings
 * must not wait for themselves). */
bool vmm__opt_usable(void);

#endif
