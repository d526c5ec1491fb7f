"""Shared fixtures: the shipped K3 model, the GB200 preset and the seed-000 reference layout."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import k3opt
from k3opt.inputs import memo
from k3opt.search import driver, front, incumbents, isolated, lp_bound, node_model, policy, progress, replay_bound


def _mutmut_phase() -> str:
    """'' outside mutation testing; 'stats' while mutmut records which test calls which function; else the name
    of the mutant (or mutmut's clean and forced-fail runs)."""
    return os.environ.get("MUTANT_UNDER_TEST", "")


def shared_scope(fixture_name: str, config: pytest.Config) -> str:
    """One shared evaluation per session, except while mutmut records which tests call which function: a shared
    fixture is computed inside the first test that asks for it, so the others would never be picked for a mutant."""
    return "function" if _mutmut_phase() == "stats" else "session"


@pytest.fixture(scope="session", autouse=True)
def _cold_cost_model_caches():
    """Under mutation testing (bench/mutation.sh) a mutant's process must not read results cached by mutmut's
    clean run, and the stats run must see every call: clear the cost model's caches (per test for the stats)."""
    if _mutmut_phase():
        _clear_caches()
    yield


@pytest.fixture(autouse=True)
def _per_test_caches_for_mutmut_stats():
    if _mutmut_phase() == "stats":
        _clear_caches()
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A module-scoped fixture is a cache too: while mutmut records which test calls which function, it would be
    built inside the first test of its module only, and mutmut would then run a mutant of the functions it calls
    against that one test. Tear every fixture down after each test of the stats run, so each test builds its own."""
    if _mutmut_phase() == "stats":
        item.session._setupstate.teardown_exact(None)


def _clear_caches() -> None:
    """Empties every cache (each registers itself with k3opt.inputs.memo)."""
    memo.clear_all()


@pytest.fixture(scope=shared_scope)
def model() -> k3opt.ModelSpec:
    return k3opt.load_model("kimi-k3")


@pytest.fixture(scope=shared_scope)
def cluster() -> k3opt.ClusterSpec:
    return k3opt.load_cluster("gb200-nvl72")


TILUS_BF16 = "gb200-nvl72-tilus-bf16"


@pytest.fixture
def tilus_bf16_cluster(monkeypatch) -> k3opt.ClusterSpec:
    """GB200 with its BF16 GEMMs at the NVIDIA Tilus tutorial's cuBLAS rate on B200 (0.716 of the dense peak,
    grouped 0.716 x 0.948 = 0.679) instead of the shipped 0.578: the rates at which some search scenarios were
    found (which configuration climbs further from which split). The mechanism such a test checks holds at any
    rates; its scenario does not. A cluster of its own name, so no cost-model cache mixes the two."""
    from k3opt.inputs import rates

    base = rates.load_rates("gb200-nvl72")
    tilus = base.model_copy(update={
        "name": TILUS_BF16, "cluster": TILUS_BF16,
        "gemm_dense": {**base.gemm_dense, "bf16": base.gemm_dense["bf16"].model_copy(update={"value": 0.716})},
        "gemm_grouped": {**base.gemm_grouped, "bf16": base.gemm_grouped["bf16"].model_copy(update={"value": 0.679})}})
    shipped = rates._shipped_rates
    monkeypatch.setattr(rates, "_shipped_rates", lambda name: tilus if name == TILUS_BF16 else shipped(name))
    return k3opt.load_cluster("gb200-nvl72").model_copy(update={"name": TILUS_BF16})


@pytest.fixture(scope=shared_scope)
def reference() -> k3opt.Layout:
    return k3opt.load_layout("k3-gb200-512-reference")


@pytest.fixture(scope=shared_scope)
def reference_eval(reference, model, cluster) -> k3opt.Evaluation:
    return k3opt.evaluate(reference, model=model, cluster=cluster)


@pytest.fixture(scope=shared_scope)
def tiny() -> k3opt.ModelSpec:
    """The six-layer test model (tests/data/tiny-moe.toml) with every K3 layer kind."""
    from pathlib import Path

    return k3opt.load_model(Path(__file__).parent / "data" / "tiny-moe.toml")


@pytest.fixture(scope=shared_scope)
def slow() -> k3opt.ClusterSpec:
    """The slow test cluster (tests/data/slow-cluster.toml)."""
    from pathlib import Path

    return k3opt.load_cluster(Path(__file__).parent / "data" / "slow-cluster.toml")


def enumerated_front(points: list[tuple[float, int]], step: int = 2**20) -> list[tuple[float, int]]:
    """The (step time, peak) front of enumerated layouts, `points` sorted fastest first: each layout at least `step`
    bytes leaner than the last one kept (the front an epsilon-constraint search resolves at that step)."""
    front, best_m = [], float("inf")
    for t, m in points:
        if m < best_m - step:
            front.append((t, m))
            best_m = m
    return front


def contiguous_splits(layers: int, chunks: int, empty_edges: bool = False):
    """Every split of `layers` layers into `chunks` contiguous chunks of at least one layer (C(L - 1, K - 1));
    with `empty_edges`, the first and the last chunk may also hold none (cuts at 0 and at L allowed)."""
    import itertools

    if not empty_edges or chunks < 2:
        for cuts in itertools.combinations(range(1, layers), chunks - 1):
            edges = (0, *cuts, layers)
            yield [edges[i + 1] - edges[i] for i in range(chunks)]
        return
    for first in (0, 1):
        for last in (0, 1):
            # An empty first (last) chunk: the middle chunks and the other edge take every layer.
            inner = chunks - 2 + first + last
            if inner == 0 or layers < inner:
                continue
            for split in contiguous_splits(layers, inner):
                yield ([] if first else [0]) + split + ([] if last else [0])


MEASURED = Path(k3opt.__file__).parents[1] / "layouts" / "measured"
"""The measured layouts (public runs, the K3 reference)."""


def peak_roofline_cluster(name: str) -> k3opt.ClusterSpec:
    """A shipped cluster preset under another name (`<name>-peak`): rates files are found by the cluster's name, so
    it has none, and evaluate() and the search rank at the peak roofline on the preset's hardware."""
    return k3opt.load_cluster(name).model_copy(update={"name": f"{name}-peak"})


