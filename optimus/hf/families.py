"""Which Hugging Face Transformers family an Optimus model is, and its `config.json`.

An export is only worth having if Transformers computes exactly what Optimus computed, so a
model maps to a family only where every operation matches (checked against the source of
transformers 5.23, the release pinned in pyproject's `hf` extra):

- dense -> `LlamaForCausalLM`: RMSNorm, GQA attention without biases, RoPE (rotate-half; the
  q/k rows are permuted on export, `tensors.py`), SwiGLU, untied head.
- dense with `qk_norm` -> `Qwen3ForCausalLM`: Llama's computation plus an RMSNorm of head_dim
  on each head's q and k before RoPE (`q_norm`, `k_norm`, eps `rms_norm_eps`), as here; no
  sliding window.
- MoE, softmax router, top-k weights not renormalised, no shared experts -> `Qwen2MoeForCausalLM`
  with `norm_topk_prob: false`, `qkv_bias: false`, dense first layers as `mlp_only_layers`. Its
  shared expert cannot be switched off: it is written with zero width, so it adds exactly zero
  and its sigmoid gate (written as zeros) multiplies nothing.
- MoE, sigmoid router renormalised over the top k, any number of ungated shared experts, the
  loss-free bias -> `Glm4MoeForCausalLM` (DeepSeek-V3 routing on standard GQA attention):
  `n_group: 1, topk_group: 1, routed_scaling_factor: 1, norm_topk_prob: true`, the bias as
  `e_score_correction_bias` (added for choosing only, as here), `use_qk_norm: false`,
  `partial_rotary_factor: 1`, `first_k_dense_replace` = dense_layers.
- `qk_norm` with MoE: the softmax case -> `Qwen3MoeForCausalLM` (Qwen2-MoE's routing, no shared
  expert at all, q/k norms per head as Qwen3), the sigmoid case -> GLM-4-MoE with
  `use_qk_norm: true` (its q/k norms are per head too). So every exportable model exports with
  QK-norm as well; OLMo 2's and OLMoE's q/k norms span all the heads at once, which is not
  what `qk_norm` computes.

Families that were checked and do not match: DeepSeek-V2/V3 (multi-head latent attention),
OLMoE, Dots1 (q/k norms that cannot be switched off), Mixtral, Cohere2-MoE and
Ernie-4.5-MoE (the top-k softmax weights always renormalised; Cohere2 also runs attention and MLP
in parallel). What matches nothing is refused by `choose_family` with the reason;
docs/checkpoints.md has the table.

Pure Python: `config.json` is written and read as a dict, so an export needs no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimus.checkpoint.manifest import CheckpointError
from optimus.models.counts import is_moe_layer


@dataclass(frozen=True)
class Family:
    name: str  # short, for messages
    model_type: str
    architecture: str


LLAMA = Family("Llama", "llama", "LlamaForCausalLM")
QWEN3 = Family("Qwen3", "qwen3", "Qwen3ForCausalLM")
QWEN2_MOE = Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM")
QWEN3_MOE = Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM")
GLM4_MOE = Family("GLM-4-MoE", "glm4_moe", "Glm4MoeForCausalLM")
FAMILIES = {f.model_type: f for f in (LLAMA, QWEN3, QWEN2_MOE, QWEN3_MOE, GLM4_MOE)}


def has_moe(cfg) -> bool:
    return any(is_moe_layer(cfg, i) for i in range(cfg.n_layers))


def choose_family(cfg, bias_nonzero: bool = False) -> Family:
    """The family that computes exactly what `cfg` does, or CheckpointError saying why none.

    `bias_nonzero`: whether any layer's loss-free balancing bias (`expert_bias`) is non-zero
    in the weights being exported; it matters only for a softmax router."""
    if not has_moe(cfg):
        return QWEN3 if cfg.qk_norm else LLAMA
    m = cfg.moe
    softmax = QWEN3_MOE if cfg.qk_norm else QWEN2_MOE  # the family of a softmax router
    what = f"model.moe (score={m.score}, shared_experts={m.shared_experts}, balance={m.balance})"
    if m.capacity_factor is not None:
        raise CheckpointError(
            f"{what} drops tokens (capacity_factor={m.capacity_factor}); every Transformers MoE "
            "is dropless, so the exported model would compute something else. Only a dropless "
            "model (moe.capacity_factor: null) exports")
    if m.score == "sigmoid":
        if m.experts < 2:
            raise CheckpointError(
                f"{what} has {m.experts} expert; GLM-4-MoE's router scores each expert group by "
                "its top two experts, so it needs at least 2 experts (moe.experts >= 2)")
        return GLM4_MOE
    if m.shared_experts:
        raise CheckpointError(
            f"{what}: no Transformers family has a softmax router without top-k renormalisation "
            "and ungated shared experts on standard attention (Qwen2-MoE gates its shared "
            "expert with a sigmoid, DeepSeek-V2 uses latent attention). Exportable: "
            f"moe.score: sigmoid (GLM-4-MoE) or moe.shared_experts: 0 ({softmax.name})")
    if bias_nonzero:
        raise CheckpointError(
            f"{what}: the loss-free bias is non-zero, and no Transformers family adds a "
            "selection bias to softmax scores without renormalising the top k (Ernie-4.5-MoE "
            "renormalises). Exportable: moe.score: sigmoid (GLM-4-MoE, which has the bias), or "
            f"a softmax model trained with moe.balance: aux_loss or none ({softmax.name})")
    return softmax


def _rope(cfg, family: Family) -> dict:
    # Both spellings: transformers 5 reads `rope_parameters`, 4.x and other readers the flat
    # `rope_theta` (5.x moves it into `rope_parameters` when both agree).
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"rope_theta": cfg.rope_theta, "rope_parameters": params}
    if family is GLM4_MOE:  # GLM-4.5 rotates half of each head by default: here all of it
        params["partial_rotary_factor"] = 1.0
        out["partial_rotary_factor"] = 1.0
    return out


def hf_config(cfg, family: Family, dtype: str = "float32", eos_id: int | None = None) -> dict:
    """`config.json` of the exported model: the family's names for `cfg`'s settings."""
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **_rope(cfg, family),
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "dtype": dtype,
    }
    m = cfg.moe
    if family is LLAMA:
        out.update(attention_bias=False, mlp_bias=False)
    elif family is QWEN3:
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                   max_window_layers=cfg.n_layers,
                   layer_types=["full_attention"] * cfg.n_layers)
    elif family in (QWEN2_MOE, QWEN3_MOE):
        out.update(num_experts=m.experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.expert_ffn_dim, norm_topk_prob=False,
                   decoder_sparse_step=1, mlp_only_layers=list(range(m.dense_layers)),
                   use_sliding_window=False, router_aux_loss_coef=m.aux_loss_coeff)
        if family is QWEN2_MOE:
            out.update(shared_expert_intermediate_size=0, qkv_bias=False)
        else:
            out.update(attention_bias=False, sliding_window=None)
    else:
        out.update(n_routed_experts=m.experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.expert_ffn_dim, n_shared_experts=m.shared_experts,
                   first_k_dense_replace=m.dense_layers, norm_topk_prob=True,
                   routed_scaling_factor=1.0, n_group=1, topk_group=1,
                   use_qk_norm=cfg.qk_norm, attention_bias=False, num_nextn_predict_layers=0)
    return out


# What must agree between a job's model and an imported config.json: (key in config.json,
# the job's field it shows, the value Transformers assumes when the key is absent).
_COMMON = [
    ("vocab_size", "vocab_size", None), ("hidden_size", "dim", None),
    ("num_hidden_layers", "n_layers", None), ("num_attention_heads", "n_heads", None),
    ("num_key_value_heads", "n_kv_heads", "num_attention_heads"),
    ("head_dim", "(head_dim = dim / n_heads)", "derived"), ("hidden_act", "(SwiGLU)", "silu"),
    ("rms_norm_eps", "norm_eps", 1e-6), ("rope_theta", "rope_theta", 10000.0),
    ("rope_type", "(plain RoPE)", "default"), ("intermediate_size", "ffn_dim", None),
]
_SOFTMAX_MOE_KEYS = [
    ("num_experts", "moe.experts", None), ("num_experts_per_tok", "moe.top_k", None),
    ("moe_intermediate_size", "moe.expert_ffn_dim", None),
    ("norm_topk_prob", "(softmax weights not renormalised)", False),
    ("decoder_sparse_step", "(every layer past moe.dense_layers is MoE)", 1),
    ("mlp_only_layers", "moe.dense_layers (as the first layers)", []),
    ("use_sliding_window", "(full attention)", False),
]
_FAMILY_KEYS = {
    LLAMA: [("attention_bias", "(no attention bias)", False), ("mlp_bias", "(no MLP bias)", False)],
    QWEN3: [("attention_bias", "(no attention bias)", False),
            ("use_sliding_window", "(full attention)", False)],
    QWEN2_MOE: [*_SOFTMAX_MOE_KEYS, ("qkv_bias", "(no attention bias)", True)],
    QWEN3_MOE: [*_SOFTMAX_MOE_KEYS, ("attention_bias", "(no attention bias)", False)],
    GLM4_MOE: [
        ("n_routed_experts", "moe.experts", None), ("num_experts_per_tok", "moe.top_k", None),
        ("moe_intermediate_size", "moe.expert_ffn_dim", None),
        ("n_shared_experts", "moe.shared_experts", 1),
        ("first_k_dense_replace", "moe.dense_layers", 1),
        ("norm_topk_prob", "(sigmoid weights renormalised)", True),
        ("routed_scaling_factor", "(no scaling of the routed output)", 1.0),
        ("n_group", "(no expert groups)", 1), ("topk_group", "(no expert groups)", 1),
        ("use_qk_norm", "qk_norm", False), ("attention_bias", "(no attention bias)", False),
        ("partial_rotary_factor", "(RoPE on the whole head)", 0.5),
    ],
}


def _read(hf: dict, key: str, default):
    """A setting of config.json, wherever this Transformers version or an older one put it."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if key in ("rope_theta", "partial_rotary_factor", "rope_type") and key in rope:
        return rope[key]
    if key == "rope_type" and hf.get("rope_scaling"):
        return hf["rope_scaling"].get("type", "?")
    if key in hf and hf[key] is not None:
        return hf[key]
    if default == "num_attention_heads":
        return hf.get("num_attention_heads")
    if default == "derived":
        return hf["hidden_size"] // hf["num_attention_heads"]
    return default


