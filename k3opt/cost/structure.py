"""Model structure derived from shapes: per-layer parameter inventory (Muon / AdamW, routed / non-routed,
learned active matrices per token) and per-layer-kind saved-for-backward tensors.

Nothing here is a typed-in total: every count is a product of the shapes in the model TOML. The layer kinds
(KDA, gated MLA, DeepSeek-V3 MLA or GQA attention; dense FFN or MoE with or without latent compression and
shared experts; AttnRes or plain residuals; embedding, vision, LM head and MTP modules on the edges) are read
from the model file, so other presets are data, not code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import prod

from k3opt.inputs.errors import LayoutError
from k3opt.inputs.memo import register
from k3opt.inputs.specs import BF16, FP32, INT64, Layout, ModelSpec, OffloadModule, Precision


@dataclass(frozen=True)
class Tensor:
    """One trainable tensor (or `count` identical ones, e.g. the experts of a layer)."""

    name: str
    shape: tuple[int, ...]
    optimizer: str  # "muon" | "adamw"
    count: int = 1
    routed: bool = False
    active_per_token: int = 0
    """How many of the `count` copies a token multiplies with (0: no per-token matmul work)."""

    @property
    def numel(self) -> int:
        return prod(self.shape) * self.count

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def active_matrix_params(self) -> int:
        return prod(self.shape) * self.active_per_token if self.is_matrix else 0


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps for backward, per token. `gemm_input`: a GEMM input (FP8-storable);
    `recomputable`: the output of an element-wise or short-conv op that selective recompute replays;
    `role`: a toggle hook (situ_naive, situ_fused, dispatch_copy, expert_output). Of a GEMM input, `bf16_reader`:
    also read by a GEMM that stays BF16 (the router, the output layer), whose backward keeps the BF16 tensor;
    `quantized_reader`: read by a GEMM that runs in the compute precision (which keeps its own quantized copy).
    `copy_only`: a GEMM's own quantized copy of a tensor saved above in BF16, with no bytes of its own when the
    GEMM runs BF16 without FP8 storage (it then keeps a reference to that tensor).
    `routed`: saved by the routed experts (the dispatched inputs, the expert activations and outputs), the part of
    the MoE block Megatron's combined 1F1B schedule runs as its `mlp` node."""

    name: str
    values_per_token: int
    bytes_per_value: int
    gemm_input: bool = False
    recomputable: bool = False
    role: str = ""
    bf16_reader: bool = False
    quantized_reader: bool = True
    copy_only: bool = False
    routed: bool = False

    @property
    def bytes_per_token(self) -> int:
        return self.values_per_token * self.bytes_per_value


@dataclass(frozen=True)
class Block:
    """A sub-layer (attention, FFN, norms) or an edge block (embedding, vision, LM head)."""

    name: str
    kind: str
    tensors: tuple[Tensor, ...]
    saved: tuple[Saved, ...] = ()
    attention_flops_per_token_per_doc_token: int = 0
    """Causal training (fwd + bwd) score/value FLOPs per token per token of its document: 3 H (d_qk + d_v)."""
    scan_flops_per_token: int = 0
    """Training FLOPs of the chunked linear-attention scan per token (fwd + bwd)."""
    moe_layers: int = 0

    def params(self, optimizer: str | None = None, routed: bool | None = None) -> int:
        return sum(
            t.numel for t in self.tensors
            if (optimizer is None or t.optimizer == optimizer) and (routed is None or t.routed == routed)
        )

    @property
    def active_matrix_params(self) -> int:
        return sum(t.active_matrix_params for t in self.tensors)

    @property
    def routed_active_params(self) -> int:
        return sum(t.active_matrix_params for t in self.tensors if t.routed)

    @property
    def non_matmul_text_params(self) -> int:
        """Small non-matmul weights (norms, conv, biases) counted by the conventional active figure."""
        if self.kind in ("embedding", "vision"):
            return 0
        return sum(t.numel for t in self.tensors if t.active_per_token == 0 and not t.routed
                   and not (t.is_matrix and t.name.endswith(("lm_head", "embed"))))


