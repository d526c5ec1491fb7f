"""An EP group split unevenly over NVLink domains: Qwen3-30B-A3B at EP16 on a GB200 rack with 10 GPUs of each domain
used, so 10 EP ranks sit in one domain and 6 in the other. HybridEP sends a token over the NIC once to the one other
domain if that domain's experts hold any of the token's 8 (DeepEP README, internode kernels): at most one NIC copy
per token and exchange, with a hit probability between those of the two kinds of member. The cost model prices a
domain as E a / e experts; this pins what holds whatever the split: one other domain, a probability in range."""

from __future__ import annotations

from math import comb

import k3opt
from k3opt.cost.coefficients import Shape, coefficients
from k3opt.inputs.rates import load_rates

A2A_NIC = 43.74e9  # constraints/rates/gb200-nvl72.toml: HybridEP's measured all-to-all bandwidth across domains
T = 4096


def test_a_token_leaves_its_domain_at_most_once_when_the_domains_are_uneven():
    lay = k3opt.make_layout(gpus=16, pp=1, ep=16, dense_fsdp=16, expert_fsdp=1, microbatches=1, context=T,
                            split=[48], recompute="full", domain_gpus_used=10, dispatcher="hybridep")
    rates = load_rates("gb200-nvl72").model_copy(update={"collective_base_latency_us": None})
    cf = coefficients(Shape.of(lay), k3opt.load_model("qwen3-30b-a3b"), k3opt.load_cluster("gb200-nvl72"),
                      rates=rates)
    per_copy = 6 * T * 2048 * 2  # 6 exchanges under full recompute x T x d 2,048 x 2 B (BF16)
    copies = cf.achievable["ep_nic"][5] * A2A_NIC / per_copy  # NIC copies per token and exchange, MoE layer 5
    # 128 experts over 16 ranks, 8 each: a member of the 10 sees 6 x 8 = 48 experts in the other domain, a member
    # of the 6 sees 80; P(hit) = 1 - C(128 - x, 8) / C(128, 8).
    low, high = 1 - comb(128 - 48, 8) / comb(128, 8), 1 - comb(128 - 80, 8) / comb(128, 8)
    assert low <= copies <= high < 1
