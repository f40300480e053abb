"""What a model can do, read from the model and checked before and while specula decodes with it: the token ids it
accepts, the longest sequence it supports, and whether its cache lets drafts be verified, rolled back and batched.
Each check raises :class:`UnsupportedModelError` naming the model, what it lacks and what to use instead."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from .cache_names import cache_parameter
from .indexer import PerQueryIndexers

# Models whose pass over several tokens after a filled cache does not compute what one-token steps compute, so that
# even model.generate's own output depends on how the tokens are split into passes; found by the architecture sweep
# (tests/e2e/test_architectures.py). They decode through specula without a proposer (one-token steps), not with one.
# (Recurrent layers that differ so are verified step by step: specula.verifier.recurrent.STEP_BY_STEP.)
_SPLIT_DEPENDENT = {"moshi": "its attention mask has no sliding window while its KV cache keeps one"}
# layers (by class, in their library) whose result for one token depends on the other tokens of the pass, or whose
# kernels round otherwise for one token than for several whatever the model's dtype says
_SPLIT_DEPENDENT_LAYERS = {
    ("bitsandbytes", "Linear8bitLt"): "its bitsandbytes 8-bit layers pick outlier columns from every token of a pass, "
    "so one token's result depends on the others (a 6-token pass gave logits up to 1.54 from one-token steps); load "
    "it with torchao's int8 weight-only quantization instead",
    ("bitsandbytes", "Linear4bit"): "its bitsandbytes 4-bit layers run other kernels for one token than for several, "
    "in bf16 or fp16 whatever the model's dtype, which round otherwise; load it with torchao's int4 weight-only "
    "quantization instead",
}


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tensor subclass holding other numbers than it shows (torchao's, optimum-quanto's
    quantized weights), not a plain tensor or parameter."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def weight_state(weight: torch.Tensor) -> tuple:
    """What changes when ``weight``'s values may have, for copies made of it (packed, column-major): its storage and
    its version, which in-place changes bump (a quantized weight: its inner tensors'). A tensor made under
    ``torch.inference_mode`` keeps no version, so 64 of its values, spread over it, stand in (a weight loaded or
    merged in place is seen; an edit that spares all 64 is not)."""
    if is_quantized(weight) and hasattr(weight, "__tensor_flatten__"):
        return tuple(weight_state(getattr(weight, name)) for name in weight.__tensor_flatten__()[0])
    if weight.is_inference():
        flat = weight.detach().reshape(-1)
        return weight.data_ptr(), tuple(flat[:: max(1, len(flat) // 64)].tolist())
    return weight.data_ptr(), weight._version


def without_grad(model: torch.nn.Module) -> torch.autograd.grad_mode._DecoratorContextManager:
    """How specula computes ``model``'s passes without autograd: ``torch.inference_mode()`` (the cheapest: ~5% of a
    decoding run of SmolLM2-135M fp32 on a CPU against ``no_grad``), or ``torch.no_grad()``, as ``model.generate``
    runs, where weights are quantized tensors (optimum-quanto's int4 ones cannot be read under inference mode)."""
    return torch.no_grad() if any(map(is_quantized, model.parameters())) else torch.inference_mode()


class UnsupportedModelError(ValueError):
    """The model (or its cache) cannot be used for speculative decoding."""


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the input embedding matrix: the token ids the model accepts."""
    return model.get_input_embeddings().weight.shape[0]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model`` computes: its input embedding's device; where accelerate offloads it (weights on ``meta`` until
    a hook brings them for a forward), the device the hooks compute on."""
    embeddings = model.get_input_embeddings()
    if embeddings.weight.device.type != "meta":
        return embeddings.weight.device
    for module in (embeddings, model):
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return embeddings.weight.device


def context_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's positions support, if its config says."""
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """The bytes of keys and values one token of one request takes in the cache, by the model's config: every layer
    counted as full attention (an upper bound for models with sliding-window or recurrent layers)."""
    heads, head_bytes = kv_heads(model)
    return heads * head_bytes


def kv_heads(model: torch.nn.Module) -> tuple[int, int]:
    """The key and value heads one token has in the cache (both, in every layer, as :func:`kv_bytes_per_token`
    counts them), and the bytes of one."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None) or 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()  # (quantized weights: the compute dtype)
    return 2 * config.num_hidden_layers * kv_heads, head_dim * dtype.itemsize


def fit_context(model: torch.nn.Module, context: int, after: int) -> int:
    """``context``, or fewer tokens where the model's positions end before ``context + after`` (a measurement's text
    must have a position for every token)."""
    limit = context_limit(model)
    return context if limit is None else max(1, min(context, limit - after - 1))


def describe(model: torch.nn.Module) -> str:
    return f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', '?')!r})"


def check_standard_cache(model: torch.nn.Module) -> None:
    """A decoder-only model whose cache is transformers' ``DynamicCache``."""
    supports_dynamic_cache = getattr(model, "_supports_default_dynamic_cache", lambda: True)()
    if getattr(model.config, "is_encoder_decoder", False) or not supports_dynamic_cache:
        raise UnsupportedModelError(
            f"{describe(model)} is not a decoder-only model with a standard KV cache; specula cannot verify "
            "drafts with it. Use model.generate() for this model."
        )


