#!/usr/bin/env python3
"""Static instruction counts of a kernel file's main loops, for sessions without a GPU.

Compiles a .cu file for sm_90a with nvcc (registers and spills from ptxas -v), disassembles it
with cuobjdump -sass, and prints, per kernel whose mangled name matches --match, the
instructions of its innermost loop that encloses every tensor-core instruction (HMMA, IMMA,
HGMMA): what one pass of the main loop issues per warp when that loop has no inner loops (the
"inner" column counts them; loops left in it make the static count overstate what runs), its
mma count, the opcodes it spends most on, and the kernel's registers and spill bytes.
dev/README.md #26-#28 quote it.

cuobjdump and nvdisasm come with the CUDA toolkit or, where the toolkit has only nvcc, from
PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm; their bin folder on PATH or --tools):

  python3 -m venv /tmp/sass && /tmp/sass/bin/pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
  python3 dev/cuda/sass_loops.py engine/cuda/mmq.cu --match 'mmq_kernel.*Li32ELi3ELi0E|mmq_h_kernel' \\
      --tools /tmp/sass/lib/python3.11/site-packages/nvidia/cu13/bin
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def compile_and_dump(cu, include, tools):
    env = dict(os.environ)
    if tools:
        env["PATH"] = tools + os.pathsep + env["PATH"]
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "k.o")
        cmd = ["nvcc", "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c", cu, "-o", obj]
        cmd[1:1] = [f"-I{d}" for d in include]
        ptxas = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if ptxas.returncode != 0:
            sys.exit(f"nvcc failed:\n{ptxas.stderr[-4000:]}")
        sass = subprocess.run(["cuobjdump", "-sass", obj], capture_output=True, text=True, env=env)
        if sass.returncode != 0 or "Function" not in sass.stdout:
            sys.exit(f"cuobjdump failed (nvdisasm on PATH? --tools):\n{sass.stderr[-2000:]}")
        return ptxas.stderr, sass.stdout


def registers(ptxas):
    """{mangled name: (registers, spill store bytes)} for sm_90a."""
    out = {}
    for m in re.finditer(r"Compiling entry function '(\S+)' for 'sm_90a'.*?(\d+) bytes spill stores.*?Used (\d+) registers", ptxas, re.S):
        out[m.group(1)] = (int(m.group(3)), int(m.group(2)))
    return out


def demangle_prefix(name):
    """The mangled name without llmq::cuda:: and its anonymous namespace (a length-prefixed name)."""
    m = re.match(r"_ZN4llmq4cuda(\d+)", name)
    if not m or "_GLOBAL__N_" not in name[m.end():m.end() + 12]:
        return name
    rest = name[m.end() + int(m.group(1)):]
    n = re.match(r"\d+", rest)
    return rest[n.end():] if n else rest


def opcode(ins):
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def main_loop(body):
    """(instructions, inner backward branches) of the innermost loop around every mma, or None."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    mma = [a for a, t in ins if "MMA" in opcode(t)]
    if not mma:
        return None
    loops = []
    for a, t in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) <= min(mma) and a >= max(mma):
            loops.append((a - int(m.group(1), 16), int(m.group(1), 16), a))
    if not loops:
        return None
    _, lo, hi = min(loops)
    loop = [t for a, t in ins if lo <= a <= hi]
    inner = 0
    for a, t in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", t)
        if lo <= a < hi and m and int(m.group(1), 16) < a:
            inner += 1
    return loop, inner


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cu", help="the kernel file, e.g. engine/cuda/mmq.cu")
    ap.add_argument("--match", default=".", help="regex on the mangled kernel names")
    ap.add_argument("--include", action="append", default=[".", "build"], help="include folders (default . and build)")
    ap.add_argument("--tools", default="", help="folder with cuobjdump and nvdisasm")
    a = ap.parse_args()
    ptxas, sass = compile_and_dump(a.cu, a.include, a.tools)
    regs = registers(ptxas)
    print(f"{'kernel':60} {'loop':>5} {'inner':>5} {'mma':>4} {'regs':>4} {'spill':>5}  top opcodes")
    for f in re.split(r"\n\s*Function : ", sass)[1:]:
        name = f.split("\n", 1)[0].strip()
        if not re.search(a.match, name):
            continue
        found = main_loop(f)
        if not found:
            continue
        loop, inner = found
        ops = collections.Counter(opcode(t) for t in loop)
        mma = sum(n for k, n in ops.items() if "MMA" in k)
        r, spill = regs.get(name, (0, 0))
        top = " ".join(f"{k}:{n}" for k, n in ops.most_common(6))
        short = demangle_prefix(name)[:60]
        print(f"{short:60} {len(loop):5d} {inner:5d} {mma:4d} {r:4d} {spill:5d}  {top}")


if __name__ == "__main__":
    main()