def least_value(fm, expr) -> int:  # noqa: ANN001 - a node model and a CP-SAT expression
    """The least value `expr` takes in node model `fm`'s CP-SAT model (KiB for its memory parts)."""
    from ortools.sat.python import cp_model

    fm.m.minimize(expr)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 30
    assert solver.solve(fm.m) == cp_model.OPTIMAL
    return round(solver.objective_value)


def measured_variant(name: str, **update) -> k3opt.Layout:  # noqa: ANN003 - Layout fields
    """The measured layout file `name` (under layouts/measured) with its measurement dropped and `update` applied."""
    data = k3opt.load_layout(str(MEASURED / name)).model_dump()
    data.pop("measured")
    data.update(update)
    return k3opt.make_layout(**data)


def explain_refusal(tmp_path, text: str) -> str:  # noqa: ANN001 - a pytest tmp_path
    """`k3opt explain` on a layout file holding `text`: it must exit 2 with one line on stderr, which is returned."""
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    res = subprocess.run([sys.executable, "-m", "k3opt.cli", "explain", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


def plan_refusal(tmp_path, text: str) -> str:  # noqa: ANN001 - a pytest tmp_path
    """`k3opt plan` on a job file holding `text`: it must exit 2 with one line of output, which is returned."""
    from click.testing import CliRunner

    from k3opt.cli import main

    path = tmp_path / "job.toml"
    path.write_text(text)
    res = CliRunner().invoke(main, ["plan", str(path)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1, res.output
    return lines[0]


INTERLEAVED_TOGGLES = ("fp8_activations", "activation_offload", "balance_activations", "fused_situ")


PP2_VP2_TOGGLES = ("fp8_activations", "activation_offload", "balance_activations", "pipeline_zero2_host_grads",
                   "p2p_muon", "fused_cross_entropy")
"""The toggles the PP2 VP2 memory tests search: offload, balancing and every rank toggle that trades work for bytes."""


def pp2_vp2_memory_job(reserve: float, offload_sets: list[list[str]] | None = ()) -> k3opt.Job:
    """PP2 VP2 EP2 dense FSDP 2 (optim_grads_params) on 8 slow-cluster GPUs with PP2_VP2_TOGGLES searchable: the
    job of the linear relaxation's memory and early-exit tests. `offload_sets`: its [search] offload_modules (no
    module by default; None: the search's default sets)."""
    from pathlib import Path

    data = Path(__file__).parent / "data"
    return k3opt.Job.model_validate({
        "model": str(data / "tiny-moe.toml"), "cluster": str(data / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": reserve,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "dense_sharding": ["optim_grads_params"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in PP2_VP2_TOGGLES],
                   **({"offload_modules": list(offload_sets)} if offload_sets is not None else {})},
    })


def interleaved_small_job() -> k3opt.Job:
    """PP2 VP2 on the small model (tests/data/tiny-moe.toml on slow-cluster.toml, 8 GPUs), no / full recompute,
    four activation toggles free: the interleaved job the search and replay-bound tests enumerate."""
    from pathlib import Path

    data = Path(__file__).parent / "data"
    allowed = INTERLEAVED_TOGGLES
    return k3opt.Job.model_validate({
        "model": str(data / "tiny-moe.toml"), "cluster": str(data / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 1.5,
        "search": {"pp": [2], "vp": [2], "cp": [1], "ep": [2], "expert_fsdp": [1], "dense_fsdp": [2],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"], "offload_modules": [],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES if t not in allowed]},
    })



@pytest.fixture
def pp2_job() -> k3opt.Job:
    """The six-layer model on 8 slow-cluster GPUs at PP2: VP 1 or 2, EP2, expert FSDP 1-2, dense FSDP 1-4 under
    two dense sharding policies, recompute none or full, FP8 activations and activation offload allowed, reserve
    2.4 GiB (the seeding's tests: search/incumbents.seed and spread)."""
    from pathlib import Path

    data = Path(__file__).parent / "data"
    return k3opt.Job.model_validate({
        "model": str(data / "tiny-moe.toml"), "cluster": str(data / "slow-cluster.toml"), "gpus": 8,
        "context": 2048, "tokens_per_update": 32768, "reserve_gib": 2.4,
        "search": {"pp": [2], "vp": [1, 2], "cp": [1], "ep": [2], "expert_fsdp": [1, 2], "dense_fsdp": [1, 2, 4],
                   "dense_sharding": ["optim_grads_params", "optim"], "expert_sharding": ["optim_grads_params"],
                   "recompute": ["none", "full"], "fsdp_lifecycle": ["per_microbatch"],
                   "forbid_toggles": [t for t in k3opt.inputs.specs.TOGGLE_NAMES
                                      if t not in ("fp8_activations", "activation_offload")]},
    })


@pytest.fixture
def use_policy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """use_policy(bound_share=0.0, ...): the search runs this test with those SearchPolicy fields changed (every
    search module that reads the policy sees the same record)."""

    def set_fields(**changes: float) -> None:
        new = replace(policy.POLICY, **changes)
        for module in (policy, driver, front, incumbents, isolated, lp_bound, node_model, progress, replay_bound):
            monkeypatch.setattr(module, "POLICY", new)

    return set_fields


def assert_bounds_below(job, frames, rows, tiny, slow, recs) -> None:
    """Every frame and node bound (time and peak) below every enumerated layout it stands for; rows are
    (frame, recompute, lifecycle, ranked s, peak bytes)."""
    from k3opt.inputs.specs import FsdpLifecycle
    from k3opt.search import frame_dp_bound, frame_lower_bound, node_lower_bound, tight_node_bound

    for f in frames:
        mine = [r for r in rows if r[0] == f]
        if not mine:
            continue
        t_f, m_f = frame_lower_bound(job, f, tiny, slow)
        t_dp, m_dp = frame_dp_bound(job, f, tiny, slow)
        assert min(r[3] for r in mine) >= max(t_f, t_dp) - 1e-9
        assert min(r[4] for r in mine) >= max(m_f, m_dp) - 1
        for rc, lc in itertools.product(recs, FsdpLifecycle):
            node = [r for r in mine if r[1] == rc and r[2] == lc]
            if node:
                t_n, m_n = node_lower_bound(job, f, rc, lc, tiny, slow)
                assert min(r[3] for r in node) >= max(t_n, tight_node_bound(job, f, rc, lc, tiny, slow)) - 1e-9
                assert min(r[4] for r in node) >= m_n - 1


@pytest.fixture(scope="module")
def dsv3_b200_node() -> SimpleNamespace:
    """DeepSeek-V3 on 512 B200 at 8K, 4,194,304 tokens per update, 4-GiB reserve, and its PP8 VP4 EP8 eFSDP1
    dFSDP64 optim shape (61 layers in 32 chunks, LM head and MTP head on the last); `witness`: the split that
    shape's full-recompute per_microbatch CP-SAT model found in 60 s."""
    from k3opt.search import enumerate_frames

    job = k3opt.Job.model_validate({"model": "deepseek-v3", "cluster": "b200", "gpus": 512, "context": 8192,
                                    "tokens_per_update": 4194304, "reserve_gib": 4.0})
    model, cluster = k3opt.load_model("deepseek-v3"), k3opt.load_cluster("b200")
    frame = next(g for g in enumerate_frames(job, model, 512, cluster)
                 if (g.pp, g.vp, g.ep, g.expert_fsdp, g.dense_fsdp) == (8, 4, 8, 1, 64)
                 and g.dense_sharding == "optim")
    witness = [2, 2, 1] + [2] * 12 + [1] + [2] * 8 + [1, 2, 3, 2, 2, 2, 2, 1]
    assert sum(witness) == model.num_layers
    return SimpleNamespace(job=job, model=model, cluster=cluster, frame=frame, witness=witness)
