"""A tiny randomly initialised model for every causal-LM architecture transformers knows, for sweep tests.

Each model starts from its config class's defaults and is shrunk generically: a table caps the size attributes any
config may have (widths, heads, layers, experts, windows...), per-layer lists keep one layer of each kind, special
token ids move into the small vocabulary, and the same rules apply to nested sub-configs. Generation settings that
come with a config (``forced_eos_token_id``, ``begin_suppress_tokens``...) are kept, token ids remapped.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

CAUSAL_LM_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 128  # pad, bos and eos are 0, 1, 2, other special ids count down from 127; prompts use ids in [3, 96)
MAX_PARAMETERS = 5_000_000
NUM_LAYERS = 2  # at least; more where the layers come in more kinds (sliding and full attention, dense and MoE...)

_HIDDEN, _FFN, _HEADS, _KV_HEADS, _HEAD_DIM, _WINDOW = 64, 128, 4, 2, 16, 8

# Upper bounds for size attributes: a smaller default stays (one kv head stays multi-query, a window of 4 stays 4).
# Widths, feed-forward widths, heads, kv heads, low ranks, rotary widths, experts, windows (so that generation goes
# past them), SSM states (Mamba expand 1: the inner width is hidden_size), vocabularies.
_CAPS = (
    dict.fromkeys(
        [
            "hidden_size",
            "d_model",
            "n_embd",
            "emb_dim",
            "embedding_dim",
            "embedding_size",
            "word_embed_proj_dim",
            "input_embedding_size",
            "output_embedding_size",
            "lru_width",
            "hidden_size_global",
            "backbone_hidden_size",
            "ple_embed_dim",
            "pronunciation_embed_dim",
            "shape_embed_dim",
            "output_channels",
            "nemo_conv_channels",
            "ext_pw_out_channel",
            "depthwise_separable_out_channel",
        ],
        _HIDDEN,
    )
    | dict.fromkeys(
        [
            "intermediate_size",
            "ffn_dim",
            "decoder_ffn_dim",
            "encoder_ffn_dim",
            "d_ff",
            "d_inner",
            "dff",
            "dim_ff",
            "ffn_hidden_size",
            "feed_forward_size",
            "intermediate_size_mlp",
            "dense_intermediate_size",
            "mlp_dim",
            "prompt_mid_dim",
        ],
        _FFN,
    )
    | dict.fromkeys(
        [
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "shared_intermediate_size",
            "expert_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "router_hidden_size",
        ],
        _FFN // 2,
    )
    | dict.fromkeys(
        [
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "attention_heads",
            "decoder_attention_heads",
            "encoder_attention_heads",
            "num_decoder_attention_heads",
            "num_encoder_attention_heads",
            "swa_num_attention_heads",
            "index_n_heads",
            "conf_num_attention_heads",
            "linear_num_heads",
            "linear_num_value_heads",
            "mamba_n_heads",
            "mamba_num_heads",
            "n_mamba_heads",
            "num_attention_heads_per_layer",
        ],
        _HEADS,
    )
    | dict.fromkeys(
        [
            "num_key_value_heads",
            "num_kv_heads",
            "kv_n_heads",
            "swa_num_key_value_heads",
            "num_query_groups",
            "linear_num_key_heads",
        ],
        _KV_HEADS,
    )
    | dict.fromkeys(
        ["kv_lora_rank", "o_lora_rank", "laurel_rank", "hidden_size_per_layer_input", "query_pre_attn_scalar"],
        _HEAD_DIM,
    )
    | dict.fromkeys(
        ["qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"],
        _HEAD_DIM // 2,
    )
    | dict.fromkeys(
        ["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"],
        4,
    )
    | dict.fromkeys(
        [
            "num_experts_per_tok",
            "num_experts_per_token",
            "moe_k",
            "moe_topk",
            "top_k_experts",
            "n_group",
            "num_expert_group",
            "zero_expert_num",
        ],
        2,
    )
    | dict.fromkeys(
        [
            "n_shared_experts",
            "num_shared_experts",
            "moe_num_shared_experts",
            "topk_group",
            "n_groups",
            "mamba_n_groups",
            "mamba_ngroups",
            "expand",
            "mamba_expand",
        ],
        1,
    )
    | dict.fromkeys(
        [
            "sliding_window",
            "window_size",
            "local_attention",
            "attention_window_size",
            "sliding_window_size",
            "local_attention_window_len",
            "attention_chunk_size",
            "keep_window_size",
            "block_size",
            "local_attn_chunk_length",
            "lsh_attn_chunk_length",
            "chunk_size",
            "mamba_chunk_size",
            "index_topk",
        ],
        _WINDOW,
    )
    | dict.fromkeys(
        ["state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank"],
        16,
    )
    | dict.fromkeys(
        [
            "vocab_size",
            "decoder_vocab_size",
            "vocab_size_per_layer_input",
            "unpadded_vocab_size",
            "encoder_hash_byte_group_vocab",
            "ngram_vocab_size_base",
            "shape_vocab_size",
            "pronunciation_vocab_size",
        ],
        VOCAB,
    )
    | {"q_lora_rank": 2 * _HEAD_DIM, "mamba_d_ssm": _HIDDEN, "qk_head_dim": _HEAD_DIM}
)

# Set exactly: head widths must agree with each other (heads * head_dim), positions must fit the sweep's prompts.
_EXACT = (
    dict.fromkeys(
        [
            "head_dim",
            "d_head",
            "dim_head",
            "kv_channels",
            "attention_head_dim",
            "attention_head_size",
            "swa_head_dim",
            "linear_head_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "index_head_dim",
            "mamba_d_head",
            "mamba_head_dim",
            "mamba_headdim",
            "v_head_dim",
            "d_kv",
        ],
        _HEAD_DIM,
    )
    | dict.fromkeys(
        [
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "context_length",
            "max_target_positions",
            "model_max_length",
            "original_max_position_embeddings",
        ],
        512,
    )
    | dict.fromkeys(
        # Weights ten times wider than usual: the outputs depend more on the context (fewer models repeat one token),
        # and
        # near-ties between the top two logits, which a different order of float operations can flip, become rarer.
        ["initializer_range", "init_std"],
        0.2,
    )
)

# Numbers of layers: set to the number of layers kept.
_LAYER_COUNTS = {
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_blocks",
    "depth",
    "conf_num_hidden_layers",
    "num_global_layers",
}
# Lists of layer indices (other lists as long as the layers hold one value per layer).
_LAYER_INDEX_LISTS = {
    "full_attn_idxs",
    "moe_layers",
    "cross_attention_layers",
    "mlp_only_layers",
    "hybrid_layer_ids",
    "global_attn_indexes",
    "ple_layer_ids",
    "intermediate_layers_indices",
    "attn_layer_indices",
}
# Numbers of leading / trailing layers that differ from the rest.
_LEADING_COUNTS = {"first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"}
_TRAILING_COUNTS = {"num_kv_shared_layers"}
# Layer periods, for configs that derive their layer kinds from them: every other layer differs.
_PERIODS = {
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "sliding_window_pattern": 2,
    "global_attn_every_n_layers": 2,
    "no_rope_layer_interval": 2,
    "layer_group_size": 2,
    "n_layers_per_attn_res_block": 2,
}

# Attributes a default config may leave None although the model needs them (HF's own default cannot run): the value
# the usual convention gives (num_key_value_heads None means one per attention head). And reformer's hash_seed: its
# LSH attention draws new random rotations at every forward unless seeded.
_REQUIRED = {
    "head_dim": _HEAD_DIM,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "hash_seed": 0,
}
# Attributes that stay equal to another where the default has them equal: multi-head attention stays multi-head
# (MLA and some others need that), a head_dim that is the rotary part of an MLA head stays so.
_FOLLOW = {
    "num_key_value_heads": "num_attention_heads",
    "num_kv_heads": "num_attention_heads",
    "swa_num_key_value_heads": "swa_num_attention_heads",
    "linear_num_key_heads": "linear_num_value_heads",
    "head_dim": "qk_rope_head_dim",
}
# Where a generic rule cannot work, by the model_type of the (sub-)config.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # The defaults hold no attention layer (all Mamba, or the attention block comes third), and HF's generate fails
    # on a cache without attention layers.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # The defaults leave these None (or empty), which HF's own model cannot build.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        },
    },
    "qwen4_exp_text": {
        "indexer_n_heads": _HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": _HEAD_DIM,
        "indexer_budget": _WINDOW,
        "indexer_compress_ratio": 2,
    },
    # HF's model reads attn_config.rope_theta, which the default lacks, and clamps q/k/v to clip_qkv, default None.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # HF's recurrent kernels mix up the query/key and value head widths when they differ (the default 0.5).
    "xlstm": {"qk_dim_factor": 1.0},
    # Layer kinds given as [[pattern, repeats]].
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Hybrid layers share one transformer block whose weights the later ones tie to the first: keep two of them.
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # A looped model: input, recurrent and output layers must add up to the layers kept (one each, the recurrent one
    # run twice), layer kinds given one per layer (its released configs interleave "mlp" blocks, which it halves).
    "dory": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
    },
    # Axial position embeddings: the dims must add up to hidden_size, the shape multiply to max_position_embeddings.
    "reformer": {"axial_pos_embds_dim": (_HIDDEN // 4, 3 * _HIDDEN // 4), "axial_pos_shape": (16, 32)},
}
# Set up after building, by model_type.
_PREPARE = {
    # Per-language adapters: the forward needs lang_ids or a default language.
    "xmod": lambda model: model.set_default_language("en_XX"),
}

_FIRST_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id")  # become 0, 1, 2


class NotTiny(Exception):
    """The architecture cannot be built as a tiny text-only causal LM; the message says why."""


def tiny_causal_lm(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The class ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` names for ``model_type``, built from a shrunk config: fp32,
    eval mode, weights drawn after ``torch.manual_seed(seed)``. Raises ``NotTiny`` if that cannot be done, or if HF's
    own ``generate`` fails with the model."""
    model_class = _model_class(model_type)
    if "shared_kv_states" in inspect.signature(model_class.forward).parameters:
        raise NotTiny("needs a target model's shared_kv_states (an assistant drafter)")
    config = tiny_config(model_type, model_class.config_class)
    with torch.device("meta"):
        num_parameters = sum(p.numel() for p in _build(model_class, config).parameters())
    if num_parameters > MAX_PARAMETERS:
        raise NotTiny(f"{num_parameters / 1e6:.1f}M parameters after shrinking")
    torch.manual_seed(seed)
    model = _build(model_class, config).eval()
    if model_type in _PREPARE:
        _PREPARE[model_type](model)
    hf_generate_works(model)
    return model


