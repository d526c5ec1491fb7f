"""Extract the override keys a Megatron-Bridge Kimi K3 run accepts into tests/data/megatron_bridge_keys.txt.

Usage: python bench/extract_bridge_keys.py BRIDGE_GIT_DIR BRIDGE_COMMIT MEGATRON_GIT_DIR MEGATRON_COMMIT \
           > tests/data/megatron_bridge_keys.txt
Nothing is imported from either repository, only parsed.

A Bridge override `group.key=value` sets field `key` of the config dataclass behind `group`
(docs/megatron-lm-to-megatron-bridge.md). The groups k3opt emits and the dataclasses behind them, with their
bases (Bridge's classes subclass Megatron core's and Megatron training's):
"""

from __future__ import annotations

import ast
import subprocess
import sys

B, M = "bridge", "megatron"
GROUPS: dict[str, list[tuple[str, str, str]]] = {
    "model": [  # KimiK3ModelProvider(MLAModelProvider(MLATransformerConfig, GPTModelProvider(TransformerConfig)))
        (B, "src/megatron/bridge/models/kimi/kimi_k3_provider.py", "KimiK3ModelProvider"),
        (B, "src/megatron/bridge/models/mla_provider.py", "MLAModelProvider"),
        (B, "src/megatron/bridge/models/gpt_provider.py", "GPTModelProvider"),
        (B, "src/megatron/bridge/models/transformer_config.py", "TransformerConfig"),
        (B, "src/megatron/bridge/models/transformer_config.py", "MLATransformerConfig"),
        (M, "megatron/core/transformer/transformer_config.py", "TransformerConfig"),
        (M, "megatron/core/transformer/transformer_config.py", "MLATransformerConfig"),
        (M, "megatron/core/model_parallel_config.py", "ModelParallelConfig"),
    ],
    "train": [(B, "src/megatron/bridge/training/config.py", "TrainingConfig"),
              (M, "megatron/training/config/training_config.py", "TrainingConfig")],
    "dataset": [(B, "src/megatron/bridge/training/config.py", "GPTDatasetConfig")],
    "optimizer": [(B, "src/megatron/bridge/training/config.py", "OptimizerConfig"),
                  (M, "megatron/core/optimizer/optimizer_config.py", "OptimizerConfig")],
    "ddp": [(B, "src/megatron/bridge/training/config.py", "DistributedDataParallelConfig"),
            (M, "megatron/core/distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig")],
    "mixed_precision": [(B, "src/megatron/bridge/training/mixed_precision.py", "MixedPrecisionConfig")],
    # Bridge copies these onto the model at setup (comm_overlap.py _apply_cfgs), over the model's own fields.
    "comm_overlap": [(B, "src/megatron/bridge/training/comm_overlap.py", "CommOverlapConfig")],
}


def main(bridge_dir: str, bridge_commit: str, mlm_dir: str, mlm_commit: str) -> None:
    repos = {B: (bridge_dir, bridge_commit), M: (mlm_dir, mlm_commit)}
    keys: set[str] = set()
    for group, classes in GROUPS.items():
        for repo, path, name in classes:
            git_dir, commit = repos[repo]
            src = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                                 capture_output=True, text=True).stdout
            cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == name)
            for st in cls.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    keys.add(f"{group}.{st.target.id}")
    print("# Megatron-Bridge override keys (group.field) for a Kimi K3 run; the Bridge export is checked against it.")
    print(f"# Source: github.com/NVIDIA-NeMo/Megatron-Bridge at commit {bridge_commit} and")
    print(f"#         github.com/NVIDIA/Megatron-LM at commit {mlm_commit} (the config dataclasses Bridge subclasses)")
    print("# regenerate with: python bench/extract_bridge_keys.py BRIDGE_GIT_DIR COMMIT MEGATRON_GIT_DIR COMMIT")
    for k in sorted(keys):
        print(k)


if __name__ == "__main__":
    main(*sys.argv[1:5])
