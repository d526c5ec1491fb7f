"""The explain command: all eight ranks' ledgers, the step-time breakdown, the 146.18 GiB comparison."""

from __future__ import annotations

import json

from click.testing import CliRunner

from k3opt.cli import main


def test_explain_reference_prints_ranks_step_and_gap():
    result = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference"])
    assert result.exit_code == 0, result.output
    out = result.output
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("rank0"))
    assert header.split() == [f"rank{r}" for r in range(8)]
    for key in ("master", "optimizer_transient", "PEAK", "headroom", "attnres_bank", "logits"):
        assert key in out
    assert "measured 146.18 GiB" in out and "GAP" in out
    assert "bubble overhead 10.94%" in out and "9.86%" in out
    assert "tokens per update 16,777,216" in out
    assert "unpriced: CP: the KDA state pre-pass" in out


def test_explain_names_the_zero_terms_once_instead_of_printing_their_rows():
    """Llama 3 70B (MB-1) has no AttnRes, no routed experts and no pipeline: its bank, EP buffers, routing map and PP
    buffers are zero on its one rank and are named in one line, not printed as rows; its activations stay rows."""
    out = CliRunner().invoke(main, ["explain", "mb-1-llama3-70b-gb300"]).output
    rows = {ln.split()[0] for ln in out.splitlines() if ln and not ln.startswith(" ") and len(ln.split()) == 2}
    named = next(ln for ln in out.splitlines() if ln.startswith("zero on every rank"))
    for key in ("attnres_bank", "ep_buffers", "routing_map", "pp_buffers"):
        assert key not in rows and key in named
    assert {"activations", "logits", "master"} <= rows
    terms = out.split("Ledger terms")[1]
    assert "attnres_bank" not in terms and "activations" in terms


def test_explain_json_has_the_same_numbers():
    text = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference"]).output
    data = json.loads(CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--json"]).output)
    assert len(data["ranks"]) == 8
    assert data["ranks"][3]["ledger_bytes"]["activations"] == 3_523_215_360
    assert data["validation"][0]["measured"] == 146.18
    assert [v["kind"] for v in data["validation"]] == ["reserved", "device"]
    for key in ("peak_reserved_bytes", "peak_device_bytes"):
        assert f"modeled {data[key] / 2**30:,.2f} GiB" in text
    r0 = data["ranks"][0]
    assert r0["allocated_bytes"] <= r0["reserved_bytes"] <= r0["device_bytes"]


def test_explain_reserve_moves_the_hbm_line():
    a = json.loads(CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--json"]).output)
    b = json.loads(CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--json",
                                             "--reserve-gib", "10"]).output)
    assert a["capacity_bytes"] - b["capacity_bytes"] == 10 * 2**30


def test_explain_other_cluster_preset():
    result = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference", "--cluster", "h100-sxm"])
    assert result.exit_code == 0
    assert "DOES NOT FIT" in result.output


def test_a_commands_time_limit_counts_from_its_own_start(monkeypatch):
    """The first command of a process counts the process's start-up; a later one in the same process (a test
    runner, a notebook) counts from its own start, not from the process's."""
    import k3opt.cli as cli

    monkeypatch.setattr(cli, "_STARTED", [])
    monkeypatch.setattr(cli, "_process_seconds", lambda: 1000.0)  # a process 1,000 s old
    CliRunner().invoke(cli.main, ["export", "nowhere.toml", "--format", "nemo"])
    assert cli._command_seconds() >= 1000.0  # the first command: the start-up counts
    CliRunner().invoke(cli.main, ["export", "nowhere.toml", "--format", "nemo"])
    assert cli._command_seconds() < 60.0


def test_a_warning_on_the_command_line_is_one_line(monkeypatch):
    """A warning a command raises (a CP-SAT child that died and was solved again) prints as one 'k3opt: warning:'
    line, like the errors, not with Python's file, line number and source line."""
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    result = CliRunner().invoke(main, ["explain", "k3-gb200-512-reference"])
    assert result.exit_code == 0, result.output
    text = warnings.formatwarning(RuntimeWarning("CP-SAT aborted in presolve"), RuntimeWarning,
                                  "/x/k3opt/search/isolated.py", 75)
    assert text == "k3opt: warning: CP-SAT aborted in presolve\n"
