"""Every tuning knob of the search, in one frozen record. The knobs split the time limit between the search's
phases and cap the work of one step; none enters a cost term, so a knob changes how soon a plan proves its gap,
never which layout is best or what it costs. Each field says why it has the value it has.

The search reads the module-level POLICY; a test or a benchmark swaps it with dataclasses.replace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchPolicy:
    # -- the ranked search's phases (search/driver.py)
    seed_share: float = 0.15
    """Share of the time limit the seeding (search/incumbents.py) may price frames under the fastest configurations
    before the CP-SAT solves: evaluate() finds fast layouts of many frames in the time one node's model takes."""

    seed_min_s: float = 4.0
    """Seconds the seeding may take at least (within 30% of the limit): the walks that find the fast configurations
    take a second or two each."""

    seed_gain: float = 0.1
    """The seeding stops once it stalls (incumbents._Patience): a gain is a fall of the top-th fastest layout (or
    the fastest) by more than this share of the gap, or a layout added while fewer than top are at hand. A tenth:
    a fall that small moves the pruning line by a tenth of the margin the proof needs, so it prunes few more shapes,
    while the climbs' last steps (a layer moved between chunks) no longer keep the seeding going."""

    first_pass_s: float = 1.5
    """The first heuristic pass's time once it has a layout (incumbents.incumbents): half its budget, at most this.
    The first layouts of the leading pipeline shapes come in the first second; more time in this pass finds no walk
    lead that the walks after it would not, and delays them."""

    first_patience_s: float = 2.0
    """The stall stop's minimum for the second seeding's first part, before the bounding pass, when the walks ended
    far above the queue's least bound (round_robin_above): the layouts this part finds set the pass's pruning line,
    and on large jobs the shapes that lead are met only after a second or two of round-robin pricing."""

    first_patience_near_s: float = 0.5
    """The first part's minimum when the walks ended within round_robin_above of the queue's least bound: they
    have met the shapes that lead and the pass's line is already close; the stall rule still extends the part while
    it gains."""

    second_patience_s: float = 2.0
    """The stall stop's minimum for the second seeding's part after the bounding pass. It visits only the frames
    whose tightened bounds are under the line, so a stall that long leaves the rest to the queue, whose bounds are
    what the proof waits on. At the seeding's general minimum (patience_min_s, 20 s) it took its whole share of a
    60-s limit without a gain (K3 on 4,096 GPUs at 16K context: 10 s; the 32,768-GPU job proves in 61 s, not 83 s)."""

    bound_share: float = 0.25
    """Share of the time limit the bounding pass may take before the second seeding: the queue's frames and nodes
    bounded (no CP-SAT solve) against the pruning line of the layouts found so far, so that the seeding can stop as
    soon as a layout it finds closes the search. Checked between steps: one bound program may run past it."""

    round_robin_above: float = 0.25
    """Relative: the second heuristic pass (a round-robin over the pipeline shapes under fixed toggle sets) runs
    when the fastest layout after the walks is more than this above the queue's least step-time bound. Walks and
    climbs move a layout by a few percent; a fastest layout that far above the bound belongs to a pipeline shape
    that does not lead."""

    heuristic_share: float = 0.05
    """Share of the time limit the heuristic passes and the sibling pricing get (the first pass half of it, the
    walks twice it), between heuristic_min_s and heuristic_max_s: a pass prices a few dozen frames per second."""

    heuristic_min_s: float = 1.0
    """Least seconds for the heuristic passes: below it a pass prices too few frames to find a fitting layout."""

    heuristic_max_s: float = 5.0
    """Most seconds for the heuristic passes: past it a pass finds no lead the walks after it would not find."""

    seed_max_share: float = 0.3
    """Most share of the time limit the seeding may take in all, and the end of the second heuristic pass when no
    fitting layout is at hand: the rest is left to CP-SAT to find a layout or prove there is none."""

    first_slices: int = 20
    """A node's first CP-SAT slice is the time limit over this (at least a second); each slice that cuts the node
    doubles the next, so a hard node gets its time in growing pieces while easier ones are reached."""

    roomy_share: float = 0.8
    """The second heuristic pass first visits frames whose persistent bytes are at most this share of their
    budget: they leave a fifth of it to activations, where fitting layouts are likely."""

    # -- the seeding (search/incumbents.py)
    library_configs: int = 4
    """Configurations of the front so far tried on each further frame the seeding visits (spread fastest to
    leanest); a frame where one adds to the front is then walked through its own configurations."""

    walked_frames: int = 3
    """Frames of the fastest layouts so far that the seeding walks through their configurations before pricing
    others."""

    patience_min_s: float = 20.0
    """Seconds the seeding goes on at least before a stall stops it (incumbents._Patience): on thousands of GPUs the
    shapes of the fastest layouts come only after hundreds of shapes of lower estimate, so the stop only shortens
    the seeding of long time limits."""

    seed_walk_share: float = 0.5
    """Share of the seeding's time the walks may take (each costs a few dozen evaluate() calls)."""

    climb_within: float = 0.02
    """The seeding climbs the split (incumbents.split_climb) of a frame whose fastest layout is within this share
    of the fastest: a climb gains a few percent at most."""

    replay_moves_priced: int = 8
    """A split climb's replay round (a layout its replayed schedule holds above its formula) prices at most this
    many of the moves its replay screen puts under the current replay, best first: the screen is evaluate()'s
    pipeline term at the coefficients' rates, so the first moves miss mostly where they do not fit."""

    sideways_moves: int = 24
    """Where a split climb with `sideways` (the driver's last climb) stops under single moves, it tries at most this
    many sideways moves, each followed by its first improving move (incumbents._SplitClimb.escape): one sideways
    move screens a few hundred second moves (about 40 ms at K3 PP8 VP4), so 24 take about a second."""

    final_climb_s: float = 2.0
    """Seconds the ranked layouts' splits are climbed once more when the seeding ends without a proof (the driver's
    `_climb_ranked`): one K3 PP8 VP4 climb through its sideways moves takes about 1.3 s."""

    climb_configs: int = 3
    """The seeding climbs at most this many configurations of one frame (its fastest first)."""

    climb_share: float = 0.3
    """Share of the seeding's time the split climbs may take (one costs tens to hundreds of evaluate() calls)."""

    climb_min_s: float = 0.5
    """Seconds a climb may take beyond the share left (the first climb comes before any share has accrued); also
    what the driver's climb of a node solution that ranks by its replay may take (driver._rebalanced)."""

    fit_repair_s: float = 3.0
    """Seconds a node's heuristic hint (incumbents.frame_incumbent, on its first CP-SAT slice) may spend moving the
    layers of a faster candidate whose heuristic splits all miss the memory line until it fits
    (incumbents.fit_repair, with its split climb): Llama 3 70B PP8 VP4 on 64 B200 takes 2.3 s."""

    spread_sources: int = 5
    """incumbents.spread prices the configuration and split of at most this many of the fastest layouts on their
    siblings (each costs one evaluate() call per sibling: tens at 512 GPUs, a hundred or more at 8,192)."""

    # -- the Pareto front (search/front.py)
    front_ranked_share: float = 0.5
    """With the front requested, the share of the time limit the ranked search may use before the front starts
    (the ranked search stops earlier when it proves its gap); the front has the rest. The ranked search is the
    first region's search and is not repeated: at a quarter of 60 s the default job's was cut at 1.39% a second
    before its proof (16 s on 2 cores), while the front's seeding makes its points within 10 s of its start."""

    front_region_share: float = 0.25
    """The most share of the time limit each region's search under its cap may take (search/front.py), so that a
    region that does not prove leaves time to the next: under the default job's first point the regions stop at the
    same 18.518-s node bound after 75 s as after 15 s."""

    front_seed_share: float = 0.85
    """Share of the front's time the seeding walks may use before the regions' searches start (they start earlier
    when every frame is seeded or dominated)."""

    front_patience_s: float = 10.0
    """The front's seeding stops once it has gone as long without changing the front as its last change took, and
    at least this long (search/front.py): on the default job it makes the front's six points in its first 8 s and
    none in the 30 s after, which the regions' searches then have."""

    front_fill_share: float = 0.5
    """Share of the front's seeding time after the ranked search's frames that the gap filling may take while
    frames are left to visit; the visits (which reach the pipeline shapes the front has no point of yet) have the
    rest."""

    front_walk_share: float = 0.4
    """Share of the front's seeding time the walks (frame_walk, costly) may take in all: a frame that adds to the
    front is walked through its own configurations while some of it is left; the other frames are priced under the
    front's configurations."""

    region_descents: int = 2
    """A region's search first brings this many of the front's points over its cap under it (search/incumbents.
    cap_descent): the leanest, then the fastest of the others."""

    region_descent_s: float = 4.0
    """Seconds each of those descents may take (about a hundred evaluate() calls per change on K3 PP8 VP4)."""

    front_region_min_s: float = 1.0
    """Seconds a region's ranked search under its cap needs at least to be started (search/front.py): with less
    left the front stops, not proven."""

    # -- a plan with a launch target (k3opt plan --target): the plan, the plan without the target's limits and the
    # price of each binding limit share the one time limit
    target_plan_share: float = 0.5
    """Of the time limit, the share the plan with the target's limits (the answer) may take."""

    target_free_share: float = 0.5
    """Of what that plan leaves, the share the plan without the limits may take; the limit prices split the rest."""

    least_price_s: float = 1.0
    """Seconds a limit price needs at least to be searched; with less left for it, it is named as not priced."""

    # -- the node models and bound programs (search/node_model.py, search/lp_bound.py, search/replay_bound.py)
    max_dag_ops: int = 512
    """Interleaved nodes with at most this many pipeline operations (2 p v M) also get the replay itself over the
    per-chunk bounds. The start-time variables grow with the operations; on K3 PP8 VP4 M64 (4,096 operations) they
    slow a fixed-split solve tenfold without raising the node's bound, so there the path cuts alone are used."""

    required_check_s: float = 1.0
    """Seconds each test of a toggle a node cannot do without (lp_bound.required_toggle_bound) may take: the
    contiguous whole-layer program decides a 61-layer, 32-chunk node in under a second."""

    min_solve_s: float = 0.05
    """Seconds a node's CP-SAT solve gets at least, even past the search's end: enough to check its hint, so a node
    whose model took the last seconds to build still returns its layout."""

    child_grace_s: float = 30.0
    """Seconds past its own limit the search waits for a solve's child (k3opt.search.isolated) before it stops it
    as hung: CP-SAT overruns its limit by well under a second, and building a large model's presolve by a few."""

    min_cut_slice_s: float = 0.5
    """Least time left for another solve after adding a replay path; with less the node returns FEASIBLE."""

    max_granular_states: int = 4096
    """Largest state space (layer counts of every kind but the most numerous) lp_bound.granular_stage runs its
    program over; above it the bound is skipped (0), which only weakens the bound."""

    kept_nodes: int = 65536
    """Entries the kept node cuts (bounds.DP_HINTS, LP_BOUNDS) hold before they start over: a node whose entry is
    gone is solved with a weaker cut (its model recomputes the hint), never a wrong one, and a long-lived process
    (the lab, a sweep) stays bounded."""

    sample_splits: int = 24
    """Sample splits whose longest replay paths join the classic ones in a node's path set
    (replay_bound.seed_paths)."""

    lp_path_rounds: int = 16
    """Most rounds of path separation per program of a node about to be solved (lp_bound._violated_path): each
    adds the replay path longest at the relaxation's own chunk times and solves again, one more GLOP solve. On K3
    PP4 VP4 M32 nodes the bound still rises at round 16 (+1.3% in all); a round that leaves it unchanged ends them."""

    # -- what a running search reports (search/progress.py)
    progress_interval_s: float = 0.25
    """Least seconds between two progress snapshots: a snapshot scans the queue (tens of thousands of entries at
    8,192 GPUs, milliseconds), so four a second cost under 1% of the search and a display refreshing once a
    second always has a fresh one."""


POLICY = SearchPolicy()
"""The policy the search runs with."""
