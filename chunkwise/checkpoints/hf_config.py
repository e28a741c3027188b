"""Hugging Face `config.json` -> `HParams`, for every model type chunkwise
computes exactly: llama (Llama 1-3.3, SmolLM), mistral, qwen2 (Qwen2,
Qwen2.5), gemma2, gemma3_text (Gemma 3's language model) and phi3 (Phi-3,
Phi-3.5, Phi-4-mini).

  hparams_from_config(json.load(open("config.json")))

RoPE comes from `rope_parameters` (transformers 5; Gemma 3 nests one per
layer type) or `rope_theta` / `rope_scaling` (older files); scaling kinds
"linear", "dynamic", "llama3", "yarn" and "longrope" (Phi-3's "su" is its
old name) become `RopeScaling`. Sliding layers come from `layer_types`,
else from each type's rule (Gemma 2: even layers; Gemma 3: all but every
`sliding_window_pattern`-th; Mistral and Phi-3: every layer; Qwen2: layers
from `max_window_layers` on, when `use_sliding_window`).

What chunkwise would compute differently is refused with the key named:
other model types (mixture-of-experts, multimodal, MLA or ALiBi models),
output or MLP biases, unknown activations or RoPE kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chunkwise import untrusted
from chunkwise.configs import Activation, Block, HParams
from chunkwise.configs.rope import RopeKind, RopeScaling

SUPPORTED_MODEL_TYPES = (
  "llama",
  "mistral",
  "qwen2",
  "gemma2",
  "gemma3_text",
  "phi3",
)
GEMMA = ("gemma2", "gemma3_text")
_ACTIVATIONS = {
  "silu": Activation.SILU,
  "swish": Activation.SILU,
  "gelu_pytorch_tanh": Activation.GELU,
  "gelu_new": Activation.GELU,
}
_ROPE_KINDS = {
  "linear": RopeKind.LINEAR,
  "dynamic": RopeKind.DYNAMIC,
  "llama3": RopeKind.LLAMA3,
  "yarn": RopeKind.YARN,
  "longrope": RopeKind.LONGROPE,
  "su": RopeKind.LONGROPE,
}
# Largest size (width, depth, length) a config may declare.
MAX_SIZE = 1 << 40


class Config:
  """Typed reads of a config.json: each names the file and the key."""

  def __init__(self, config: Mapping[str, Any], source: str):
    self.config = config
    self.source = source

  def get(self, key: str, default: Any = None) -> Any:
    return self.config.get(key, default)

  def size(self, key: str, default: Any = None, where=None) -> int:
    value = (self.config if where is None else where).get(key, default)
    if value is None:
      raise ValueError(f"{self.source}: {key} is missing")
    return untrusted.check_int(
      value, key, source=self.source, lo=1, hi=MAX_SIZE
    )

  def number(self, key: str, default: float | None, where=None) -> float:
    where = self.config if where is None else where
    return untrusted.check_float(
      where.get(key, default), key, source=self.source
    )

  def optional(self, key: str, where=None) -> float | None:
    """A positive number, or None where the key is absent or null."""
    value = (self.config if where is None else where).get(key)
    if value is None:
      return None
    value = untrusted.check_float(value, key, source=self.source)
    if not value > 0:
      raise ValueError(f"{self.source}: {key}={value!r} must be > 0")
    return value

  def mapping(self, key: str, where=None) -> Mapping[str, Any]:
    value = (self.config if where is None else where).get(key) or {}
    if not isinstance(value, Mapping):
      raise ValueError(
        f"{self.source}: {key} is {type(value).__name__}, expected an object"
      )
    return value

  def factors(self, key: str, where: Mapping) -> tuple[float, ...]:
    value = where.get(key)
    if not isinstance(value, list) or len(value) > MAX_SIZE:
      raise ValueError(f"{self.source}: {key} must be a list of numbers")
    return tuple(
      untrusted.check_float(v, key, source=self.source) for v in value
    )


def _rope_parameters(c: Config) -> tuple[Mapping, Mapping | None]:
  """(global RoPE parameters, sliding layers' own or None), each with
  `rope_theta` where the file states it."""
  params = c.mapping("rope_parameters")
  if "full_attention" in params or "sliding_attention" in params:
    full = c.mapping("full_attention", params)
    local = c.mapping("sliding_attention", params) or None
    return full, local
  if not params:
    params = dict(c.mapping("rope_scaling"))
    if "rope_theta" in c.config:
      params.setdefault("rope_theta", c.config["rope_theta"])
  local = None
  if c.get("rope_local_base_freq") is not None:
    local = {"rope_theta": c.get("rope_local_base_freq")}
  return params, local


def _scaling(
  c: Config, params: Mapping, max_len: int, rotary: int
) -> RopeScaling | None:
  kind = params.get("rope_type", params.get("type", "default"))
  if kind in (None, "default"):
    return None
  if kind not in _ROPE_KINDS:
    raise ValueError(
      f"{c.source}: RoPE scaling {kind!r} is not supported; expected one of "
      f"default, {', '.join(_ROPE_KINDS)}"
    )
  kind = _ROPE_KINDS[kind]
  original = params.get(
    "original_max_position_embeddings",
    c.get("original_max_position_embeddings"),
  )
  fields: dict[str, Any] = {}
  if original is not None:
    fields["original_max_len"] = c.size(
      "original_max_position_embeddings", original
    )
  if kind == RopeKind.DYNAMIC:
    fields["original_max_len"] = max_len
  if kind in (RopeKind.YARN, RopeKind.LONGROPE) and "original_max_len" not in (
    fields
  ):
    fields["original_max_len"] = max_len
  factor = c.optional("factor", params)
  if factor is None and kind in (RopeKind.YARN, RopeKind.LONGROPE):
    factor = max_len / fields["original_max_len"]
  if factor is None and kind != RopeKind.LONGROPE:
    raise ValueError(f"{c.source}: RoPE scaling {kind.value!r} needs a factor")
  fields["factor"] = factor
  for key, name in (
    ("low_freq_factor", "low_freq_factor"),
    ("high_freq_factor", "high_freq_factor"),
    ("beta_fast", "beta_fast"),
    ("beta_slow", "beta_slow"),
  ):
    if params.get(key) is not None:
      fields[name] = c.number(key, None, params)
  for key in ("mscale", "mscale_all_dim", "attention_factor"):
    if params.get(key) is not None:
      fields[key] = c.number(key, None, params)
  if "truncate" in params:
    fields["truncate"] = bool(params["truncate"])
  if kind == RopeKind.LONGROPE:
    fields["short_factors"] = c.factors("short_factor", params)
    fields["long_factors"] = c.factors("long_factor", params)
    if len(fields["short_factors"]) != rotary // 2:
      raise ValueError(
        f"{c.source}: short_factor has {len(fields['short_factors'])} "
        f"entries, expected {rotary // 2} (half the rotary dims)"
      )
  with untrusted.named(c.source):
    return RopeScaling(kind=kind, **fields)


def _sliding_layers(
  c: Config, model_type: str, layers: int
) -> tuple[int | None, tuple[int, ...] | None]:
  """(sliding_window, sliding_layers) of the config."""
  window = c.get("sliding_window")
  if model_type == "qwen2" and not c.get("use_sliding_window", False):
    window = None
  if not window:
    return None, None
  window = c.size("sliding_window")
  types = c.get("layer_types")
  if types is not None:
    if not isinstance(types, list) or len(types) != layers:
      raise ValueError(
        f"{c.source}: layer_types must list one type per layer ({layers})"
      )
    unknown = sorted(
      {t for t in types if t not in ("sliding_attention", "full_attention")},
      key=str,
    )
    if unknown:
      raise ValueError(
        f"{c.source}: layer_types holds {unknown[0]!r}; expected "
        "'sliding_attention' or 'full_attention'"
      )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  elif model_type == "gemma2":
    sliding = tuple(range(0, layers, 2))
  elif model_type == "gemma3_text":
    pattern = c.size(
      "sliding_window_pattern", c.get("_sliding_window_pattern", 6)
    )
    sliding = tuple(i for i in range(layers) if (i + 1) % pattern)
  elif model_type == "qwen2":
    first = c.size("max_window_layers", layers, where=c.config)
    sliding = tuple(range(first, layers))
  else:
    sliding = tuple(range(layers))
  if not sliding:
    return None, None
  return window, None if len(sliding) == layers else sliding


def hparams_from_config(
  config: Mapping[str, Any], source: str = "config.json"
) -> HParams:
  """`HParams` of a `config.json` of a supported model type; rejects what
  chunkwise would compute differently and sizes that are not positive
  integers (each error names the key)."""
  if not isinstance(config, Mapping):
    raise ValueError(f"{source}: expected a JSON object")
  c = Config(config, source)
  model_type = config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
      f"{source}: model_type={model_type!r} is not supported; expected one "
      f"of {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  gemma = model_type in GEMMA
  act_key = (
    "hidden_activation" if "hidden_activation" in config else "hidden_act"
  )
  act = config.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
  if not isinstance(act, str) or act not in _ACTIVATIONS:
    raise ValueError(
      f"{source}: {act_key}={act!r} is not supported; expected one of "
      f"{', '.join(_ACTIVATIONS)}"
    )
  if config.get("use_bidirectional_attention"):
    raise ValueError(
      f"{source}: use_bidirectional_attention=true is not supported (causal "
      "decoders only)"
    )
  for flag in ("mlp_bias", "attention_bias"):
    if config.get(flag):
      raise ValueError(
        f"{source}: {flag}=true is not supported (output and MLP biases)"
      )
  heads = c.size("num_attention_heads")
  d_model = c.size("hidden_size")
  layers = c.size("num_hidden_layers")
  max_len = c.size("max_position_embeddings", 2048)
  # Optional keys given as null or 0 take their defaults (as in transformers).
  kv_heads = config.get("num_key_value_heads") and c.size("num_key_value_heads")
  head_dim = config.get("head_dim") and c.size("head_dim")
  head_dim = head_dim or max(d_model // heads, 1)
  params, local = _rope_parameters(c)
  partial = c.number(
    "partial_rotary_factor",
    config.get("partial_rotary_factor", 1.0),
    params,
  )
  rotary = int(head_dim * partial)
  if not 0 < partial <= 1 or rotary < 2:
    raise ValueError(
      f"{source}: partial_rotary_factor={partial!r} must be in (0, 1] and "
      "rotate at least 2 dims"
    )
  scaling = _scaling(c, params, max_len, rotary)
  if scaling is not None and scaling.kind == RopeKind.DYNAMIC:
    max_len = int(max_len * scaling.factor)
  window, sliding = _sliding_layers(c, model_type, layers)
  local_base = None
  if local is not None:
    if _scaling(c, local, max_len, rotary) is not None:
      raise ValueError(
        f"{source}: scaled RoPE on sliding layers is not supported"
      )
    local_base = c.number("rope_theta", 10_000.0, local)
  scalar = c.optional("query_pre_attn_scalar") if gemma else None
  fields = dict(
    layers=layers,
    d_model=d_model,
    heads=heads,
    kv_heads=kv_heads or heads,
    head_dim=head_dim,
    d_ff=c.size("intermediate_size"),
    vocab=c.size("vocab_size"),
    max_len=max_len,
    block=Block.SEQUENTIAL,
    norm_eps=c.number("rms_norm_eps", 1e-6),
    rope_base=c.number("rope_theta", 10_000.0, params),
    tied_embeddings=bool(config.get("tie_word_embeddings", gemma)),
    activation=_ACTIVATIONS[act],
    qkv_bias=model_type == "qwen2",
    rope_scaling=scaling,
    rotary_dim=None if rotary == head_dim else rotary,
    sliding_window=window,
    sliding_layers=sliding,
    local_rope_base=local_base if window is not None else None,
    query_scale=None if scalar is None else scalar**-0.5,
    attn_softcap=c.optional("attn_logit_softcapping") if gemma else None,
    final_softcap=c.optional("final_logit_softcapping") if gemma else None,
    embed_scale=d_model**0.5 if gemma else None,
    post_norms=gemma,
    qk_norm=model_type == "gemma3_text",
  )
  with untrusted.named(source):
    return HParams(**fields)
