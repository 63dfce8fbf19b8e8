/* vmmctl's commands, one family to a file, as main (vmmctl.c) dispatches to them; what they
 * share lives below them in format.h. */
#ifndef VMMCTL_H
#define VMMCTL_H
#include <stdbool.h>
#include <stdint.h>

/* list.c: list and ps. */
int vmm__ctl_cmd_list(int argc, char **argv);
int vmm__ctl_cmd_ps(int argc, char **argv);
/* names.c: list --names, the named tensors of pid (0: of every living process). */
int vmm__ctl_list_names(uint32_t pid, bool json);
/* check.c: check, gc and config. */
int vmm__ctl_cmd_check(int argc, char **argv);
int vmm__ctl_cmd_gc(int argc, char **argv);
int vmm__ctl_cmd_config(int argc, char **argv);
/* show.c: show and import-test. */
int vmm__ctl_cmd_show(int argc, char **argv);
int vmm__ctl_cmd_import_test(int argc, char **argv);
/* dump.c, watch.c. */
int vmm__ctl_cmd_dump(int argc, char **argv);
int vmm__ctl_cmd_watch(int argc, char **argv);
/* keep.c: vmmctl keep (a keeper, shim/registry/layout.h KEEP) and vmmctl release. */
int vmm__ctl_cmd_keep(int argc, char **argv);
int vmm__ctl_cmd_release(int argc, char **argv);
/* sleep.c: vmmctl pause and resume (vmm_pause_process, vmm_resume_process). */
int vmm__ctl_cmd_pause(int argc, char **argv);
int vmm__ctl_cmd_resume(int argc, char **argv);
#endif
