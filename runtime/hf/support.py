"""Which HF models the vmemkv paths can compute exactly, decided before anything is built.

Two paths, two sets of needs:

    Engine     our attention function replaces the model's (runtime.hf.attention): the model
               must route attention through transformers' AttentionInterface, and every layer
               must be causal softmax attention over its cached tokens, optionally with a
               sliding window (``layer_windows_of``: keys (p - window, p], transformers'
               semantics) and a logit soft-cap (Gemma 2); no sinks, no ALiBi bias, no chunked
               attention, no bidirectional layers, no recurrent/linear-attention state, no
               queries scaled by position (Llama 4's temperature tuning), no context past a
               position table, no window applied only by the mask (Qwen2-MoE, PhiMoE, Doge:
               ours reads the ``sliding_window`` argument), no mask computed from the values
               (Doge's dynamic mask attention).
    VMemCache  the model's own attention reads K/V from our cache: every layer must keep
               K/V in the cache (no recurrent/linear-attention state, no latent attention);
               KV heads and one head size for K and V in every layer must be readable from
               the config.

Each check raises ``UnsupportedModelError`` naming the feature; an architecture that passes
them but still computes something else is caught by the engine's self-check
(runtime.engine.self_check). docs/models.md lists the families tried.
"""
from __future__ import annotations

import dataclasses
import functools

from .attention import UnsupportedModelError

KV_LAYER_TYPES = ("full_attention", "sliding_attention")   # layer types that keep K/V per token


def text_config(config):
    """The decoder's text config of an HF config (itself for plain causal LMs)."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config(decoder=True)
    return config


def kv_heads_of(config) -> int:
    """KV heads per layer as the model caches them (not only ``num_key_value_heads``):
    Falcon's new decoder expands its ``num_kv_heads`` to every head before caching, its old
    one caches one head under ``multi_query`` (else ``num_kv_heads``); GPTBigCode's
    ``multi_query`` means one."""
    text = text_config(config)
    heads = text.num_attention_heads
    if getattr(text, "model_type", None) == "falcon":
        if getattr(text, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(text, "multi_query", False) else (text.num_kv_heads or heads)
    if getattr(text, "model_type", None) == "gpt_bigcode":
        return 1 if getattr(text, "multi_query", True) else heads
    if not _declares(text, "num_key_value_heads"):   # passed in beside its fields: unread
        return heads
    return getattr(text, "num_key_value_heads", None) or heads


def _declares(config, name: str) -> bool:
    """Whether ``config``'s class declares ``name`` (a field or an ``attribute_map`` alias):
    one passed in beside its fields is kept as a plain attribute that the model's code does
    not read (ModernBERT-decoder given ``num_key_value_heads=2`` still caches every head).
    transformers' configs are dataclasses; one that is not is taken at its word."""
    if not dataclasses.is_dataclass(config):
        return True
    return name in {field.name for field in dataclasses.fields(config)} \
        or name in getattr(type(config), "attribute_map", {})