def tiny_config(model_type: str, config_class: type = PreTrainedConfig) -> PreTrainedConfig:
    """The default config of ``model_type`` shrunk, or the sub-config of class ``config_class`` where the model class
    takes only that one (a text model of a multimodal config); raises ``NotTiny`` if the config class rejects it."""
    try:
        config = AutoConfig.for_model(model_type)
        if not isinstance(config, config_class):
            config = next((sub for sub in _fields(config).values() if isinstance(sub, config_class)), config)
        return _shrink(config, _token_map(config))
    except Exception as error:
        raise NotTiny(f"config fails: {_describe(error)}") from error


def hf_generate_works(model: torch.nn.Module) -> None:
    """Raises ``NotTiny`` unless ``model.generate`` runs greedily on a sweep prompt (8 new tokens)."""
    prompt = sweep_prompts()[0]
    try:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8)
    except Exception as error:
        codebooks = getattr(model.config, "num_codebooks", 1)
        if codebooks > 1:
            raise NotTiny(f"needs {codebooks} audio codebooks per position") from error
        raise NotTiny(f"model.generate fails: {_describe(error)}") from error


def sweep_prompts() -> list[torch.Tensor]:
    """Two prompts of shape [1, 28] and [1, 30], token ids in [3, 96), that repeat themselves so that a prompt-lookup
    proposer finds matches."""
    first = [5, 17, 33, 42, 8, 61, 29] * 4
    second = ([70, 12, 12, 54, 3, 88, 41, 95, 27, 60] * 3)[:-2] + [12, 54]
    return [torch.tensor([first]), torch.tensor([second])]