def _m(name: str, out: int, inp: int, opt: str, active: bool = True) -> Tensor:
    return Tensor(name, (out, inp), opt, active_per_token=1 if active else 0)


def _v(name: str, *shape: int) -> Tensor:
    return Tensor(name, tuple(shape), "adamw")


class Structure:
    """The block inventory of one model: `layers[i]` is the list of blocks of layer i; `first` and `last`
    are the edge blocks carried by the first and the last chunk."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self._adamw = set(model.optimizer.adamw_matrices)
        self.layers: list[list[Block]] = [self._layer(i) for i in range(model.num_layers)]
        self.first: list[Block] = [self._embedding()] + ([self._vision()] if model.vision else [])
        self.last: list[Block] = [self._head(), *self._mtp()]

    # -- helpers --------------------------------------------------------------------------------
    def _opt(self, qualified: str) -> str:
        if self.model.optimizer.name == "adamw":
            return "adamw"
        return "adamw" if qualified in self._adamw else "muon"

    def is_full(self, i: int) -> bool:
        """Softmax (MLA or GQA) attention; otherwise KDA."""
        return i in self.model.full_attention_layers

    def is_mla(self, i: int) -> bool:
        return self.is_full(i) and self.model.mla is not None

    def is_gqa(self, i: int) -> bool:
        return self.is_full(i) and self.model.gqa is not None

    def is_dense(self, i: int) -> bool:
        return i in self.model.dense_ffn_layers

    def attention_kind(self, i: int) -> str:
        return "mla" if self.is_mla(i) else "gqa" if self.is_gqa(i) else "kda"

    def layer_kind(self, i: int) -> str:
        return f"{self.attention_kind(i)}+{'dense' if self.is_dense(i) else 'moe'}"

    # -- blocks ---------------------------------------------------------------------------------
    def _norm_saved(self, prefix: str, bf16_reader: bool = False, quantized_reader: bool = True
                    ) -> tuple[Saved, ...]:
        d = self.model.hidden_size
        return (
            Saved(f"{prefix}_norm_input", d, BF16),
            Saved(f"{prefix}_norm_rstd", 1, FP32),
            Saved(f"{prefix}_norm_output", d, BF16, gemm_input=True, recomputable=True,
                  bf16_reader=bf16_reader, quantized_reader=quantized_reader),
        )

    def _attn_res_saved(self, prefix: str) -> tuple[Saved, ...]:
        ar = self.model.attn_res
        if ar is None:
            return ()
        return (Saved(f"{prefix}_attn_res_scores", ar.bank_representatives, FP32),)

    def _kda(self, i: int) -> Block:
        k, d = self.model.kda, self.model.hidden_size
        assert k is not None
        hd = k.num_heads * k.head_dim
        t = [_m(f"kda.{n}_proj", hd, d, self._opt(f"kda.{n}_proj")) for n in ("q", "k", "v")]
        if k.full_rank_output_gate:
            t.append(_m("kda.g_proj", hd, d, self._opt("kda.g_proj")))
        t += [
            _m("kda.o_proj", d, hd, self._opt("kda.o_proj")),
            _m("kda.f_a_proj", k.decay_rank, d, self._opt("kda.f_a_proj")),
            _m("kda.f_b_proj", hd, k.decay_rank, self._opt("kda.f_b_proj")),
            _m("kda.beta_proj", k.num_heads, d, self._opt("kda.beta_proj")),
            _v("kda.conv1d", 3, hd, k.short_conv_kernel),
            _v("kda.dt_bias", hd),
            _v("kda.A_log", k.num_heads),
            _v("kda.o_norm", k.head_dim),
        ]
        saved = (
            *self._norm_saved("attn"),
            *self._attn_res_saved("attn"),
            Saved("kda_qkv_pre_conv", 3 * hd, BF16),
            Saved("kda_qkv_post_conv", 3 * hd, BF16, recomputable=True),
            Saved("kda_decay_lowrank", k.decay_rank, BF16, gemm_input=True),
            Saved("kda_decay_gate", hd, BF16),
            Saved("kda_beta", k.num_heads, FP32),
            Saved("kda_output_gate", hd, BF16),
            Saved("kda_scan_output", hd, BF16),
            Saved("kda_gated_norm_output", hd, BF16, gemm_input=True, recomputable=True),
        )
        c, dk = k.chunk_size, k.head_dim
        # Chunked delta rule, per token per head, forward: intra-chunk K K^T, W = T K, U = T V, Q K^T and
        # A V cost C(4 dk + 3 dv); the inter-chunk state read q S, W S and K^T U' cost 6 dk dv. Training = 3x.
        scan = 3 * k.num_heads * (c * (4 * dk + 3 * dk) + 6 * dk * dk)
        return Block(f"layer{i}.kda", "kda", tuple(t), saved, scan_flops_per_token=scan)

    def _mla(self, i: int) -> Block:
        a, d = self.model.mla, self.model.hidden_size
        assert a is not None
        h, qk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        t = [
            _m("mla.q_a_proj", a.q_lora_rank, d, self._opt("mla.q_a_proj")),
            _m("mla.q_b_proj", h * qk, a.q_lora_rank, self._opt("mla.q_b_proj")),
            _m("mla.kv_a_proj", a.kv_lora_rank + a.qk_rope_head_dim, d, self._opt("mla.kv_a_proj")),
            _m("mla.kv_b_proj", h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank,
               self._opt("mla.kv_b_proj")),
            _m("mla.o_proj", d, h * a.v_head_dim, self._opt("mla.o_proj")),
            _v("mla.q_a_norm", a.q_lora_rank),
            _v("mla.kv_a_norm", a.kv_lora_rank),
        ]
        saved = [
            *self._norm_saved("attn"),
            *self._attn_res_saved("attn"),
            Saved("mla_q_a_output", a.q_lora_rank, BF16),
            Saved("mla_q_a_norm_output", a.q_lora_rank, BF16, gemm_input=True, recomputable=True),
            Saved("mla_kv_a_output", a.kv_lora_rank + a.qk_rope_head_dim, BF16),
            Saved("mla_kv_a_norm_output", a.kv_lora_rank, BF16, gemm_input=True, recomputable=True),
            Saved("mla_q", h * qk, BF16),
            Saved("mla_k", h * qk, BF16),
            Saved("mla_v", h * a.v_head_dim, BF16),
            # The attention core keeps its BF16 output O for its own backward; without an output gate O is also
            # the output projection's input, which keeps its own quantized copy besides.
            Saved("mla_attn_output", h * a.v_head_dim, BF16),
            Saved("mla_softmax_lse", h, FP32),
        ]
        if not a.output_gate:
            saved.append(Saved("mla_o_proj_input_copy", h * a.v_head_dim, BF16, gemm_input=True, copy_only=True))
        if a.output_gate:
            t.append(_m("mla.g_proj", h * a.v_head_dim, d, self._opt("mla.g_proj")))
            saved += [
                Saved("mla_output_gate", h * a.v_head_dim, BF16),
                Saved("mla_gated_output", h * a.v_head_dim, BF16, gemm_input=True, recomputable=True),
            ]
        attn = 3 * h * (qk + a.v_head_dim)  # causal: half of 2 * 2 * S * H * (d_qk + d_v), times 3
        return Block(f"layer{i}.mla", "mla", tuple(t), tuple(saved),
                     attention_flops_per_token_per_doc_token=attn)

    def _gqa(self, i: int) -> Block:
        a, d = self.model.gqa, self.model.hidden_size
        assert a is not None
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        t = [
            _m("gqa.q_proj", q, d, self._opt("gqa.q_proj")),
            _m("gqa.k_proj", kv, d, self._opt("gqa.k_proj")),
            _m("gqa.v_proj", kv, d, self._opt("gqa.v_proj")),
            _m("gqa.o_proj", d, q, self._opt("gqa.o_proj")),
        ]
        if a.attention_bias:
            t += [_v("gqa.q_bias", q), _v("gqa.k_bias", kv), _v("gqa.v_bias", kv)]
        saved = [
            *self._norm_saved("attn"),
            *self._attn_res_saved("attn"),
            Saved("gqa_q", q, BF16),
            Saved("gqa_k", kv, BF16),
            Saved("gqa_v", kv, BF16),
            Saved("gqa_attn_output", q, BF16),  # the attention core's O
            Saved("gqa_o_proj_input_copy", q, BF16, gemm_input=True, copy_only=True),
            Saved("gqa_softmax_lse", a.num_heads, FP32),
        ]
        if a.qk_norm:
            t += [_v("gqa.q_norm", a.head_dim), _v("gqa.k_norm", a.head_dim)]
            saved += [Saved("gqa_q_pre_norm", q, BF16), Saved("gqa_k_pre_norm", kv, BF16)]
        # Causal score/value contractions: half of 2 * 2 * S * H * (d_qk + d_v) forward, times 3 for training.
        attn = 3 * a.num_heads * (2 * a.head_dim)
        return Block(f"layer{i}.gqa", "gqa", tuple(t), tuple(saved), attention_flops_per_token_per_doc_token=attn)

    def _situ(self, prefix: str, rows_per_token: int, width: int, routed: bool = False) -> tuple[Saved, ...]:
        if self.model.ffn_activation == "swiglu":
            return (Saved(f"{prefix}_swiglu_input", 2 * rows_per_token * width, BF16, routed=routed),)
        # Seed 004: naive SiTU-GLU autograd keeps 6 FP32 [R, H]; the fused op keeps the BF16 [R, 2H] input.
        return (
            Saved(f"{prefix}_situ_fp32_copies", 6 * rows_per_token * width, FP32, role="situ_naive", routed=routed),
            Saved(f"{prefix}_situ_input", 2 * rows_per_token * width, BF16, role="situ_fused", routed=routed),
        )

    def _dense_ffn(self, i: int) -> Block:
        f, d = self.model.dense_ffn, self.model.hidden_size
        assert f is not None
        n = f.intermediate_size
        t = (
            _m("ffn.gate_proj", n, d, self._opt("ffn.gate_proj")),
            _m("ffn.up_proj", n, d, self._opt("ffn.up_proj")),
            _m("ffn.down_proj", d, n, self._opt("ffn.down_proj")),
        )
        saved = (
            *self._norm_saved("mlp"),
            *self._attn_res_saved("mlp"),
            *self._situ("ffn", 1, n),
            Saved("ffn_act_output", n, BF16, gemm_input=True, recomputable=True),
        )
        return Block(f"layer{i}.dense_ffn", "dense_ffn", t, saved)

    def _moe(self, i: int) -> Block:
        m, d = self.model.moe, self.model.hidden_size
        assert m is not None
        k, f, s = m.experts_per_token, m.expert_intermediate_size, m.shared_intermediate_size
        w = self.model.dispatch_width
        t = [_m("moe.router", m.num_experts, d, self._opt("moe.router"))]
        if m.router_bias:
            t.append(_v("moe.router_bias", m.num_experts))
        if m.latent_size is not None:
            t += [
                _m("moe.latent_down", w, d, self._opt("moe.latent_down")),
                _m("moe.latent_up", d, w, self._opt("moe.latent_up")),
                _v("moe.latent_norm", w),
            ]
        for name, shape in (("w1", (f, w)), ("w3", (f, w)), ("w2", (w, f))):
            t.append(Tensor(f"moe.experts.{name}", shape, self._opt(f"moe.experts.{name}"),
                            count=m.num_experts, routed=True, active_per_token=k))
        # The router (BF16) reads the norm output; a GEMM in the compute precision reads it only through the
        # latent down-projection or the shared experts (the routed experts read the dispatched copies).
        saved = [
            *self._norm_saved("mlp", bf16_reader=True, quantized_reader=m.latent_size is not None or bool(s)),
            *self._attn_res_saved("mlp"),
            Saved("moe_router_scores", m.num_experts, FP32),
            Saved("moe_topk_weights", k, FP32),
            Saved("moe_topk_indices", k, INT64),
        ]
        if m.latent_size is not None:
            saved += [Saved("moe_latent_down_output", w, BF16),
                      Saved("moe_latent_norm_output", w, BF16, recomputable=True)]
        saved += [
            Saved("moe_dispatched_inputs", k * w, BF16, gemm_input=True, role="dispatch_copy", routed=True),
            *self._situ("moe_expert", k, f, routed=True),
            Saved("moe_expert_act_output", k * f, BF16, gemm_input=True, recomputable=True, routed=True),
            Saved("moe_expert_outputs", k * w, BF16, role="expert_output", routed=True),
        ]
        if m.latent_size is not None:
            saved.append(Saved("moe_combined_latent", w, BF16, gemm_input=True))
        if s:
            t += [
                _m("moe.shared_gate", s, d, self._opt("moe.shared_gate")),
                _m("moe.shared_up", s, d, self._opt("moe.shared_up")),
                _m("moe.shared_down", d, s, self._opt("moe.shared_down")),
            ]
            saved += [*self._situ("moe_shared", 1, s),
                      Saved("moe_shared_act_output", s, BF16, gemm_input=True, recomputable=True)]
        return Block(f"layer{i}.moe", "moe", tuple(t), tuple(saved), moe_layers=1)

    def _layer_vectors(self, i: int) -> Block:
        d = self.model.hidden_size
        t = [_v("input_norm", d), _v("post_attention_norm", d)]
        if self.model.attn_res is not None:
            # The layer-0 attention pair is never used (the bank is empty there) and is not counted.
            if i > 0:
                t += [_v("attn_res.attn_norm", d), _v("attn_res.attn_proj", 1, d)]
            t += [_v("attn_res.mlp_norm", d), _v("attn_res.mlp_proj", 1, d)]
        return Block(f"layer{i}.vectors", "vectors", tuple(t))

    def _layer(self, i: int) -> list[Block]:
        attn = self._mla(i) if self.is_mla(i) else self._gqa(i) if self.is_gqa(i) else self._kda(i)
        ffn = self._dense_ffn(i) if self.is_dense(i) else self._moe(i)
        return [attn, ffn, self._layer_vectors(i)]

    def _embedding(self) -> Block:
        d, v = self.model.hidden_size, self.model.vocab_size
        return Block("embedding", "embedding", (Tensor("embed", (v, d), "adamw"),),
                     (Saved("token_ids", 1, INT64),))

    def _head(self) -> Block:
        d, v = self.model.hidden_size, self.model.vocab_size
        t = [_v("final_norm", d)]
        if self.model.attn_res is not None:
            t += [_v("attn_res.output_norm", d), _v("attn_res.output_proj", 1, d)]
        if not self.model.tie_word_embeddings:
            t.append(Tensor("lm_head", (v, d), "adamw", active_per_token=1))
        return Block("lm_head", "head", tuple(t), self._norm_saved("final", bf16_reader=True, quantized_reader=False))

    def _mtp(self) -> list[Block]:
        """DeepSeek-V3 MTP modules on the last stage: enorm, hnorm, eh_proj [d, 2d], one decoder layer of
        the last layer's kinds, the module's own output norm, and one more pass through the shared head
        (FLOPs, no parameters: the head and the embedding are shared with the main model)."""
        mtp, d, v = self.model.mtp, self.model.hidden_size, self.model.vocab_size
        if mtp is None:
            return []
        last = self.model.num_layers - 1
        blocks: list[Block] = []
        for j in range(mtp.num_layers):
            t = (
                _v("mtp.enorm", d), _v("mtp.hnorm", d),
                _m("mtp.eh_proj", d, 2 * d, self._opt("mtp.eh_proj")),
                _v("mtp.final_norm", d),
                Tensor("mtp.shared_head", (v, d), "adamw", count=0, active_per_token=1),
            )
            saved = (Saved(f"mtp{j}_norm_outputs", 2 * d, BF16, gemm_input=True),
                     *self._norm_saved(f"mtp{j}_final", bf16_reader=True, quantized_reader=False))
            blocks.append(Block(f"mtp{j}.proj", "mtp", t, saved))
            blocks += [replace(b, name=f"mtp{j}.{b.name.split('.', 1)[1]}") for b in self._layer(last)]
        return blocks

    def _vision(self) -> Block:
        vs, d = self.model.vision, self.model.hidden_size
        assert vs is not None
        w, qkv = vs.hidden_size, vs.num_heads * vs.head_dim
        t = []
        for name, shape in (("wqkv", (3 * qkv, w)), ("wo", (w, qkv)), ("fc0", (vs.intermediate_size, w)),
                            ("fc1", (w, vs.intermediate_size)), ("norm0", (w,)), ("norm1", (w,))):
            t.append(Tensor(f"vision.blocks.{name}", shape, "adamw", count=vs.num_blocks))
        t += [
            Tensor("vision.patch_embed", (w, vs.image_channels, vs.patch_size, vs.patch_size), "adamw"),
            Tensor("vision.pos_emb", (vs.pos_emb_grid, vs.pos_emb_grid, w), "adamw"),
            _v("vision.final_norm", w),
            Tensor("projector.proj0", (vs.projector_hidden_size, w * vs.merge_kernel), "adamw"),
            Tensor("projector.proj2", (d, vs.projector_hidden_size), "adamw"),
            _v("projector.post_norm", d),
        ]
        return Block("vision", "vision", tuple(t))

    # -- whole-model figures --------------------------------------------------------------------
    def all_blocks(self) -> list[Block]:
        return [b for layer in self.layers for b in layer] + self.first + self.last

    def _sum(self, fn) -> int:  # noqa: ANN001
        return sum(fn(b) for b in self.all_blocks())

    @cached_property
    def params(self) -> ParamCounts:
        total = self._sum(lambda b: b.params())
        muon = self._sum(lambda b: b.params("muon"))
        routed = self._sum(lambda b: b.params(routed=True))
        active = self._sum(lambda b: b.active_matrix_params)
        return ParamCounts(
            total=total, muon=muon, adamw=total - muon, routed=routed, active_matrix=active,
            active_routed=self._sum(lambda b: b.routed_active_params),
            active_conventional=active + self._sum(lambda b: b.non_matmul_text_params),
            mtp=sum(b.params() for b in self.last if b.name.startswith("mtp")),
        )

    def saved_values_per_token(self, kind: str, fused_situ: bool = False) -> int:
        """Saved-for-backward values per token of one block kind without recompute (seed 001 cross-check:
        KDA about 70k, MLA about 75k, MoE about 245k)."""
        block = next(b for layer in self.layers for b in layer if b.kind == kind)
        drop = "situ_naive" if fused_situ else "situ_fused"
        return sum(s.values_per_token for s in block.saved if s.role != drop)

    def muon_matrices(self, blocks: list[Block]) -> list[tuple[Tensor, int]]:
        return [(t, t.count) for b in blocks for t in b.tensors if t.optimizer == "muon" and t.is_matrix]


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter figures (ints)."""

    total: int
    muon: int
    adamw: int
    routed: int
    active_matrix: int
    """Learned matrix parameters a token multiplies with (routed top-k share, LM head, no embedding)."""
    active_routed: int
    active_conventional: int
    """Active matrices plus the small non-matmul text weights (the conventional 'active parameters')."""
    mtp: int = 0
    """Parameters of the MTP modules (included in `total`; the shared embedding and head are not repeated)."""

    @property
    def training_flops_per_token(self) -> int:
        """6 x active matrix parameters (2 forward, 4 backward)."""
        return 6 * self.active_matrix


