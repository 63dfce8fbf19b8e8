/* vmmctl's reading of an allocation's call-site frames as `module+0xoffset (function)`. */
#ifndef VMMCTL_CALLSITE_H
#define VMMCTL_CALLSITE_H
#include "vmmshim.h"

/* One "frame N      ..." line per frame of a, named from its owner's frames file beside the
 * registry `registry` (layout.h, FRAMES), else, while the owner lives, from /proc/<pid>/maps;
 * functions the file leaves unnamed are looked up in the module's own symbol tables. */
void vmm__callsites_print(const char *registry, const vmm_alloc_info *a);
#endif