def cache_argument(model: torch.nn.Module, parameters) -> str:
    """The name under which ``model.forward`` (whose ``parameters`` these are) takes its cache; models that keep their
    state under another name (XLM's cache dict, RWKV, XLNet ...) are refused."""
    name = cache_parameter(parameters)
    if name is None:
        raise UnsupportedModelError(
            f"{describe(model)} takes no KV cache (its forward has no cache or past_key_values argument), so it "
            "cannot decode step by step. Use model.generate() for this model."
        )
    return name


def tokens_meet(model: torch.nn.Module) -> str | None:
    """Why a token's result in ``model``'s passes depends on the pass's other tokens, a batch's rows included (its
    layers' kind: :data:`_SPLIT_DEPENDENT_LAYERS`), or ``None`` where it does not."""
    for module in model.modules():
        kind = (type(module).__module__.partition(".")[0], type(module).__name__)
        if kind in _SPLIT_DEPENDENT_LAYERS:
            return _SPLIT_DEPENDENT_LAYERS[kind]
    return None


def check_split_independent(model: torch.nn.Module, cache: DynamicCache, indexers: PerQueryIndexers | None) -> None:
    """Refuse models for which a pass over several tokens computes something else than one-token steps
    (``indexers``: a sparse-attention model's, which must select the keys of each query alone)."""
    reason = _SPLIT_DEPENDENT.get(model.config.model_type) or tokens_meet(model)
    if indexers is not None and not indexers.covers(model):
        reason = (
            "its sparse attention picks the top-k keys of each query with an indexer specula cannot call one query "
            "at a time, and passes of other shapes round its scores differently and break its ties otherwise"
        )
    if reason is not None:
        raise UnsupportedModelError(
            f"{describe(model)} gives other results for a pass over several tokens than for one-token steps "
            f"({reason}), so drafts cannot be verified exactly. Use proposer=None or model.generate() for this "
            "model."
        )


def check_plain_states(model: torch.nn.Module) -> None:
    """Refuse models whose layers quantize their activations (optimum-quanto's ``activations=``): their keys and
    values come out as quantized tensors, which specula's cache buffers do not hold."""
    if any(getattr(module, "activation_qtype", None) is not None for module in model.modules()):
        raise UnsupportedModelError(
            f"{describe(model)} quantizes its activations (optimum-quanto's activations=...), so its keys and values "
            "come out as quantized tensors, which specula's KV cache does not hold. Quantize its weights only "
            "(quantize(model, weights=qint8)), or use model.generate() for this model."
        )


def check_batchable(model: torch.nn.Module, other_layers: list[str], parameters, attends: bool = True) -> None:
    """Rows of different lengths can share a pass: every cache layer full attention, recurrent state or both
    (``other_layers``: the kinds that are none of these), and where it ``attends``, an attention implementation that
    takes specula's masks, position ids."""
    if other_layers:
        raise UnsupportedModelError(
            f"{describe(model)} keeps {', '.join(other_layers)} cache layers (chunked attention, sparse attention's "
            "indexer keys ...); specula batches only models whose layers cache attention or recurrent state. Decode "
            "its requests one at a time."
        )
    if not attends:
        return
    attention = model.config._attn_implementation
    if attention not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"specula batches with the 'sdpa' or 'eager' attention implementation, not {attention!r}; load "
            f"{describe(model)} with attn_implementation='sdpa', or decode one request at a time."
        )
    if "position_ids" not in parameters:
        raise UnsupportedModelError(
            f"{describe(model)} takes no position_ids, so rows of different lengths cannot share a pass; "
            "decode its requests one at a time."
        )


