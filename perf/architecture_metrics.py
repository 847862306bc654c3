"""The host-side layer's numbers the way architecture review 2 took them (its appendix A1-A3):
lines, the files naming softcap, the largest @triton.jit signatures, the switch product over
the launched kernels and the constexprs that compile once per value.

    python perf/architecture_metrics.py [ROOT]      (default: this checkout)
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

# constexprs that are tiles or arithmetic modes, not switches (appendix A2)
NOT_SWITCHES = {"HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "BLOCK_SIZE", "DOT_MODE", "PRECISION"}
# constexprs whose every value is a compile of its own
VALUE_SPECIALISED = {"SOFTCAP", "WINDOW", "SINK_TOKENS", "PAGE_SIZE", "NUM_PATTERNS"}


def python_files(folder):
    for dirpath, _, files in os.walk(folder):
        yield from (os.path.join(dirpath, f) for f in files if f.endswith(".py"))


def line_count(folder) -> int:
    return sum(sum(1 for _ in open(p)) for p in python_files(folder))


def shell(root, command) -> str:
    return subprocess.run(command, shell=True, cwd=root, capture_output=True, text=True).stdout.strip()


def jit_functions(package):
    """(name, parameter names, constexpr parameter names) of every @triton.jit function."""
    for path in python_files(package):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                params = node.args.args
                yield node.name, [a.arg for a in params], [
                    a.arg for a in params if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = os.path.join(root, "triton_dilated")
    readme = sum(1 for _ in open(os.path.join(root, "README.md")))
    print(f"package / tests / README lines: {line_count(package)} / {line_count(os.path.join(root, 'tests'))} / "
          f"{readme}")
    print("files naming softcap:", shell(root, 'grep -rlw "softcap\\|SOFTCAP" triton_dilated | wc -l'),
          "mentions:", shell(root, 'grep -rw "softcap\\|SOFTCAP" triton_dilated | wc -l'),
          "'softcap or' / 'or 0.0' lines:", shell(root, 'grep -rn "softcap or\\|or 0.0" triton_dilated | wc -l'))
    print("files naming cache_seqlens:", shell(root, 'grep -rl "cache_seqlens" triton_dilated | wc -l'))
    functions = list(jit_functions(package))
    sizes = sorted(((len(params), name) for name, params, _ in functions), reverse=True)
    print("largest jit signatures:", sizes[:6], "; >= 45 parameters:", sum(n >= 45 for n, _ in sizes))
    total, valued = 0, set()
    for name, _, constexprs in functions:
        if name.endswith("_kernel"):   # the launched kernels
            switches = [c for c in constexprs if c not in NOT_SWITCHES]
            product = 1
            for c in switches:
                product *= 3 if c == "MASK_KIND" else 2
            total += product
            valued |= VALUE_SPECIALISED & set(switches)
    print("switch product over the launched kernels:", total, "; value-specialised:", sorted(valued))


if __name__ == "__main__":
    main()
