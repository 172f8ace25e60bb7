"""Check that every relative link of the front pages resolves: README.md, docs/*.md, benchmarks/RESULTS.md and
benchmarks/results/HISTORY.md. A link's file must exist, and its #anchor must be a heading of that file (GitHub's
slugs). With --paths, also list the repository paths the pages quote in backticks (`tandem/...`, `tests/...`,
`benchmarks/...`) that do not exist: the code map must stay true when code moves.

    python3 docs/check_links.py [--paths]          # exit 1 on a broken link
"""
from __future__ import annotations

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`((?:tandem|tests|benchmarks|docs)/[\w./<>-]*)`")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages() -> list[str]:
    found = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT)), "benchmarks/RESULTS.md",
             "benchmarks/results/HISTORY.md"]
    return [p for p in found if os.path.isfile(os.path.join(ROOT, p))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (but - and _), spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        text = FENCE.sub("", f.read())
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue                                  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file)) if file else os.path.join(ROOT, page)
        if not os.path.exists(path):
            bad.append(f"{page}: {target} (no such file)")
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            bad.append(f"{page}: {target} (no heading #{anchor})")
    return bad


def missing_paths(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    out = []
    for p in sorted(set(CODE.findall(text))):
        if "<" not in p and not os.path.exists(os.path.join(ROOT, p.rstrip("/"))):
            out.append(f"{page}: `{p}`")
    return out


def main() -> None:
    bad = [b for p in pages() for b in broken_links(p)]
    print("\n".join(bad) or f"links: all resolve ({', '.join(pages())})")
    if "--paths" in sys.argv:
        missing = [m for p in pages() if p != "benchmarks/results/HISTORY.md" for m in missing_paths(p)]
        print("\n".join(["quoted paths that do not exist:", *missing]) if missing else "quoted paths: all exist")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
