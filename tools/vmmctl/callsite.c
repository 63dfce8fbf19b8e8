/* Call sites a person can read.  A record carries raw return addresses in its owner; the owner
 * names each one once in its frames file (layout.h, FRAMES), which outlives it until gc, so the
 * names come from there first.  An address the file lacks is looked up in the owner's
 * /proc/<pid>/maps while it lives.  The owner names a function only from its exported symbols;
 * for the rest, the module's own .symtab (or .dynsym) is read here, a best effort: the file on
 * disk is taken to be the one that was mapped. */
#include "callsite.h"

#include "registry/layout.h"

#include <fcntl.h>
#include <link.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define FRAMES_FILE_MAX (64u << 20) /* a file of a million distinct addresses is no file of ours */

typedef struct {
    char module[PATH_MAX];
    uint64_t offset;
    char function[512]; /* "" when unknown */
} site;

/* The whole frames file of the owner, NUL-terminated; NULL when it has none. */
static char *read_frames_file(const char *registry, const vmm_alloc_info *a)
{
    char name[320];
    if (snprintf(name, sizeof name, VMM_REG_FRAMES_NAME, registry, a->pid, (unsigned long long)a->owner_start_time) >=
        (int)sizeof name)
        return NULL;
    int fd = shm_open(name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
    struct stat st;
    char *text = NULL;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size <= FRAMES_FILE_MAX &&
        (text = malloc((size_t)st.st_size + 1))) {
        ssize_t n = pread(fd, text, (size_t)st.st_size, 0);
        text[n > 0 ? n : 0] = 0;
    }
    if (fd >= 0) close(fd);
    return text;
}

/* "0x<address> 0x<offset> <function> <module to the end of the line>" */
static bool from_file(const char *text, uint64_t pc, site *s)
{
    for (const char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) next++;
        if (*line == '#') continue;
        char *end;
        if (strtoull(line, &end, 16) != pc || *end != ' ') continue;
        s->offset = strtoull(end + 1, &end, 16);
        if (*end != ' ') continue;
        const char *fn = end + 1, *sp = strchr(fn, ' '), *eol = strchr(fn, '\n');
        if (!sp || (eol && sp > eol)) continue;
        size_t flen = (size_t)(sp - fn), mlen = eol ? (size_t)(eol - sp - 1) : strlen(sp + 1);
        snprintf(s->function, sizeof s->function, "%.*s", (int)flen, fn);
        if (!strcmp(s->function, "?")) s->function[0] = 0;
        snprintf(s->module, sizeof s->module, "%.*s", (int)mlen, sp + 1);
        return true;
    }
    return false;
}

/* The mapping of a living owner that holds pc; its module's base is where the file's first
 * bytes are mapped. */
static bool from_maps(uint32_t pid, uint64_t pc, site *s)
{
    char path[64], line[PATH_MAX + 128], base_path[PATH_MAX] = "";
    snprintf(path, sizeof path, "/proc/%u/maps", pid);
    FILE *f = fopen(path, "re");
    if (!f) return false;
    unsigned long long base = 0;
    bool found = false;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, off;
        int at = 0;
        if (sscanf(line, "%llx-%llx %*s %llx %*s %*s %n", &lo, &hi, &off, &at) != 3 || !at) continue;
        char *name = line + at;
        name[strcspn(name, "\n")] = 0;
        if (name[0] != '/') continue;
        if (off == 0) {
            base = lo;
            snprintf(base_path, sizeof base_path, "%s", name);
        }
        if (pc < lo || pc >= hi) continue;
        snprintf(s->module, sizeof s->module, "%s", name);
        s->offset = pc - (strcmp(base_path, name) == 0 ? base : lo - off);
        s->function[0] = 0;
        found = true;
    }
    fclose(f);
    return found;
}

