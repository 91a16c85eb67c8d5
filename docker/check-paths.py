#!/usr/bin/env python3
"""Every path of this repository that the docs and comments name exists: a path in backticks or a relative
link in the Markdown files, and a path in a comment of the code, scripts and fuzz dictionaries (backticked or
bare). A path names this repository when its leading directories exist here (`src/slurm/x.rs`: src/slurm);
one under a directory this repository lacks (`src/common/...`, Slurm's tree) names another project's. A
component in capitals (`tests/programs/NAME.c`) is a placeholder. The changelog and the recorded results speak
of their own time and are not read. Exits 1, listing each path that does not exist, else 0.

  python3 docker/check-paths.py
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = (".rs", ".c", ".h", ".sh", ".py", ".toml", ".dict", ".spec")
TICKED = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
BARE = re.compile(r"(?<![\w./-])((?:src|tests|docker|fuzz|crates|plugin-spec|docs|benches|packaging)/[\w./-]*\w)")
# What a comment looks like in each kind of file (a line of a Markdown file is all prose).
COMMENT = re.compile(r"//|/\*|^\s*\*|#")


def ours(path):
    """The path names a file of this repository: its leading directories exist here."""
    parts = path.rstrip("/").split("/")
    if any(re.fullmatch(r"[A-Z][A-Z0-9_]+", piece) for p in parts for piece in p.split(".")):
        return False  # a placeholder: NAME.c, TARGET, NAME.SECTION.md
    lead = parts[:2] if parts[0] == "src" and len(parts) > 2 else parts[:1]
    return os.path.isdir(os.path.join(ROOT, *lead))


def checked(path):
    path = path.rstrip(".,:;)")
    path = re.split(r"[:(]", path)[0]
    if "/" not in path or path.startswith(("/", "./", "~", "$", "<", "http", "..")) or re.search(r"[*<>{}]", path):
        return None
    if path.startswith(("target/", "fuzz/target/", "fuzz/corpus/", "fuzz/artifacts/")):
        return None  # made by builds and runs
    return path if ours(path) else None


def main():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in files:
        markdown = name.endswith(".md")
        if name == "CHANGELOG.md" or (name.startswith("benches/results/") and name != "benches/results/README.md"):
            continue
        if not (markdown or name.endswith(CODE)):
            continue
        with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for n, line in enumerate(lines, 1):
            if markdown:
                found = [m.group(1) for m in TICKED.finditer(line)]
                for m in LINK.finditer(line):
                    link = m.group(1)
                    if not link.startswith(("http:", "https:", "mailto:")) and not os.path.exists(
                            os.path.normpath(os.path.join(ROOT, os.path.dirname(name), link))):
                        missing.append(f"{name}:{n}: link {link}")
            else:
                comment = COMMENT.search(line)
                if not comment:
                    continue
                text = line[comment.start():]
                found = [m.group(1) for m in TICKED.finditer(text)] + [m.group(1) for m in BARE.finditer(text)]
            for path in dict.fromkeys(found):
                path = checked(path)
                if path and not os.path.exists(os.path.join(ROOT, path.rstrip("/"))):
                    missing.append(f"{name}:{n}: {path}")
    for m in missing:
        print(f"check-paths: {m} does not exist", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