SEED_001_SAVED_VALUES_PER_TOKEN = {"kda": 70_000, "mla": 75_000, "moe": 245_000}
"""Seed 001's order-of-magnitude figures, shown beside the derived values (never used as inputs)."""

@dataclass(frozen=True)
class ModuleRecompute:
    """What one Megatron selective-recompute module drops from a block's saved set and replays in backward."""

    block_kind: str
    """The Block.kind it acts on."""
    saved: tuple[str, ...]
    """Saved names it drops; the checkpoint's own inputs stay saved."""
    replayed: tuple[str, ...]
    """Tensor names whose GEMMs run again in backward (forward only: 2 FLOPs per weight per token)."""
    source: str


MEGATRON_RECOMPUTE: dict[str, ModuleRecompute] = {
    "mla_up_proj": ModuleRecompute(
        "mla",
        # The up-projections fuse the q / kv layernorms (TELayerNormColumnParallelLinear), so their normed inputs
        # go with them; q, k, v are the checkpoint's outputs, discarded once the attention core has read them.
        ("mla_q_a_norm_output", "mla_kv_a_norm_output", "mla_q", "mla_k", "mla_v"),
        ("mla.q_b_proj", "mla.kv_b_proj"),
        "megatron/core/transformer/multi_latent_attention.py L171-174, L855-990, L455-458 (CheckpointWithoutOutput "
        "over qkv_up_proj_and_rope_apply, output discarded after the core attention)"),
    "mlp": ModuleRecompute(
        "dense_ffn",
        ("mlp_norm_rstd", "mlp_norm_output", "ffn_swiglu_input", "ffn_situ_fp32_copies", "ffn_situ_input",
         "ffn_act_output"),
        ("ffn.gate_proj", "ffn.up_proj", "ffn.down_proj"),
        "megatron/core/transformer/transformer_layer.py L537-539, L992-1010 (non-MoE layers: the MLP checkpointed "
        "at its input, the residual stream)"),
}
"""Megatron's recompute modules k3opt prices, at megatron/core @ d98e8a64 (k3opt.inputs.frameworks)."""


