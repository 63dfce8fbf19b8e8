/* What vmmctl's command files share (defined in format.c): exit codes, one-line errors, argument
 * parsing, the registry to open, and the formatting every listing uses. */
#ifndef VMMCTL_FORMAT_H
#define VMMCTL_FORMAT_H
#include "vmmshim.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum { EXIT_OK = 0, EXIT_PROBLEMS = 1, EXIT_USAGE = 2 };

/* "vmmctl: error: MSG (see vmmctl --help)" on stderr, exit 2. */
__attribute__((format(printf, 1, 2), noreturn)) void vmm__ctl_usage_error(const char *fmt, ...);
/* "vmmctl: error: MSG" on stderr (one line, whatever MSG holds); returns EXIT_PROBLEMS. */
__attribute__((format(printf, 1, 2))) int vmm__ctl_error(const char *fmt, ...);
/* vmm__ctl_error with the client library's reason for st. */
int vmm__ctl_api_error(vmm_status st);

/* --registry NAME / --registry=NAME at argv[*i] (taking its value): true when it was one. */
bool vmm__ctl_take_registry(int argc, char **argv, int *i);
/* A pid or an address argument; anything else is a usage error. */
uint32_t vmm__ctl_parse_pid(const char *s);
uint64_t vmm__ctl_parse_addr(const char *s);
/* The registry name --registry gave, else the option's; NULL: the per-user default. */
const char *vmm__ctl_registry_name(void);
/* The registry the shim would use; EXIT_OK, or the error printed and EXIT_PROBLEMS. */
int vmm__ctl_open_registry(vmm_registry **reg, bool writable);

typedef struct {
    char s[32];
} hbuf;
/* 512 B, 4.0 KiB, 2.0 MiB, 1.50 GiB. */
const char *vmm__ctl_human(uint64_t v, hbuf *b);
const char *vmm__ctl_api_name(uint32_t api);
/* alive, dead, kept (dead, its memory held by a keeper), and "?" (json: "unknown") for an owner
 * in another pid namespace. */
const char *vmm__ctl_owner_name(int alive, bool json);
/* The handle kinds of a record: "broker,pidfd", "-" for none. */
const char *vmm__ctl_kinds_text(uint32_t k, char *buf, size_t len);
/* s for a table cell: control characters as '?', "-" when empty. */
const char *vmm__ctl_cell(const char *s, char *buf, size_t len);
/* 2n lowercase hex digits of p, NUL-terminated. */
void vmm__ctl_hex(const uint8_t *p, size_t n, char *out);
/* s as a JSON string (bytes that are not UTF-8 become U+FFFD). */
void vmm__ctl_json_str(FILE *f, const char *s);
/* CLOCK_REALTIME in ns. */
uint64_t vmm__ctl_now_ns(void);
/* Whole seconds from created_ns to now (0 when unknown or in the future). */
uint64_t vmm__ctl_age_s(uint64_t created_ns, uint64_t now);
/* The bytes an allocation holds: its extent of a shared chunk, else its mapped size. */
uint64_t vmm__ctl_held_bytes(const vmm_alloc_info *a);

/* "pid N: kept by keeper pid K since T; it <ended how>" for a kept process (nothing otherwise). */
void vmm__ctl_keeper_line(vmm_registry *reg, uint32_t pid);
/* How a kept process ended (VMM_END_*), in words: "killed by signal 9 (SIGKILL)". */
const char *vmm__ctl_end_text(int kind, int value, char *buf, size_t len);

/* FNV-1a 64 (what the shim's tests and companions compare bytes with): start from
 * VMM__FNV_BASIS, feed the bytes in order. */
#define VMM__FNV_BASIS 0xcbf29ce484222325ull
uint64_t vmm__ctl_fnv1a(uint64_t h, const void *p, size_t n);
#endif
