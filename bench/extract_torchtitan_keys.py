"""Extract the TOML keys torchtitan's config defines into tests/data/torchtitan_keys.txt.

Usage: python bench/extract_torchtitan_keys.py GIT_DIR COMMIT > tests/data/torchtitan_keys.txt
(GIT_DIR: a bare clone of github.com/pytorch/torchtitan; COMMIT: one where torchtitan/config/job_config.py
exists, e.g. e347b1e5, its last TOML-era version.) Nothing is imported from it, only parsed.

JobConfig's fields are the TOML sections; a field whose annotation is another dataclass of the file is a nested
section (quantize.linear.mx); every other field is a key, written `section.key`.
"""

from __future__ import annotations

import ast
import subprocess
import sys

PATH = "torchtitan/config/job_config.py"


def main(git_dir: str, commit: str) -> None:
    src = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{PATH}"], check=True,
                         capture_output=True, text=True).stdout
    tree = ast.parse(src)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> list[tuple[str, str | None]]:
        out = []
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                ann = st.annotation.id if isinstance(st.annotation, ast.Name) else None
                out.append((st.target.id, ann if ann in classes else None))
        return out

    keys: list[str] = []

    def walk(cls_name: str, prefix: str) -> None:
        for name, sub in fields(classes[cls_name]):
            if sub is not None:
                walk(sub, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)

    walk("JobConfig", "")
    print("# TOML keys (section.key) torchtitan's JobConfig defines; the torchtitan export is checked against it.")
    print(f"# Source: github.com/pytorch/torchtitan at commit {commit}, file {PATH}")
    print("# regenerate with: python bench/extract_torchtitan_keys.py TORCHTITAN_GIT_DIR COMMIT")
    for k in sorted(keys):
        print(k)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
