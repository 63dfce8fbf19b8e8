"""python -m vmmshim list [--json] [--pid PID] [--all] [--registry NAME]: vmmctl's `list`, the same
table and, with --json, byte for byte the same JSON (age_s aside, which ticks).  The registry is
--registry, else $VMMSHIM_REGISTRY, else the per-user one: unlike vmmctl, no VMMSHIM_CONFIG file is
read.  Exit status: 0 ok, 1 the registry could not be read, 2 usage error; every error is one line."""
import argparse
import sys
import time

from . import OWNER_ALIVE, OWNER_DEAD, OWNER_KEPT, KIND_BROKER, KIND_FABRIC, KIND_PIDFD, Error, Registry


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
            f'"shared_chunk": {"true" if a.shared_chunk else "false"}, "n_handles": {a.n_handles}, "stream": {a.stream}, '
            f'"created_ns": {a.created_ns}, "age_s": {age}, "api": "{a.api}", "handle_kinds": [{kinds}], '
            f'"exported_fd": {a.exported_fd}, "kept_by": {"null" if kept_by is None else kept_by}, '
            f'"frames": [{frames}], "tag": {_json_str(a._info.tag)}}}')


def _table_row(a, now):
    age = (now - a.created_ns) // 1_000_000_000 if a.created_ns and a.created_ns < now else 0
    tag = "".join("?" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in a.tag) or "-"
    owner = {OWNER_ALIVE: "alive", OWNER_DEAD: "dead", OWNER_KEPT: "kept"}.get(a.owner_alive, "?")
    return (f"{a.pid:7} {a.device:3} 0x{a.address:012x} {_human(a.size):>10} {_human(_held(a)):>10} {a.api:<15} "
            f"{','.join(_kinds(a.handle_kinds)) or '-':<19} {owner:<5} {str(age) + 's':>7} {tag:<16} {a.id[16:]}")


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
    lines.append(f"{n} allocation{'' if n == 1 else 's'}, {_human(sum(a.size for a in shown))} requested, "
                 f"{_human(sum(_held(a) for a in shown))} mapped")
    hidden = len(allocs) - n
    if hidden:
        lines.append(f"({hidden} more of dead processes not shown: `python -m vmmshim list --all` shows them, "
                     "`vmmctl gc` reclaims them)")
    return "\n".join(lines) + "\n"


def _pid(text):
    if not text.isdigit() or not 0 < int(text) <= 2**31 - 1:
        raise argparse.ArgumentTypeError(f"bad pid '{text}'")
    return int(text)


def main(argv=None):
    p = _Parser(prog="python -m vmmshim", description="Inspect the vmmshim registry (as vmmctl).")
    p.add_argument("--registry", metavar="NAME", help="registry name (default: $VMMSHIM_REGISTRY, else per user)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ls = sub.add_parser("list", help="one row per live allocation")
    ls.add_argument("--pid", type=_pid, help="only this process's allocations")
    ls.add_argument("--json", action="store_true", help="JSON, as `vmmctl list --json`")
    ls.add_argument("--all", action="store_true", help="dead processes' allocations too")
    ls.add_argument("--registry", metavar="NAME", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        text = _list(args)
    except Error as e:
        print(f"vmmshim: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(text.encode("utf-8"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
