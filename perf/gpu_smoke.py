"""gpu_check.sh stage 1: the toolchain every Triton launch needs, checked in seconds.

Triton builds a C launcher for each new kernel signature on its first launch (a C compiler
and Python.h), so without them every Triton call raises; this finds that out before the
timed stages. Checks, in order: torch and its CUDA device, triton, a C compiler (as Triton
looks for one: $CC, else gcc, else clang), Python.h, and one tiny Triton kernel launched and
its result checked. Prints one line per check; exit 0 when all pass, 1 otherwise (the
message says what is missing). Under TRITON_INTERPRET=1 on a CPU (gpu_check.sh --dry-run)
the kernel runs in the interpreter and a missing GPU is reported, not failed.

    python perf/gpu_smoke.py
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time


def c_compiler() -> str | None:
    """The C compiler Triton's launcher build would use, or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def python_header() -> str | None:
    """Path of Python.h for this interpreter (the scheme Triton's build uses), or None."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    path = os.path.join(sysconfig.get_paths(scheme=scheme)["include"], "Python.h")
    return path if os.path.exists(path) else None


def main() -> int:
    t0 = time.time()
    problems = []
    dry = os.environ.get("TRITON_INTERPRET") == "1"
    print(f"python {sys.executable} {sys.version.split()[0]}")
    import torch
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__} cuda {torch.version.cuda} device "
          f"{torch.cuda.get_device_name() + ' ' + str(torch.cuda.get_device_capability()) if cuda else 'none'}")
    if not cuda and not dry:
        problems.append("no CUDA GPU visible to torch")
    try:
        import triton
        import triton.language as tl
        print(f"triton {triton.__version__}")
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL: triton does not import ({type(exc).__name__}: {exc})")
        return 1
    cc, header = c_compiler(), python_header()
    print(f"C compiler: {cc or 'MISSING'}; Python.h: {header or 'MISSING'}")
    if not dry:   # the interpreter builds no launcher
        if not cc:
            problems.append("no C compiler (Triton builds a launcher per kernel signature: install gcc or set CC)")
        if not header:
            problems.append(f"no Python.h under {sysconfig.get_paths()['include']} (install the python dev headers)")

    @triton.jit
    def _axpy(X, Y, OUT, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(OUT + i, 2.0 * tl.load(X + i, mask=ok) + tl.load(Y + i, mask=ok), mask=ok)

    if not problems:
        device = "cuda" if cuda else "cpu"
        try:
            x = torch.arange(1000, dtype=torch.float32, device=device)
            y = torch.ones_like(x)
            out = torch.empty_like(x)
            t1 = time.time()
            _axpy[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
            ok = torch.equal(out.cpu(), (2 * x + y).cpu())
            print(f"tiny Triton kernel on {device}: {'correct' if ok else 'WRONG RESULT'} "
                  f"(compile and launch {time.time() - t1:.1f} s)")
            if not ok:
                problems.append("the tiny Triton kernel computed a wrong result")
        except Exception as exc:  # noqa: BLE001
            text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            problems.append(f"the tiny Triton kernel failed: {type(exc).__name__}: {text[-500:]}")
    if problems:
        print("FAIL: " + "; ".join(problems))
        print("Every Triton kernel launch would fail the same way: fix this first (nothing else was run).")
        return 1
    print(f"toolchain OK in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
