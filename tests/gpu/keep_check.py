"""keep.sh's companion: after the trainer (keep_train.py) died and `vmmctl keep` kept it, open its
named tensors by its dead pid (Registry.open_tensors), check each one's FNV-1a against the
trainer's last printed ones, rebuild the model from them and check its logits of the probe batch
against the trainer's last printed logits (bit for bit; the largest difference is printed).
  keep_check.py FRAMEWORK PID TRAINER_OUTPUT
Prints PASS/FAIL lines; exit 1 on any FAIL."""
import ctypes
import sys

import keep_train as kt
import vmmshim


def jax_array(view):
    import jax
    try:
        return jax.dlpack.from_dlpack(view)
    except TypeError:  # a JAX that takes capsules only
        return jax.dlpack.from_dlpack(view.__dlpack__())


def main():
    framework, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    fnvs, logits, final = {}, {}, None
    for line in open(out):
        f = line.split()
        if f and f[0] == "fnv":
            fnvs.setdefault(int(f[1]), {})[f[2]] = f[3]
        elif f and f[0] == "logits":
            logits[int(f[1])] = [float.fromhex(v) for v in f[2:]]
        elif f and f[0] == "final":
            final = int(f[1])
    fails = 0

    def check(ok, what):
        nonlocal fails
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        fails += not ok
        return ok

    if not check(final is not None and final in fnvs and final in logits, f"the trainer's last step ({final}) printed"):
        return 1
    with vmmshim.Registry() as reg:
        proc = reg.process(pid)
        check(proc.state == "kept", f"pid {pid} reads as {proc.state}, kept by keeper pid {reg.keeper_of(pid)}")
        views = reg.open_tensors(pid)
        check(sorted(views) == sorted(fnvs[final]), f"its named tensors: {sorted(views)}")
        got = {}
        for name, v in views.items():
            if framework == "stub":
                data = ctypes.string_at(v.ptr, v.nbytes)
            elif framework == "torch":
                import torch
                data = torch.from_dlpack(v).contiguous().cpu().numpy().tobytes()
            else:
                import numpy as np
                data = np.asarray(jax_array(v)).tobytes()
            got[name] = data
            check(kt.fnv(data) == fnvs[final].get(name), f"{name}: fnv {kt.fnv(data)} (the trainer's "
                  f"{fnvs[final].get(name)})")
        if framework == "stub":
            rebuilt = kt.stub_logits(got)
        elif framework == "torch":
            import torch
            model, probe = kt.torch_model()  # same architecture and probe; its weights replaced
            with torch.no_grad():
                state = model.state_dict()
                for name, t in state.items():
                    t.copy_(torch.from_dlpack(views[name]))
                rebuilt = model(probe).flatten().tolist()
            torch.cuda.synchronize()
        else:
            import jax
            _, probe = kt.jax_model()
            params = {n: jax_array(views[n]) for n in views}
            rebuilt = [float(x) for x in kt.jax_forward(params, probe).reshape(-1).tolist()]
        want = logits[final]
        diff = max(abs(a - b) for a, b in zip(rebuilt, want)) if len(rebuilt) == len(want) else float("inf")
        scale = max(abs(b) for b in want) if want else 1.0
        exact = rebuilt == want
        # the same kernels on the same GPU give the same bits; a library picking another kernel in
        # a fresh process may differ in the last bits, which is said
        check(exact or diff <= 1e-5 * max(scale, 1.0),
              f"the rebuilt model's logits equal the trainer's last ones ({len(want)} values, "
              f"{'bit for bit' if exact else f'not bit for bit: largest difference {diff:.3g} of {scale:.3g}'})")
        del views
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