_MLA_QKV = ("attn_norm_input", "attn_norm_rstd", "attn_norm_output", "mla_q_a_output", "mla_q_a_norm_output",
            "mla_kv_a_output", "mla_kv_a_norm_output")
_GQA_QKV = ("attn_norm_input", "attn_norm_rstd", "attn_norm_output", "gqa_q_pre_norm", "gqa_k_pre_norm")

MEGATRON_OFFLOAD: dict[str, dict[str, tuple[str, ...]]] = {
    # Megatron's TE layer specs fuse the input norm into the QKV (MLA: down-) projection
    # (megatron/core/models/gpt/gpt_layer_specs.py L258-266), so input_layernorm is an IdentityOp and attn_norm
    # offloads nothing (transformer_layer.py L1547-1549); the norm's tensors go with qkv_linear. KDA layers have no
    # Megatron offload hooks: their attention part stays on the GPU under every module.
    "attn_norm": {},
    "qkv_linear": {"mla": _MLA_QKV, "gqa": _GQA_QKV},
    "core_attn": {"mla": ("mla_q", "mla_k", "mla_v", "mla_attn_output", "mla_softmax_lse"),
                  "gqa": ("gqa_q", "gqa_k", "gqa_v", "gqa_attn_output", "gqa_softmax_lse")},
    "attn_proj": {"mla": ("mla_o_proj_input_copy", "mla_gated_output"), "gqa": ("gqa_o_proj_input_copy",)},
    # pre_mlp_layernorm is a norm of its own in MoE layers and fused into fc1 in dense ones (gpt_layer_specs.py
    # L157, L282); its output is saved by its readers (router, latent or shared projections), outside the scope.
    "mlp_norm": {"moe": ("mlp_norm_input", "mlp_norm_rstd")},
    "expert_fc1": {"moe": ("moe_dispatched_inputs",)},
    # The scope wraps the activation function only (moe/experts.py L941-1037): fc2 keeps its own input outside it.
    "moe_act": {"moe": ("moe_expert_swiglu_input", "moe_expert_situ_fp32_copies", "moe_expert_situ_input")},
}
"""Per Megatron offload module and block kind, the saved tensors autograd keeps inside the module's scope, which
fine-grained activation offloading sends to the host (megatron/core/pipeline_parallel/
fine_grained_activation_offload.py on_save_for_backward; scopes: transformer/multi_latent_attention.py L343-465,
attention.py L1386-1630, transformer_layer.py L819, moe/experts.py L929-1037 @ d98e8a64)."""


