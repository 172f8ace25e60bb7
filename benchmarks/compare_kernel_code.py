"""Compare two builds of tandem's kernel library function by function: the disassembly of each symbol with
addresses, rip-relative offsets and their comments stripped. A restructure of kernels/csrc that must not change
what runs (renames, macros, moves) shows "differing: 0", or only the line numbers TORCH_CHECK embeds
(`--lines`: report those apart). Needs binutils' objdump.

    python benchmarks/compare_kernel_code.py before.so after.so [--lines]

Build the "before" library from a checkout of the base commit with TANDEM_KERNELS_BUILD=<dir> python -m
tandem.kernels.build; each build is named by its sources' hash in that folder.
"""
from __future__ import annotations

import argparse
import re
import subprocess

LINE_ARG = re.compile(r"mov\s+\$0x[0-9a-f]+,%edx")     # a TORCH_CHECK's __LINE__ argument


def functions(path: str) -> dict[str, list[str]]:
    """Symbol -> its instructions, with every address-dependent part replaced."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", path], capture_output=True, text=True,
                         check=True).stdout
    res: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            body = res.setdefault(m.group(1), [])
        elif body is not None and line.strip():
            ins = line.split("\t", 1)[-1]
            ins = re.sub(r"-?0x[0-9a-f]+\(%rip\)", "RIP", ins)
            ins = re.sub(r"#.*$", "", ins)
            ins = re.sub(r"<[^>]*>", "<>", ins)
            body.append(re.sub(r"\b[0-9a-f]{4,}\b", "ADDR", ins).strip())
    return res


def only_line_numbers(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) and all(x == y or (LINE_ARG.fullmatch(x) and LINE_ARG.fullmatch(y))
                                    for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="the library built from the base commit")
    p.add_argument("after", help="the library built from the change")
    p.add_argument("--lines", action="store_true", help="count functions that differ only in TORCH_CHECK's line numbers apart")
    a = p.parse_args()
    before, after = functions(a.before), functions(a.after)
    common = sorted(set(before) & set(after))
    differ = [n for n in common if before[n] != after[n]]
    lines = [n for n in differ if a.lines and only_line_numbers(before[n], after[n])]
    print(f"functions: {len(before)} before, {len(after)} after, {len(common)} in both")
    print(f"only before: {len(set(before) - set(after))}, only after: {len(set(after) - set(before))}")
    print(f"differing: {len(differ) - len(lines)}" + (f" (+{len(lines)} in TORCH_CHECK line numbers only)" if a.lines else ""))
    for n in sorted(set(differ) - set(lines))[:40]:
        print("  ", n[:160])


if __name__ == "__main__":
    main()
