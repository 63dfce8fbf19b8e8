"""python -m vmmshim list [--json] [--pid PID] [--all | --names] [--registry NAME]: vmmctl's `list`,
the same table and, with --json, byte for byte the same JSON (age_s aside, which ticks); --names
lists the tensors living processes publish by name, as `vmmctl list --names`.  The registry is
--registry, else $VMMSHIM_REGISTRY, else the per-user one: unlike vmmctl, no VMMSHIM_CONFIG file is
read.  Exit status: 0 ok, 1 the registry could not be read, 2 usage error; every error is one line.

python -m vmmshim run [--tag T] [--config F] [--keep] [--] CMD [ARGS...]: CMD under the shim
(_run.py).  python -m vmmshim doctor: whether the shim can work here (_doctor.py).  python -m
vmmshim path shim|client|lib|include|vmmctl: where the installed parts are (for LD_PRELOAD, -I,
-L).  The wheel's `vmmshim` console script is this module."""
import argparse
import os
import sys
import time

from . import OWNER_ALIVE, OWNER_DEAD, OWNER_KEPT, KIND_BROKER, KIND_FABRIC, KIND_PIDFD, Error, OwnerDead, Registry, Tensor
from ._group import _list_shards


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # one line, like vmmctl's usage errors
        self.exit(2, f"vmmshim: error: {message} (see python -m vmmshim --help)\n")


def _human(v):
    """512 B, 4.0 KiB, 2.0 MiB, 1.50 GiB: vmmctl's sizes."""
    if v < 1024:
        return f"{v} B"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    u, d = 0, float(v)
    while u < 6 and d >= 1024.0:
        d /= 1024.0
        u += 1
    if u < 6 and d >= (1023.95 if u < 3 else 1023.995):
        d /= 1024.0
        u += 1
    return f"{d:.1f} {units[u]}" if u < 3 else f"{d:.2f} {units[u]}"


def _kinds(k):
    return [n for bit, n in ((KIND_BROKER, "broker"), (KIND_PIDFD, "pidfd"), (KIND_FABRIC, "fabric")) if k & bit]


def _json_str(raw):
    """vmmctl's JSON string of registry bytes: UTF-8 kept, each byte that is not UTF-8 as \\ufffd."""
    out, i = ['"'], 0
    while i < len(raw):
        c = raw[i]
        if c in (0x22, 0x5C):
            out.append("\\" + chr(c))
            i += 1
        elif c < 0x20 or c == 0x7F:
            out.append(f"\\u{c:04x}")
            i += 1
        elif c < 0x80:
            out.append(chr(c))
            i += 1
        else:
            n = 4 if 0xF0 <= c <= 0xF4 else 3 if 0xE0 <= c < 0xF0 else 2 if 0xC2 <= c <= 0xDF else 0
            try:
                ch = raw[i:i + n].decode("utf-8") if n and i + n <= len(raw) else None
            except UnicodeDecodeError:
                ch = None
            out.append("\\ufffd" if ch is None else ch)
            i += 1 if ch is None else n
    out.append('"')
    return "".join(out)


def _held(a):
    # a shared chunk's allocation holds its extent; counting mapped_size would count the chunk once per allocation
    return a.extent or a.mapped_size


def _json_row(a, now, kept_by=None):
    age = (now - a.created_ns) // 1_000_000_000 if a.created_ns and a.created_ns < now else 0
    kinds = ", ".join(f'"{k}"' for k in _kinds(a.handle_kinds))
    frames = ", ".join(str(f) for f in a.frames)
    return (f'  {{"id": "{a.id}", "slot": {a.slot}, "generation": {a.generation}, "pid": {a.pid}, '
            f'"owner": "{a.owner}", "owner_start_time": {a.owner_start_time}, "owner_pidns": {a.owner_pidns}, '
            f'"device": {a.device}, "device_uuid": "{a.device_uuid}", "address": {a.address}, '
            f'"address_hex": "0x{a.address:x}", "requested_size": {a.size}, "mapped_size": {a.mapped_size}, '
            f'"chunk_id": {a.chunk_id}, "chunk_offset": {a.chunk_offset}, "extent": {_held(a)}, '
            f'"shared_chunk": {"true" if a.shared_chunk else "false"}, "n_handles": {a.n_handles}, '
            f'"paused": {"true" if a.paused else "false"}, "stream": {a.stream}, '
            f'"created_ns": {a.created_ns}, "age_s": {age}, "api": "{a.api}", "handle_kinds": [{kinds}], '
            f'"exported_fd": {a.exported_fd}, "kept_by": {"null" if kept_by is None else kept_by}, '
            f'"frames": [{frames}], "tag": {_json_str(a._info.tag)}}}')