def module_offload(block: Block, modules: tuple[str, ...]) -> frozenset[str]:
    """The saved names of `block` that Megatron's offload `modules` send to the host (MEGATRON_OFFLOAD)."""
    return frozenset(n for m in modules for n in MEGATRON_OFFLOAD[m].get(block.kind, ()))


def offloads_nothing(modules: list[OffloadModule], model: ModelSpec) -> str | None:
    """Why the first of `modules` that holds no saved tensor in any decoder layer of the model offloads nothing
    (None when each holds some): one line, naming the module and what to do."""
    blocks = [b for layer in structure_of(model).layers for b in layer]
    for m in modules:
        if not any(module_offload(b, (m.value,)) for b in blocks):
            why = _OFFLOAD_NOTHING.get(m.value, "none of its decoder layers has that module with Megatron's offload "
                                                "hooks (KDA layers have none)")
            return f"offload_modules '{m.value}' offloads nothing in {model.name}: {why}; drop it"
    return None


def check_offload_modules(layout: Layout, model: ModelSpec) -> None:
    """Each of the layout's offload modules must hold saved tensors in some decoder layer of the model; expert_fc1
    under per-tensor FP8 keeps fc1's BF16 input (Megatron set_save_original_input, moe/experts.py L281-284), which
    k3opt does not price. LayoutError, one line, otherwise."""
    why = offloads_nothing(layout.offload_modules, model)
    if why:
        raise LayoutError(why)
    if OffloadModule.EXPERT_FC1 in layout.offload_modules and layout.precision == Precision.FP8:
        raise LayoutError("offload_modules 'expert_fc1' with precision = \"fp8\": Megatron then offloads fc1's BF16 "
                          "input rather than its FP8 copy (moe/experts.py L281-284), which k3opt does not price; use "
                          "mxfp8 or drop expert_fc1")


