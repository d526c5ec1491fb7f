"""The CP-SAT search over layouts.

A *frame* is the parallel shape: p, v, c, e, f_e, f_d and M. A *node* is a frame with its recompute mode and FSDP
lifecycle fixed. One CP-SAT model per node decides everything else at once: the contiguous layer-to-chunk split,
the activation mode (FP8 storage, fused SiTU, MoE backward rewrite, dispatch recompute) and the rank toggles
(offload, balancing, host gradient shards, P2P Muon, chunked cross-entropy), under every rank's HBM and host
limits. Frames and nodes are explored best-first by lower bounds that tighten as they are popped: the mean
tensor work, then an exact dynamic program over contiguous stage ranges of a relaxed cost (v = 1), then that
program per activation mode with offload and balancing decided globally; for v > 1 the mean load raised by
memory (offload forced), then a linear relaxation over fractional layers per chunk. The search stops with a
proof once the next bound exceeds the K-th best layout found; the bound and gap it reports are that proof.

Every coefficient comes from k3opt.cost.coefficients (one call per mode combination); the model only sums them over
the split. Every layout returned is re-evaluated with `evaluate()`, and what is reported is that evaluation; a
disagreement beyond the integer resolution raises an error instead of being rounded away.

Files: `frames` (the shapes a job allows, activation modes, the per-rank memory budget), `bounds` (lower bounds
on a frame or node), `lp_bound` (linear relaxations of interleaved nodes), `node_model` (one node's CP-SAT
model), `driver` (`plan()`: the branch and bound), `front` (the Pareto front), `result` (`Plan`, `PlanItem`).
"""

from k3opt.search.bounds import frame_dp_bound, frame_lower_bound, node_lower_bound, tight_node_bound
from k3opt.search.driver import plan
from k3opt.search.frames import FIXED_TOGGLES, NEVER_CHOSEN, Frame, allocated_capacity_bytes, enumerate_frames
from k3opt.search.node_model import FrameModel, solve_frame
from k3opt.search.result import Plan, PlanItem

__all__ = ["FIXED_TOGGLES", "NEVER_CHOSEN", "Frame", "FrameModel", "Plan", "PlanItem", "allocated_capacity_bytes",
           "enumerate_frames", "frame_dp_bound", "frame_lower_bound", "node_lower_bound", "plan", "solve_frame",
           "tight_node_bound"]
