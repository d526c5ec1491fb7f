"""The frozen public surface: `k3opt.__all__`, the CLI commands and each command's options, as explicit sets.

A name added or removed is a deliberate change: extend the sets below in the same commit (this file is their one
home), and say it in the README.
"""

from __future__ import annotations

import dataclasses

import click
from click.testing import CliRunner

import k3opt
from k3opt.cli import main

PUBLIC_API = frozenset({
    "ClusterSpec", "Evaluation", "InfeasibleJobError", "Job", "K3optError", "Layout", "LayoutError", "ModelSpec",
    "PresetNotFoundError", "RankEvaluation", "SpecError", "StepTime", "Toggles", "evaluate", "load_cluster",
    "load_job", "load_layout", "load_model", "make_layout", "Plan", "PlanItem", "plan",
})

CLI_COMMANDS = frozenset({"explain", "plan", "pareto"})

# Options of each command (-h / --help come from the group and are checked separately).
CLI_OPTIONS = {
    "explain": frozenset({"--model", "--cluster", "--reserve-gib", "--json"}),
    "plan": frozenset({"--gpus", "--top", "--time-limit", "--workers", "--show-ledger", "--save", "--json"}),
    "pareto": frozenset({"--gpus", "--top", "--time-limit", "--workers", "--csv", "--step-gib", "--json"}),
}
CLI_ARGUMENTS = {"explain": ("layout",), "plan": ("job",), "pareto": ("job",)}

STEP_COMPONENTS = frozenset({"compute", "hbm", "nvlink", "nic", "host_link", "microbatch_work", "bubble",
                             "exposed_update"})

LEDGER_KEYS = frozenset({"master", "grads", "optimizer", "bf16_view", "moonep_slots", "grad_accum", "moonep_buffers",
                         "activations", "attnres_bank", "recompute_working_set", "grad_transient", "pp_buffers",
                         "ep_buffers", "routing_map", "logits", "optimizer_transient"})


def test_all_is_the_frozen_set():
    assert len(k3opt.__all__) == len(set(k3opt.__all__)), "duplicate in __all__"
    assert set(k3opt.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(k3opt, name) is not None


def test_cli_commands_are_the_frozen_set():
    assert set(main.commands) == CLI_COMMANDS


def test_cli_options_of_each_command_are_the_frozen_set():
    for name, command in main.commands.items():
        opts = {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
        assert opts == CLI_OPTIONS[name], name
        args = tuple(p.name for p in command.params if isinstance(p, click.Argument))
        assert args == CLI_ARGUMENTS[name], name
        for flag in ("-h", "--help"):
            result = CliRunner().invoke(main, [name, flag])
            assert result.exit_code == 0 and "Usage:" in result.output


def test_step_components_and_ledger_keys_are_the_frozen_sets(reference_eval):
    assert set(reference_eval.step.components) == STEP_COMPONENTS
    assert "components" in {f.name for f in dataclasses.fields(k3opt.StepTime)}
    for r in reference_eval.ranks:
        assert set(r.ledger) == LEDGER_KEYS
        assert [t.key for t in r.terms] == list(r.ledger)
    data = reference_eval.to_dict()
    assert set(data["step"]["components"]) == STEP_COMPONENTS
    assert set(data["ranks"][0]["ledger_bytes"]) == LEDGER_KEYS