_OFFLOAD_NOTHING = {
    "attn_norm": "Megatron's TE layer specs fuse the input norm into the QKV projection (an IdentityOp norm, "
                 "gpt_layer_specs.py L258-266), and KDA layers have no offload hooks",
    "mlp_norm": "only MoE layers have a pre-MLP norm of their own (gpt_layer_specs.py L157)",
    "expert_fc1": "it has no routed experts",
    "moe_act": "it has no routed experts",
}
"""Why a module offloads nothing, where the reason is not just a missing part."""


def replays(block_kind: str, tensor: str, modules: tuple[str, ...]) -> bool:
    """Whether Megatron's recompute `modules` run the GEMM of `tensor` (in a block of `block_kind`) once more."""
    return any(block_kind == MEGATRON_RECOMPUTE[m].block_kind and tensor in MEGATRON_RECOMPUTE[m].replayed
               for m in modules)


def module_recompute(block: Block, modules: tuple[str, ...]) -> tuple[frozenset[str], int]:
    """(saved names dropped, replayed active matrix weights per token) of `block` under Megatron's `modules`."""
    dropped: set[str] = set()
    for name in modules:
        mr = MEGATRON_RECOMPUTE[name]
        if block.kind == mr.block_kind:
            dropped.update(mr.saved)
    replayed = sum(t.active_matrix_params for t in block.tensors if replays(block.kind, t.name, modules))
    return frozenset(dropped), replayed


_CACHE: dict[str, Structure] = register({})


def structure_of(model: ModelSpec) -> Structure:
    key = model.model_dump_json()
    if key not in _CACHE:
        _CACHE[key] = Structure(model)
    return _CACHE[key]