def kv_shape_of(config) -> dict:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` of a model's KV cache, from its config
    (the one place both the engine and VMemCache read them)."""
    text = text_config(config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return dict(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads_of(text), head_dim=head_dim)


def check_cache_layers(config, who: str, error: type = UnsupportedModelError) -> None:
    """Refuse a model with layers whose state is not K/V per token (linear attention,
    recurrent or state-space layers, chunked or indexed attention): a KV cache cannot hold it."""
    text = text_config(config)
    kinds = set(getattr(text, "layer_types", None) or ("full_attention",))
    other = sorted(kinds - set(KV_LAYER_TYPES))
    if other:
        raise error(
            f"{who} runs layers of type {list(KV_LAYER_TYPES)}; this model "
            f"({getattr(text, 'model_type', '?')}) also has {other} layers, whose state a KV "
            f"cache does not hold")
    _check_one_head_shape(text, who, error)


def check_generate_feeds_new_tokens(config, who: str, error: type) -> None:
    """Refuse a config with which transformers' ``generate`` would not hand a cache passed to
    it only the decoder self-attention's new tokens (a cache of ours appends what it is given):

    - ``is_encoder_decoder`` (BART, T5, Whisper, ...): transformers wraps in an
      EncoderDecoderCache only the caches it builds; a cache the user passes receives the
      cross-attention's K/V (the encoder's tokens, each step) in the self-attention's rows;
    - ``use_cache=False`` (MPT's default; configs saved from training with gradient
      checkpointing often carry it): a model built from it generates with
      ``generation_config.use_cache=False``, re-feeding the whole sequence every step, which a
      cache would hold twice. (A config saying False beside a generation config saying True
      would run; it is refused all the same, as the cache sees only the config.)"""
    text = text_config(config)
    model = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise error(
            f"{who} holds one decoder-only stack's self-attention K/V; this model ({model}) sets "
            f"is_encoder_decoder=True, and generate would write its cross-attention K/V into the "
            f"same rows. Wrap a cache of the decoder's self-attention shape instead: "
            f"EncoderDecoderCache(VMemCache(CacheConfig(num_layers=<decoder layers>, "
            f"num_kv_heads=<decoder heads>, head_dim=<per-head dim>, ...)), DynamicCache()) "
            f"(docs/models.md)")
    if getattr(config, "use_cache", True) is False or getattr(text, "use_cache", True) is False:
        raise error(
            f"this model's config ({model}) sets use_cache=False: generate then re-feeds the whole "
            f"sequence every step and {who} would hold it twice (wrong tokens); set "
            f"model.config.use_cache = True before building the cache, and generate with "
            f"use_cache=True (model.generation_config.use_cache = True, or pass it)")


def _check_one_head_shape(text, who: str, error: type) -> None:
    """Refuse a model whose cache is not K and V of one head size in every layer: multi-head
    latent attention (a compressed latent per token), values of another size than keys, or
    head sizes that differ between layers."""
    model = getattr(text, "model_type", "?")
    if getattr(text, "kv_lora_rank", None):
        raise error(f"{who} caches K and V per KV head; this model ({model}) uses multi-head "
                    f"latent attention (kv_lora_rank={text.kv_lora_rank}), whose cache holds a "
                    f"compressed latent per token")
    try:
        head_dim = getattr(text, "head_dim", None)
    except RuntimeError:            # transformers: a per-layer attribute with no one value
        sizes = sorted({getattr(layer, "head_dim", None)
                        for layer in getattr(text, "per_layer_config", None) or ()} - {None})
        raise error(f"{who} holds one head size in every layer; this model ({model}) has "
                    f"per-layer head sizes {sizes or '(not one value)'}") from None
    head_dim = head_dim or text.hidden_size // text.num_attention_heads
    v_head_dim = getattr(text, "v_head_dim", None)
    if v_head_dim and v_head_dim != head_dim:
        raise error(f"{who} holds keys and values of one head size; this model ({model}) has "
                    f"values of v_head_dim={v_head_dim} beside keys of head_dim={head_dim}")


def layer_windows_of(config) -> tuple:
    """Per layer, the sliding window (tokens) the model attends with, or None (full attention),
    as transformers decides it: ``layer_types`` when the config has them (Gemma 2/3, Cohere2,
    Qwen2's ``use_sliding_window`` + ``max_window_layers``), else ``sliding_window`` on every
    layer (Mistral, Starcoder2, Phi-3), unless ``use_sliding_window`` is False."""
    text = text_config(config)
    n, window = text.num_hidden_layers, getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window or getattr(text, "use_sliding_window", True) is False and not types:
        return (None,) * n
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types[:n])
    return (window,) * n


def check_model_supported(model, max_context: int) -> None:
    """Refuse, before anything runs, a model whose attention the Engine cannot compute exactly.
    ``max_context`` is the user's limit (windows are honoured at any length)."""
    config = text_config(model.config)
    check_cache_layers(config, "the Engine")
    name = type(model).__name__
    if getattr(model, "_supports_attention_backend", True) is False:
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface "
            f"(_supports_attention_backend=False), so the Engine cannot run its attention; "
            f"docs/models.md lists the families that run (model.generate with a VMemCache runs some)")
    _check_bias_features(model, config)
    _check_dynamic_mask(model, max_context)
    _check_undeclared_window(model, config)
    _check_mask_only_window(model, config, max_context)
    _check_position_scaled_queries(model)
    _check_position_table(model, max_context)
    _check_length_dependent_rope(model, config, max_context)


POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")   # GPT-2, OPT, GPT-Neo ...
POSITION_BUFFERS = ("embed_positions", "pos_encoding")   # GPT-J, CodeGen (rotary sin/cos), CTRL


def _position_tables(model):
    """(name, rows, kind) of each table the model indexes by position: learned ``nn.Embedding``s
    (OPT's starts at row 2), and fixed sinusoidal buffers of ``n_positions`` rows (GPT-J's and
    CodeGen's rotary sin/cos, CTRL's encoding)."""
    import torch
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in POSITION_TABLES and isinstance(module, torch.nn.Embedding):
            yield name, module.num_embeddings - getattr(module, "offset", 0), "learned"
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] in POSITION_BUFFERS and buffer.dim() == 2:
            yield name, buffer.shape[0], "sinusoidal"


def _check_position_table(model, max_context: int) -> None:
    """A position table has a row per position: a context past it was an IndexError in the
    middle of a step (a fixed sinusoidal one too: GPT-J's rotary sin/cos). Rotary positions
    computed from the position are computed at any length: past the config's
    ``max_position_embeddings`` the model runs as transformers runs it, untrained there
    (a warning says so)."""
    tables = list(_position_tables(model))
    for table_name, rows, kind in tables:
        if max_context > rows:
            raise UnsupportedModelError(
                f"max_context={max_context} exceeds the {rows} positions of "
                f"{type(model).__name__}'s {kind} position table ({table_name}); "
                f"use max_context <= {rows}")
    if tables:
        return
    trained = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(trained, int) and not isinstance(trained, bool) and 0 < trained < max_context:
        import warnings
        warnings.warn(f"max_context={max_context} is past the {trained} positions "
                      f"{type(model).__name__} was configured for (max_position_embeddings): "
                      f"its rotary positions are computed there as transformers computes them, "
                      f"but the model was not trained on them", UserWarning, stacklevel=4)


def _rope_parameters(config) -> list:
    """The config's rotary parameter dicts: one, or one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def _check_length_dependent_rope(model, config, max_context: int) -> None:
    """Dynamic-NTK (a rope_type containing "dynamic") and longrope pick their rotary
    frequencies from the largest position in each forward pass (transformers'
    ``dynamic_rope_update``), and the engine packs several sequences and prompt chunks into one
    pass: a short request would take a long neighbour's frequencies, a prompt chunk below the
    threshold the short ones its whole prompt did not. Exact only while no position reaches the
    threshold (the original frequencies throughout): refused above it, by name. A dynamic model
    whose rotary state grew in an earlier call (transformers keeps it) is refused too."""
    for params in _rope_parameters(config):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if "dynamic" in rope_type:
            threshold = getattr(config, "max_position_embeddings", None)
            what = "max_position_embeddings"
        elif rope_type == "longrope":
            threshold = params.get("original_max_position_embeddings",
                                   getattr(config, "original_max_position_embeddings", None))
            what = "original_max_position_embeddings"
        else:
            continue
        if not isinstance(threshold, int) or max_context > threshold:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} picks its rotary frequencies from the longest position "
                f"in each forward pass, and the Engine packs several sequences and prompt chunks "
                f"into one pass, so past {what}={threshold} it would not compute what the model "
                f"computes alone; use max_context <= {threshold} (got {max_context})")
    for module_name, module in model.named_modules():
        if "dynamic" not in str(getattr(module, "rope_type", "")):
            continue
        cached = getattr(module, "max_seq_len_cached", None)    # an int, a tensor once grown
        original = getattr(module, "original_max_seq_len", None)
        if cached is not None and original is not None and int(cached) > int(original):
            cached = int(cached)
            raise UnsupportedModelError(
                f"{module_name} ({type(module).__name__}) ran on {cached} positions before and "
                f"keeps the rotary frequencies it grew to (dynamic NTK); the Engine needs the "
                f"original ones: load the model again")


def _check_undeclared_window(model, config) -> None:
    """A ``sliding_window`` the config's class does not declare (passed in beside its fields,
    kept as a plain attribute) is one transformers' code for that model does not build a
    windowed mask from: OLMoE's attention still hands it to the attention function (flash
    attention windows, sdpa and eager attend to every token), so the engine windowed where
    ``model.generate`` did not (a 70-token context with window 48 gave other tokens, past a
    self-check of 42). transformers' configs are dataclasses; one that is not is not judged."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "layer_types", None) or not dataclasses.is_dataclass(config) \
            or "sliding_window" in {field.name for field in dataclasses.fields(config)}:
        return
    raise UnsupportedModelError(
        f"this {getattr(config, 'model_type', '?')} config carries sliding_window={window}, which "
        f"{type(config).__name__} does not declare: transformers builds "
        f"{type(model).__name__}'s mask without a window (with sdpa and eager it attends to "
        f"every token), so the Engine cannot tell which one it computes; remove the field "
        f"(del model.config.sliding_window) to run it on full attention")


@functools.lru_cache(maxsize=None)
def _forward_source(module_class):
    """The source of a module class's forward (decorators unwrapped), or None where Python has
    none; once per class (a model's layers share it)."""
    import inspect
    try:
        return inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return None


def _check_mask_only_window(model, config, max_context: int) -> None:
    """A layer the config windows (``layer_windows_of``) whose attention module does not pass
    ``sliding_window`` to the attention function (Qwen2-MoE, PhiMoE, Doge) is windowed only by
    the mask the model builds: sdpa and eager attend within the window, flash attention and our
    function (which reads the argument, not the mask) to every token; the engine refused it
    from inside its self-check. A window of ``max_context`` tokens or more cuts nothing (keys
    (p - window, p] hold every position): it runs. Modules whose source Python cannot show
    are not judged."""
    windows = layer_windows_of(config)
    for module_name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < len(windows) \
                or windows[layer] is None or windows[layer] >= max_context:
            continue
        source = _forward_source(type(module))
        if source is None or "attention_interface(" not in source or "sliding_window" in source:
            continue
        raise UnsupportedModelError(
            f"this {getattr(config, 'model_type', '?')} config windows layer {layer} "
            f"(sliding_window={windows[layer]}), but {module_name} ({type(module).__name__}) does "
            f"not pass the window to the attention function: only the mask "
            f"{type(model).__name__} builds windows it (sdpa and eager; flash attention attends "
            f"to every token), and vmemkv attention reads no mask, so the Engine cannot run it "
            f"exactly below max_context={max_context} (a window of at least max_context cuts "
            f"nothing and runs); model.generate with a VMemCache runs it on the model's own "
            f"attention")


def _check_dynamic_mask(model, max_context: int) -> None:
    """Doge's dynamic mask attention adds to each key's scores a bias computed from its value,
    ``exp(A * softplus(dt_proj(v)))`` per KV head, and past ``keep_window_size`` keys keeps
    only the top ones: our function drops both (a Doge with a trained ``A`` gave other tokens;
    it was refused by the self-check, with ``self_check=False`` it answered wrong). With ``A``
    all zero (as initialised) the bias is one constant per row and drops out of the softmax."""
    import torch
    for module_name, module in model.named_modules():
        if not callable(getattr(module, "prepare_dynamic_mask", None)):
            continue
        a = getattr(module, "A", None)
        keep = getattr(module, "keep_window_size", None)
        biased = isinstance(a, torch.Tensor) and bool(a.detach().ne(0).any())
        if biased or isinstance(keep, int) and max_context > keep:
            what = ("a per-key bias from its values (A is not all zero)" if biased else
                    f"a choice of the top keep_window_size={keep} keys past that many "
                    f"(max_context={max_context}; use max_context <= {keep})")
            raise UnsupportedModelError(
                f"vmemkv attention does not implement dynamic mask attention ({module_name} of "
                f"{type(model).__name__}, {getattr(model.config, 'model_type', '?')}): its mask "
                f"adds {what}")


def _check_position_scaled_queries(model) -> None:
    """Llama 4's temperature tuning scales the queries of its NoPE layers (``no_rope_layers``
    0) by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``, p counted from the length of
    the cache passed to the layer; the Engine passes none and packs several sequences and
    chunks into one pass, so p would be a token's index in the pass (a decode step always 0):
    from position floor_scale - 1 on, silently other logits. The layers read the switch from
    the config when built, so the layers are what is checked."""
    for module_name, module in model.named_modules():
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            raise UnsupportedModelError(
                f"vmemkv attention does not implement attention temperature tuning "
                f"({module_name} of {type(model).__name__}: attn_temperature_tuning=True scales "
                f"the queries of its NoPE layers by their position from "
                f"floor_scale={getattr(module, 'floor_scale', '?')} on, counted from a cache the "
                f"Engine does not pass); the scale is 1 below that position, so for contexts "
                f"under floor_scale load the model with attn_temperature_tuning=False in its config")


def _check_bias_features(model, config) -> None:
    """Features that add to or reshape the softmax, or the key set, which our backends do not
    compute (a window and a logit soft-cap they do)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"vmemkv attention is causal; this {getattr(config, 'model_type', '?')} config sets "
            f"use_bidirectional_attention=True (bidirectional attention)")
    attn_config = getattr(config, "attn_config", None)
    if getattr(config, "alibi", False) or getattr(attn_config, "alibi", False) \
            or getattr(config, "position_embedding_type", None) == "alibi":
        raise UnsupportedModelError("vmemkv attention does not implement ALiBi position biases "
                                    f"({getattr(config, 'model_type', '?')} config)")
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModelError(f"vmemkv attention does not implement chunked attention "
                                    f"(attention_chunk_size={config.attention_chunk_size})")
    for module_name, module in model.named_modules():
        if getattr(module, "sinks", None) is not None:
            raise UnsupportedModelError(
                f"vmemkv attention does not implement attention sinks ({module_name}.sinks of "
                f"{type(model).__name__}): the sinks would be dropped from the softmax")
