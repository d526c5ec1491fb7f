"""The framework versions k3opt's launch facts were read from (the exporters' flags and keys, the toggle
registry's switches, the targets' limits): each public repository at a pinned commit."""

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""github.com/NVIDIA/Megatron-LM main (2026-08-22); tests/data/megatron_lm_flags.txt is extracted here."""
MEGATRON_BRIDGE_COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"
"""github.com/NVIDIA-NeMo/Megatron-Bridge main (2026-08-22): the Kimi K3 provider, spec and layers."""
TORCHTITAN_TOML_COMMIT = "e347b1e5e6b6941d789d16d340145294d82dc71e"
"""github.com/pytorch/torchtitan: last version of torchtitan/config/job_config.py (the TOML config) before
9810191b replaced TOML files by Python config functions; HEAD b5bcd76c keeps the same keys as frozen
`--section.key` command-line overrides."""

MLM = f"@ NVIDIA/Megatron-LM {MEGATRON_LM_COMMIT[:8]}"
MB = f"@ NVIDIA-NeMo/Megatron-Bridge {MEGATRON_BRIDGE_COMMIT[:8]}"
TT = f"@ pytorch/torchtitan {TORCHTITAN_TOML_COMMIT[:8]}"
"""The pins as a source line cites them: "megatron/training/arguments.py L1739-1740 @ NVIDIA/Megatron-LM d98e8a64"."""