def check_recurrent_rows(model: torch.nn.Module, reason: str | None) -> None:
    """A model with recurrent state is held as batch rows (a batch, or a single request verifying trees of drafts):
    its states can be (``reason``: why not)."""
    if reason is not None:
        raise UnsupportedModelError(
            f"{describe(model)} keeps recurrent state, and {reason}; specula cannot verify its requests as rows of "
            "a batch or trees of drafts. Decode its requests one at a time, with chains of drafts."
        )


def check_rollback(model: torch.nn.Module, cache: DynamicCache, stepwise: bool = False) -> None:
    """After the prefill: the cache can be rolled back past rejected drafts. Attention layers are cropped; recurrent
    layers (:mod:`specula.verifier.recurrent`) are put back, so the model must have written them, or (``stepwise``)
    kept their states where :class:`specula.verifier.recurrent.Stepwise` finds them."""
    stale = sorted({type(layer).__name__ for layer in cache.layers if _crop_is_stale(layer)})
    unwritten = not stepwise and any(
        isinstance(layer, LinearAttentionCacheLayerMixin) and not any(layer.has_previous_state.values())
        for layer in cache.layers
    )
    croppable = all(
        layer.is_croppable for layer in cache.layers if not isinstance(layer, LinearAttentionCacheLayerMixin)
    )
    if stale or unwritten or not croppable:
        reason = (
            f"its {', '.join(stale)} layers cannot crop what they keep"
            if stale
            else "it keeps recurrent state outside its cache"
            if unwritten
            else "its layers cannot be cropped"
        )
        raise UnsupportedModelError(
            f"The KV cache of {describe(model)} cannot be rolled back ({reason}), so drafts cannot be "
            "verified. Use proposer=None or model.generate() for this model."
        )


def _crop_is_stale(layer: object) -> bool:
    """Whether ``layer``'s class replaced ``update()`` but kept a parent's ``crop()``, which cannot know what the new
    ``update()`` keeps (DeepSeek-V4's layers trim to the window and fill compressor buffers that crop never rolls
    back, yet inherit ``is_croppable``)."""

    def owner(name: str) -> type | None:
        return next((cls for cls in type(layer).__mro__ if name in vars(cls)), None)

    updates, crops = owner("update"), owner("crop")
    return updates is not None and crops is not None and updates is not crops and issubclass(updates, crops)


def multi_token_failure(model: torch.nn.Module, tokens: int, error: Exception) -> UnsupportedModelError:
    """What to raise when a pass over ``tokens`` tokens after a filled cache failed with ``error``."""
    return UnsupportedModelError(
        f"{describe(model)} fails on a pass over {tokens} tokens after a filled KV cache "
        f"({type(error).__name__}: {error}), so drafts cannot be verified. Use proposer=None or "
        "model.generate() for this model."
    )


def check_cache_length(model: torch.nn.Module, cache: DynamicCache, expected: int, after: str) -> None:
    """The attention layers the model wrote hold ``expected`` tokens (the model uses the cache it is given)."""
    lengths, written = _written_lengths(cache)
    if not written or lengths - {expected}:
        holds = "nothing" if not written else f"{', '.join(map(str, sorted(lengths)))} tokens"
        raise UnsupportedModelError(
            f"After {after}, the KV cache of {describe(model)} holds {holds} where specula expects {expected}: "
            "the model does not use the cache it is given as model.generate's loop does, so specula cannot decode "
            "with it. Use model.generate() for this model."
        )


def _written_lengths(cache: DynamicCache) -> tuple[set[int], bool]:
    """The lengths the attention layers the model wrote say they hold, and whether it wrote any layer at all
    (recurrent state included). Layers it never writes (cross-attention without an image, shared KV) do not count."""
    lengths, written = set(), False
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            written |= any(layer.is_conv_states_initialized.values()) or any(
                layer.is_recurrent_states_initialized.values()
            )
        if isinstance(layer, CacheLayerMixin) and layer.is_initialized:
            lengths.add(layer.get_seq_length())
            written = True
    return lengths, written