def _model_class(model_type: str) -> type:
    try:
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    except Exception as error:
        raise NotTiny(_describe(error)) from error


def _build(model_class: type, config: PreTrainedConfig) -> torch.nn.Module:
    try:
        return model_class._from_config(config, dtype=torch.float32)
    except Exception as error:
        raise NotTiny(f"construction fails: {_describe(error)}") from error


def _describe(error: Exception) -> str:
    """The error's type and first sentence."""
    first = (str(error).strip().splitlines() or [""])[0].split(". ")[0]
    return f"{type(error).__name__}: {first[:160]}"


def _fields(config: PreTrainedConfig) -> dict[str, Any]:
    """The config's constructor arguments and their current values."""
    return {
        field.name: config._getattr_without_heterogeneous_validation(field.name, None)
        for field in dataclasses.fields(config)
        if field.init
    }


def _token_map(config: PreTrainedConfig) -> dict[int, int]:
    """Old special token id -> new one inside the small vocabulary, for every special id of the config and its
    sub-configs: pad, bos and eos become 0, 1, 2; other ids count down from VOCAB - 1."""
    found: list[tuple[str, int]] = []

    def collect(config: PreTrainedConfig) -> None:
        for name, value in _fields(config).items():
            if isinstance(value, PreTrainedConfig):
                collect(value)
            elif _is_token_field(name):
                found.extend((name, token) for token in _as_list(value) if isinstance(token, int))

    collect(config)
    mapping: dict[int, int] = {}
    for index, name in enumerate(_FIRST_TOKENS):
        for token_name, token in found:
            if token_name == name and token not in mapping and index not in mapping.values():
                mapping[token] = index
    free = VOCAB - 1
    for _, token in found:
        if token not in mapping:
            mapping[token] = free
            free -= 1
    return mapping