def _table_row(a, now):
    age = (now - a.created_ns) // 1_000_000_000 if a.created_ns and a.created_ns < now else 0
    tag = "".join("?" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in a.tag) or "-"
    owner = {OWNER_ALIVE: "alive", OWNER_DEAD: "dead", OWNER_KEPT: "kept"}.get(a.owner_alive, "?")
    kinds = "paused" if a.paused else ",".join(_kinds(a.handle_kinds)) or "-"  # paused memory offers no handle
    return (f"{a.pid:7} {a.device:3} 0x{a.address:012x} {_human(a.size):>10} {_human(_held(a)):>10} {a.api:<15} "
            f"{kinds:<19} {owner:<5} {str(age) + 's':>7} {tag:<16} {a.id[16:]}")


def _list(args):
    now = time.time_ns()
    with Registry(args.registry) as reg:
        allocs = reg.allocations(args.pid)
        keepers = {a.pid: reg.keeper_of(a.pid) for a in allocs if a.owner_alive == OWNER_KEPT}
    shown = [a for a in allocs if args.all or a.owner_alive != OWNER_DEAD]
    if args.json:
        body = ",\n".join(_json_row(a, now, keepers.get(a.pid) if a.owner_alive == OWNER_KEPT else None)
                          for a in shown)
        return "[" + ("\n" + body + "\n" if shown else "") + "]\n"
    lines = [f"{'PID':>7} {'DEV':>3} {'ADDRESS':<14} {'SIZE':>10} {'MAPPED':>10} {'API':<15} {'KINDS':<19} "
             f"{'OWNER':<5} {'AGE':>7} {'TAG':<16} ID"]
    lines += [_table_row(a, now) for a in shown]
    n = len(shown)
    paused = sum(_held(a) for a in shown if a.paused)
    lines.append(f"{n} allocation{'' if n == 1 else 's'}, {_human(sum(a.size for a in shown))} requested, "
                 f"{_human(sum(_held(a) for a in shown))} mapped" + (f", {_human(paused)} of it paused" * bool(paused)))
    hidden = len(allocs) - n
    if hidden:
        lines.append(f"({hidden} more of dead processes not shown: `python -m vmmshim list --all` shows them, "
                     "`vmmctl gc` reclaims them)")
    return "\n".join(lines) + "\n"


_DTYPE_KINDS = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool", 10: "float8_e4m3fn",
                12: "float8_e5m2"}


def _dtype_name(code, bits, lanes):
    """vmmctl's: bfloat16, float8_e4m3fn, bool, float32x4, dlpack(code,bits) for others."""
    kind = _DTYPE_KINDS.get(code)
    name = f"dlpack({code},{bits})" if kind is None else kind if code == 6 or code >= 10 else f"{kind}{bits}"
    return name + (f"x{lanes}" if lanes > 1 else "")


def _cell(raw):
    """vmmctl's table cell of registry bytes: control bytes as '?', '-' when empty."""
    raw = raw.split(b"\0", 1)[0]
    return bytes(0x3F if b < 0x20 or b == 0x7F else b for b in raw).decode("utf-8", "surrogateescape") or "-"


def _place_text(shard, json):
    """As vmmctl's PLACE column: "Shard(0) 1/2 of 4096" per mesh dimension."""
    parts = []
    for p in shard.place[:min(shard.mesh_ndim, 3)]:
        kind = f"Shard({p.dim})" if p.kind == 3 else {1: "Replicate", 2: "Partial"}.get(p.kind, "?")
        if json:
            parts.append(f'{{"placement": "{kind}", "mesh": {p.mesh}, "coord": {p.coord}, '
                         f'"global_extent": {p.global_extent}}}')
        else:
            parts.append(f"{kind} {p.coord}/{p.mesh}" + (f" of {p.global_extent}" if p.kind == 3 else ""))
    return ", ".join(parts)


