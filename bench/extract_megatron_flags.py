"""Extract the set of command-line flags Megatron-LM defines into tests/data/megatron_lm_flags.txt.

Usage: python bench/extract_megatron_flags.py GIT_DIR COMMIT > tests/data/megatron_lm_flags.txt
(GIT_DIR: a bare clone of github.com/NVIDIA/Megatron-LM; nothing is imported from it, only parsed.)

Megatron-LM defines flags two ways (megatron/training/arguments.py):
1. literal `add_argument('--flag', ...)` calls;
2. `ArgumentGroupFactory(<dataclass>, exclude=[...]).build_group(...)` (megatron/training/argument_utils.py),
   one flag per dataclass field not excluded and not `init=False`: `--` + name with `_` -> `-`; a bool field
   whose default is False is `--name`, any other bool default gives `--no-name` and `--disable-name`;
   `metadata={"argparse_meta": {"arg_names": [...]}}` overrides the names.
This script re-applies those rules statically (ast), so the data file can be regenerated at a new commit.
"""

from __future__ import annotations

import ast
import subprocess
import sys

ARGS = "megatron/training/arguments.py"
# Where each dataclass the factory is applied to lives (and its base class, if any).
CLASSES: dict[str, tuple[str, str | None]] = {
    "ModelParallelConfig": ("megatron/core/model_parallel_config.py", None),
    "TransformerConfig": ("megatron/core/transformer/transformer_config.py", "ModelParallelConfig"),
    "RNGConfig": ("megatron/training/config/common_config.py", None),
    "ProfilingConfig": ("megatron/training/config/common_config.py", None),
    "DistributedInitConfig": ("megatron/training/config/common_config.py", None),
    "TrainingConfig": ("megatron/training/config/training_config.py", None),
    "ValidationConfig": ("megatron/training/config/training_config.py", None),
    "SchedulerConfig": ("megatron/training/config/training_config.py", None),
    "LoggerConfig": ("megatron/training/config/training_config.py", None),
    "CheckpointConfig": ("megatron/training/config/training_config.py", None),
    "TokenizerConfig": ("megatron/training/config/training_config.py", None),
    "RerunStateMachineConfig": ("megatron/training/config/resilience_config.py", None),
    "StragglerDetectionConfig": ("megatron/training/config/resilience_config.py", None),
    "FaultInjectorConfig": ("megatron/core/fault_injector.py", None),
}


def show(git_dir: str, commit: str, path: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def literal_flags(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"):
                    out.add(a.value)
    return out


def factory_calls(tree: ast.AST) -> list[tuple[str, set[str]]]:
    """(class name, excluded field names) of every ArgumentGroupFactory(...) call."""
    calls = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        local_lists = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                local_lists[node.targets[0].id] = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "ArgumentGroupFactory":
                cls = node.args[0].id
                excl: set[str] = set()
                for kw in node.keywords:
                    if kw.arg == "exclude":
                        if isinstance(kw.value, ast.List):
                            excl = {e.value for e in kw.value.elts if isinstance(e, ast.Constant)}
                        elif isinstance(kw.value, ast.Name):
                            excl = local_lists[kw.value.id]
                calls.append((cls, excl))
    return calls


def _is_bool(ann: ast.expr) -> bool:
    """bool, Optional[bool] or `bool | None` (the factory unwraps Optional before testing for bool)."""
    if isinstance(ann, ast.Name):
        return ann.id == "bool"
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Optional":
        return _is_bool(ann.slice)
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return (_is_bool(ann.left) and isinstance(ann.right, ast.Constant) and ann.right.value is None)
    return False


def class_fields(src: str, name: str) -> dict[str, list[str]]:
    """Field name -> generated flag names, in definition order."""
    tree = ast.parse(src)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    out: dict[str, list[str]] = {}
    for st in cls.body:
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
            continue
        if isinstance(st.annotation, ast.Subscript) and getattr(st.annotation.value, "id", "") == "ClassVar":
            continue
        fname = st.target.id
        default: object = None
        init = True
        names: list[str] | None = None
        v = st.value
        if isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", "")) == "field":
            for kw in v.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant):
                    default = kw.value.value
                elif kw.arg == "default_factory":
                    default = object()
                elif kw.arg == "init" and isinstance(kw.value, ast.Constant):
                    init = bool(kw.value.value)
                elif kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
                    for k, meta in zip(kw.value.keys, kw.value.values, strict=True):
                        if isinstance(k, ast.Constant) and k.value == "argparse_meta" and isinstance(meta, ast.Dict):
                            for k2, v2 in zip(meta.keys, meta.values, strict=True):
                                if isinstance(k2, ast.Constant) and k2.value == "arg_names":
                                    names = [e.value for e in v2.elts]
        elif isinstance(v, ast.Constant):
            default = v.value
        elif v is not None:
            default = object()
        if not init:
            out[fname] = []
            continue
        if names is None:
            base = "--" + fname.replace("_", "-")
            if _is_bool(st.annotation) and default is not False:
                names = ["--no-" + fname.replace("_", "-"), "--disable-" + fname.replace("_", "-")]
            else:
                names = [base]
        out[fname] = names
    return out


def main(git_dir: str, commit: str) -> None:
    args_tree = ast.parse(show(git_dir, commit, ARGS))
    flags = literal_flags(args_tree)
    files = {ARGS}
    for cls, excl in factory_calls(args_tree):
        path, base = CLASSES[cls]
        fields: dict[str, list[str]] = {}
        if base:
            bpath = CLASSES[base][0]
            fields.update(class_fields(show(git_dir, commit, bpath), base))
            files.add(bpath)
        fields.update(class_fields(show(git_dir, commit, path), cls))
        files.add(path)
        for fname, names in fields.items():
            if fname not in excl:
                flags.update(names)
    print("# Command-line flags Megatron-LM defines, one per line (the Megatron-LM export is checked against it).")
    print(f"# Source: github.com/NVIDIA/Megatron-LM at commit {commit}")
    print("# Read from: " + ", ".join(sorted(files)))
    print("# Literal add_argument() calls in arguments.py plus the ArgumentGroupFactory dataclass flags;")
    print("# regenerate with: python bench/extract_megatron_flags.py MEGATRON_GIT_DIR COMMIT")
    for f in sorted(flags):
        print(f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