def _is_token_field(name: str) -> bool:
    return name.endswith(("token_id", "token_ids", "token_index", "_index", "_tokens"))


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _remap_tokens(value: Any, tokens: dict[int, int]) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(tokens.get(token, token) for token in value)
    return tokens.get(value, value)


def _shrink(config: PreTrainedConfig, tokens: dict[int, int]) -> PreTrainedConfig:
    """A config of the same class with small sizes, built anew so that the class derives what it derives (head_dim,
    layer_types...) from them. Values a parent config set (those that differ from the class defaults) are passed on,
    except where the field's default is None (derived values); special token ids are remapped with ``tokens``."""
    values = _fields(config)
    try:
        defaults = _fields(type(config)())
    except Exception:
        defaults = {}
    declared = {field.name: field.default for field in dataclasses.fields(config)}
    kwargs = {
        name: value
        for name, value in values.items()
        if declared.get(name) is not None and (name not in defaults or defaults[name] != value)
    }
    for name, value in values.items():
        if isinstance(value, PreTrainedConfig):
            kwargs[name] = _shrink(value, tokens)
        elif _is_token_field(name) and value is not None:
            kwargs[name] = _remap_tokens(value, tokens)
        elif name == "is_decoder":
            kwargs[name] = True  # encoder architectures (bert, roberta...) run as causal LMs with a cache
        elif name in _PERIODS and isinstance(value, int):
            kwargs[name] = _PERIODS[name]
    kwargs |= _sizes(values)
    kwargs |= _layers(config, values)
    if isinstance(rope := values.get("rope_parameters"), dict) and (small_rope := _rope(rope)) != rope:
        kwargs["rope_parameters"] = small_rope
    kwargs |= _OVERRIDES.get(config.model_type, {})
    return type(config)(**kwargs)


