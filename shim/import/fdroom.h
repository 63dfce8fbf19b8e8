/* Room in the process's fd table for the handles a take receives (fdroom.c). */
#ifndef VMM_FDROOM_H
#define VMM_FDROOM_H

/* Once per process, in a thread of its own: grow the fd table past what a take will need. */
void vmm__fd_room_grow(void);

#endif