/* The function of module holding the byte at `offset` from where its ELF header is mapped. */
static void from_elf(const char *module, uint64_t offset, char *out, size_t len)
{
    int fd = open(module, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0) return;
    const uint8_t *m = fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(ElfW(Ehdr))
                           ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0)
                           : MAP_FAILED;
    close(fd);
    if (m == MAP_FAILED) return;
    size_t size = (size_t)st.st_size;
    const ElfW(Ehdr) *eh = (const ElfW(Ehdr) *)m;
    bool ok = !memcmp(eh->e_ident, ELFMAG, SELFMAG) && eh->e_ident[EI_CLASS] == (sizeof(void *) == 8 ? ELFCLASS64 : ELFCLASS32) &&
              eh->e_phentsize == sizeof(ElfW(Phdr)) && eh->e_shentsize == sizeof(ElfW(Shdr)) &&
              eh->e_phoff <= size && eh->e_phnum <= (size - eh->e_phoff) / sizeof(ElfW(Phdr)) && eh->e_shoff <= size &&
              eh->e_shnum <= (size - eh->e_shoff) / sizeof(ElfW(Shdr));
    /* file offset 0 is mapped at the first PT_LOAD's p_vaddr - p_offset */
    const ElfW(Phdr) *ph = ok ? (const ElfW(Phdr) *)(m + eh->e_phoff) : NULL;
    int load = -1;
    for (int i = 0; ok && i < eh->e_phnum && load < 0; i++)
        if (ph[i].p_type == PT_LOAD) load = i;
    uint64_t want = load >= 0 ? offset - 1 + ph[load].p_vaddr - ph[load].p_offset : 0; /* -1: the call, not its return */
    const ElfW(Shdr) *sh = ok ? (const ElfW(Shdr) *)(m + eh->e_shoff) : NULL;
    static const unsigned kinds[] = {SHT_SYMTAB, SHT_DYNSYM}; /* the full table first: it has the static functions */
    for (size_t t = 0; load >= 0 && t < 2 && !*out; t++) {
        for (int i = 0; i < eh->e_shnum && !*out; i++) {
            if (sh[i].sh_type != kinds[t] || sh[i].sh_link >= eh->e_shnum || sh[i].sh_offset > size ||
                sh[i].sh_size > size - sh[i].sh_offset || sh[i].sh_entsize != sizeof(ElfW(Sym)))
                continue;
            const ElfW(Shdr) *strs = &sh[sh[i].sh_link];
            if (strs->sh_offset > size || strs->sh_size > size - strs->sh_offset) continue;
            const ElfW(Sym) *sym = (const ElfW(Sym) *)(m + sh[i].sh_offset);
            const char *names = (const char *)(m + strs->sh_offset);
            for (size_t k = 0; k < sh[i].sh_size / sizeof *sym; k++) {
                unsigned type = ELF64_ST_TYPE(sym[k].st_info); /* the same low 4 bits in ELF32 */
                if ((type != STT_FUNC && type != STT_GNU_IFUNC) || sym[k].st_shndx == SHN_UNDEF ||
                    want < sym[k].st_value || want - sym[k].st_value >= sym[k].st_size || sym[k].st_name >= strs->sh_size)
                    continue;
                snprintf(out, len, "%.*s", (int)strnlen(names + sym[k].st_name, strs->sh_size - sym[k].st_name),
                         names + sym[k].st_name);
                break;
            }
        }
    }
    munmap((void *)m, size);
}

void vmm__callsites_print(const char *registry, const vmm_alloc_info *a)
{
    char *text = a->n_frames ? read_frames_file(registry, a) : NULL;
    for (uint32_t i = 0; i < a->n_frames && i < 8; i++) {
        site s;
        uint64_t pc = a->frames[i];
        if (!(text && from_file(text, pc, &s)) && !(a->owner_alive == VMM_OWNER_ALIVE && from_maps(a->pid, pc, &s))) {
            printf("frame %u      0x%llx\n", i, (unsigned long long)pc);
            continue;
        }
        if (!s.function[0]) from_elf(s.module, s.offset, s.function, sizeof s.function);
        const char *slash = strrchr(s.module, '/');
        printf("frame %u      %s+0x%llx", i, slash ? slash + 1 : s.module, (unsigned long long)s.offset);
        if (s.function[0]) printf(" (%s)", s.function);
        putchar('\n');
    }
    free(text);
}