def _names(args):
    with Registry(args.registry) as reg:
        if args.pid:
            pids, asked = [args.pid], True
        else:
            pids, asked = [p.pid for p in reg.processes() if p.alive != OWNER_DEAD], False
        per = []
        for pid in pids:
            try:
                listed = [(Tensor(f), sh) for f, sh in _list_shards(reg, pid)]
                per.append(sorted(listed, key=lambda r: r[0]._name_raw))
            except OwnerDead:
                if asked:
                    raise
    rows = [r for rs in per for r in rs]
    if args.json:
        out = []
        for t, sh in rows:
            code, bits, lanes = t.dlpack_dtype
            dims = lambda v: ", ".join(str(x) for x in v)
            name = _json_str(t._name_raw.split(b"\0", 1)[0])
            out.append(f'  {{"pid": {t.pid}, "name": {name}, '
                       f'"dtype": "{_dtype_name(code, bits, lanes)}", "dtype_code": {code}, "dtype_bits": {bits}, '
                       f'"dtype_lanes": {lanes}, "shape": [{dims(t.shape)}], "strides": [{dims(t.strides)}], '
                       f'"address": {t.address}, "address_hex": "0x{t.address:x}", "nbytes": {t.nbytes}, '
                       f'"alloc_id": "{t.alloc_id}", "published_ns": {t.published_ns}, '
                       f'"version": {sh.version}, "shard": [{_place_text(sh.shard, True)}]}}')
        return "[" + ("\n" + ",\n".join(out) + "\n" if out else "") + "]\n"
    lines = [f"{'PID':>7} {'NAME':<40} {'DTYPE':<14} {'SHAPE':<24} {'ADDRESS':<14} {'SIZE':>10} PLACE"]
    for t, sh in rows:
        shape = "x".join(str(n) for n in t.shape) or "-"
        step, row_major = 1, True
        for n, st in zip(reversed(t.shape), reversed(t.strides)):
            if n > 1 and st != step:
                row_major = False
            step *= n
        if not row_major:
            shape += f" (strides {'x'.join(str(n) for n in t.strides) or '-'})"
        lines.append(f"{t.pid:7} {_cell(t._name_raw):<40} {_dtype_name(*t.dlpack_dtype):<14} {shape:<24} "
                     f"0x{t.address:012x} {_human(t.nbytes):>10} {_place_text(sh.shard, False) or '-'}")
    procs = sum(1 for ts in per if ts)
    lines.append(f"{len(rows)} name{'' if len(rows) == 1 else 's'} in {procs} process{'' if procs == 1 else 'es'}, "
                 f"{_human(sum(t.nbytes for t, _ in rows))}")
    return "\n".join(lines) + "\n"


def _pid(text):
    if not text.isdigit() or not 0 < int(text) <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"bad pid '{text}'")
    return int(text)


PATHS = {"shim": "shim_lib", "client": None, "lib": "lib_dir", "include": "include_dir", "vmmctl": "vmmctl",
         "tms": None}


def _path(argv, prog):
    from . import _paths
    if len(argv) != 1 or argv[0] not in PATHS:
        sys.stderr.write(f"vmmshim: error: path takes one of {', '.join(PATHS)} (see {prog} --help)\n")
        return 2
    what = argv[0]
    if what == "client":
        found = next((p for p in _paths.client_lib_candidates() if os.path.isfile(p)), None)
    elif what == "tms":  # the directory whose torch_memory_saver is vmmshim's stand-in
        found = _paths.tms_dir()
    else:
        found = getattr(_paths, PATHS[what])()
    if not found:
        sys.stderr.write(f"vmmshim: error: {what}: not found (not bundled, no build/)\n")
        return 1
    print(os.path.abspath(found))
    return 0


def main(argv=None, prog="python -m vmmshim"):
    argv = sys.argv[1:] if argv is None else list(argv)
    # run takes CMD's own options after its own, and doctor and path take none of list's: neither
    # goes through list's parser
    if argv and argv[0] == "run":
        from . import _run
        return _run.main(argv[1:])
    if argv and argv[0] == "doctor":
        from . import _doctor
        return _doctor.main(argv[1:])
    if argv and argv[0] == "path":
        return _path(argv[1:], prog)
    p = _Parser(prog=prog, description="Inspect the vmmshim registry (as vmmctl); run a program under the shim "
                "(run); check that the shim can work here (doctor); print where its parts are (path).",
                epilog="also: run [--tag T] [--config F] [--keep] [--torch-memory-saver] [--] CMD [ARGS...]  |  doctor  |  "
                "path shim|client|lib|include|vmmctl|tms   (run -h, doctor -h)")
    p.add_argument("--registry", metavar="NAME", help="registry name (default: $VMMSHIM_REGISTRY, else per user)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ls = sub.add_parser("list", help="one row per live allocation")
    ls.add_argument("--pid", type=_pid, help="only this process's allocations")
    ls.add_argument("--json", action="store_true", help="JSON, as `vmmctl list --json`")
    ls.add_argument("--all", action="store_true", help="dead processes' allocations too")
    ls.add_argument("--names", action="store_true", help="the tensors living processes publish by name")
    ls.add_argument("--registry", metavar="NAME", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.names and args.all:
        p.error("list: --names shows living processes only (a dead one's names went with it); drop --all")
    try:
        text = _names(args) if args.names else _list(args)
    except Error as e:
        print(f"vmmshim: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
    sys.stdout.flush()
    return 0


def entry():
    """The `vmmshim` console script."""
    sys.exit(main(prog="vmmshim"))


if __name__ == "__main__":
    sys.exit(main())
