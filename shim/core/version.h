/* The one place the version lives: the shim, the client library and vmmctl all print it. */
#ifndef VMM_CORE_VERSION_H
#define VMM_CORE_VERSION_H

#define VMM_VERSION_MAJOR 0
#define VMM_VERSION_MINOR 1
#define VMM_VERSION_PATCH 0
#define VMM_VERSION_STRING "0.1.0"

#endif