def check_hf_config(hf: dict, cfg, source: str) -> Family:
    """Refuse a config.json that does not describe the job's model; name the first difference.

    Returns the family the job's model imports as."""
    family = choose_family(cfg)
    got_type = hf.get("model_type")
    if got_type != family.model_type:
        raise CheckpointError(
            f"{source} holds a {got_type!r} model; this job's model (model.qk_norm: "
            f"{cfg.qk_norm}, model.moe: experts={cfg.moe.experts}, score={cfg.moe.score}) is a "
            f"{family.model_type!r} one ({family.architecture}): import a checkpoint of that "
            "family, or change model.qk_norm or model.moe")
    expected = hf_config(cfg, family)
    expected["rope_type"] = "default"
    for key, field, default in _COMMON + _FAMILY_KEYS[family]:
        got = _read(hf, key, default)
        want = expected[key]
        if key in ("rope_theta", "rms_norm_eps", "routed_scaling_factor",
                   "partial_rotary_factor"):
            same = got is not None and abs(float(got) - float(want)) <= 1e-12 * abs(float(want))
        else:
            same = got == want
        if not same:
            if field.startswith("("):  # a property every Optimus model has
                raise CheckpointError(
                    f"{source}: {key} is {got!r}; Optimus models need {want!r} {field}, so "
                    "this checkpoint computes something an Optimus model cannot")
            raise CheckpointError(
                f"{source}: {key} is {got!r} but the job has model.{field} = {want!r}: set "
                f"model.{field.split(' ')[0]} to match the checkpoint, or import another one")
    return family