def _sizes(values: dict[str, Any]) -> dict[str, Any]:
    """The small values of the size attributes among ``values`` (a config's, or one layer's overrides)."""
    small = {name: _small(name, value) for name, value in values.items()}
    small = {name: value for name, value in small.items() if value is not None}
    for name, value in _REQUIRED.items():
        if name in values and values[name] is None:
            small[name] = value
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None:
        small["num_key_value_heads"] = small.get("num_attention_heads")
    for name, leader in _FOLLOW.items():
        if leader in small and values.get(name) is not None and values[name] == values[leader]:
            small[name] = small[leader]
    return small


def _small(name: str, value: Any) -> Any:
    """The small value of a size attribute (or of each entry of a per-layer list of sizes); None if not a size."""
    if isinstance(value, (list, tuple)):
        small = [_small(name, item) for item in value]
        return None if not small or any(item is None for item in small) else type(value)(small)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if name in _EXACT:
        return _EXACT[name]
    if name in _CAPS:
        return min(value, _CAPS[name])
    return None


def _layers(config: PreTrainedConfig, values: dict[str, Any]) -> dict[str, Any]:
    """Layer counts, per-layer lists and layer-index lists for the layers kept: the first layer of each kind, where a
    layer's kind is everything the config says about that layer; at least NUM_LAYERS layers."""
    num_layers = config._getattr_without_heterogeneous_validation("num_hidden_layers", None)
    if not isinstance(num_layers, int):
        return {name: NUM_LAYERS for name in _LAYER_COUNTS if isinstance(values.get(name), int)}
    per_layer = {
        name: list(value)
        for name, value in values.items()
        if isinstance(value, (list, tuple)) and len(value) == num_layers and name not in _LAYER_INDEX_LISTS
    }
    indexed = {name: set(values[name]) for name in _LAYER_INDEX_LISTS if isinstance(values.get(name), (list, tuple))}
    leading = {name: values[name] for name in _LEADING_COUNTS if isinstance(values.get(name), int)}
    trailing = {name: values[name] for name in _TRAILING_COUNTS if isinstance(values.get(name), int)}
    overrides = getattr(getattr(config, "_heterogeneity_spec", None), "per_layer_overrides", {})

    def kind(layer: int) -> tuple:
        return (
            tuple(str(lst[layer]) for lst in per_layer.values()),
            tuple(layer in indices for indices in indexed.values()),
            tuple(layer < count for count in leading.values()),
            tuple(layer >= num_layers - count for count in trailing.values()),
            repr(sorted(overrides.get(layer, {}).items())),
        )

    keep, seen = [], set()
    for layer in range(num_layers):
        if kind(layer) not in seen:
            seen.add(kind(layer))
            keep.append(layer)
    keep += [layer for layer in range(num_layers) if layer not in keep][: max(0, NUM_LAYERS - len(keep))]
    keep.sort()
    kwargs: dict[str, Any] = {name: len(keep) for name in _LAYER_COUNTS if isinstance(values.get(name), int)}
    for name, lst in per_layer.items():
        kept = [lst[layer] for layer in keep]
        kwargs[name] = _small(name, kept) or kept
    for name, indices in indexed.items():
        kwargs[name] = [new for new, layer in enumerate(keep) if layer in indices]
    for name, count in leading.items():
        kwargs[name] = sum(layer < count for layer in keep)
    for name, count in trailing.items():
        kwargs[name] = sum(layer >= num_layers - count for layer in keep)
    if overrides:
        kwargs["per_layer_config"] = {
            new: overrides[layer] | _sizes(overrides[layer]) for new, layer in enumerate(keep) if layer in overrides
        }
    return kwargs


def _rope(parameters: dict) -> dict:
    """RoPE parameters (or per-layer-type RoPE parameters) whose rotary fraction of the small head_dim is even."""
    if all(isinstance(value, dict) or value is None for value in parameters.values()):
        return {key: value and _rope(value) for key, value in parameters.items()}
    parameters = dict(parameters)
    fraction = parameters.get("partial_rotary_factor")
    if fraction is not None and (_HEAD_DIM * fraction) % 2:
        parameters["partial_rotary_factor"] = max(2, 2 * round(_HEAD_DIM * fraction / 2)) / _HEAD_DIM
    return parameters
