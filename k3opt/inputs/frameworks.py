"""The framework versions k3opt's launch facts were read from (the exporters' flags and keys, the toggle
registry's switches, the targets' limits): each public repository at a pinned commit."""

MEGATRON_LM_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
MEGATRON_BRIDGE_COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"
TORCHTITAN_TOML_COMMIT = "e347b1e5e6b6941d789d16d340145294d82dc71e"
