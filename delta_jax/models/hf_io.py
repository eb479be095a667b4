"""Hugging Face checkpoint I/O: config.json + safetensors <-> Transformer parameters.

Reads and writes only safetensors (never pickle) and never runs remote code. Supported
architectures: Qwen3ForCausalLM (model_type "qwen3") and LlamaForCausalLM ("llama"), dense,
full attention, default RoPE. Anything else (MoE, sliding window, RoPE scaling, biases, other
activations) is refused with an error naming the file and field.

HF linear weights are stored [out_features, in_features]; ours are [in..., out...], so
    ours = hf.T.reshape(our_shape)      and      hf = ours.reshape(prod(in), prod(out)).T
where "in" is the leading `_IN_AXES[name]` axes of our (per-layer) shape.
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
import re
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from delta_jax.errors import InputError, MissingInputError
from delta_jax.models.config import ModelConfig
from delta_jax.models.transformer import Transformer, layer_param_shapes, merge_lora

log = logging.getLogger("delta_jax.models")

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}

# Per-layer parameter -> HF tensor name suffix under "model.layers.{i}.".
_LAYER_HF_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
# Number of leading "input" axes of each linear weight (per-layer shape); None = not a linear.
_IN_AXES = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1,
            "down_proj": 1, "lm_head": 1}


class CheckpointError(InputError):
  """A checkpoint directory that cannot be loaded (names the file and field/tensor)."""


class UnsupportedModelError(CheckpointError):
  """A valid checkpoint of an architecture or feature this package does not implement."""


# ----------------------------------------------------------------------------- config


def read_config_json(path) -> dict:
  """Parsed config.json of an HF directory, with clear errors for missing/malformed files."""
  file = pathlib.Path(path) / CONFIG_NAME
  if not pathlib.Path(path).is_dir():
    raise MissingInputError(f"{path}: no such checkpoint directory")
  if not file.is_file():
    raise MissingInputError(f"{path}: no config.json in this checkpoint directory (a Hugging "
                            "Face model directory has config.json and *.safetensors)")
  try:
    data = json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file}: malformed JSON ({e})") from e
  if not isinstance(data, dict):
    raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
  return data


def _rope_theta(hf: dict, where: str) -> float:
  """rope_theta from either the transformers>=5 `rope_parameters` or the older fields."""
  params = hf.get("rope_parameters")
  scaling = hf.get("rope_scaling")
  if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
    params = params["full_attention"]
  for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
    if spec is None:
      continue
    if not isinstance(spec, dict):
      raise CheckpointError(f"{where}: field {name} must be an object, got {spec!r}")
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in (None, "default"):
      raise UnsupportedModelError(
          f"{where}: {name}.rope_type={rope_type!r} is not supported (only default RoPE)")
  theta = hf.get("rope_theta")
  if theta is None and isinstance(params, dict):
    theta = params.get("rope_theta")
  if theta is None:
    theta = 1e4 if hf.get("model_type") == "llama" else 1e6
  if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
    raise CheckpointError(f"{where}: field rope_theta must be a positive number, got {theta!r}")
  return float(theta)


def config_from_hf(hf: dict, *, where: str = CONFIG_NAME, dtype=jnp.float32, param_dtype=None,
                   remat=False, attention: str = "auto") -> ModelConfig:
  """ModelConfig from a parsed HF config.json dict; `where` names the file in errors."""
  model_type = hf.get("model_type")
  archs = hf.get("architectures") or []
  if model_type not in _ARCHITECTURES:
    raise UnsupportedModelError(
        f"{where}: model_type={model_type!r} (architectures={archs}) is not supported; "
        f"supported: {sorted(_ARCHITECTURES)} (dense Qwen3, Llama)")
  for arch in archs:
    if arch != _ARCHITECTURES[model_type]:
      raise UnsupportedModelError(
          f"{where}: architecture {arch!r} is not supported for model_type={model_type!r}; "
          f"expected {_ARCHITECTURES[model_type]!r}")
  for key in ("num_experts", "num_local_experts", "n_routed_experts"):
    if hf.get(key):
      raise UnsupportedModelError(f"{where}: mixture-of-experts ({key}={hf[key]}) is not "
                                  "supported")
  if hf.get("use_sliding_window"):
    raise UnsupportedModelError(f"{where}: use_sliding_window=true is not supported")
  layer_types = hf.get("layer_types")
  if layer_types and any(t != "full_attention" for t in layer_types):
    raise UnsupportedModelError(f"{where}: layer_types {sorted(set(layer_types))} are not "
                                "supported (only full_attention)")
  if model_type == "llama" and hf.get("sliding_window"):
    raise UnsupportedModelError(f"{where}: sliding_window is not supported")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise UnsupportedModelError(f"{where}: {key}=true is not supported")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"{where}: hidden_act={act!r} is not supported (only silu)")

  def required_int(key):
    if key not in hf:
      raise CheckpointError(f"{where}: missing required field {key!r}")
    value = hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise CheckpointError(f"{where}: field {key!r} must be a positive int, got {value!r}")
    return value

  hidden = required_int("hidden_size")
  heads = required_int("num_attention_heads")
  head_dim = hf.get("head_dim") or hidden // heads
  rope_theta = _rope_theta(hf, where)
  try:
    return ModelConfig(
        vocab_size=required_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required_int("intermediate_size"),
        num_layers=required_int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=(model_type == "qwen3"),
        max_position_embeddings=hf.get("max_position_embeddings") or 40960,
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
        remat=remat,
        attention=attention,
    )
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: invalid configuration: {e}") from e


def hf_config_dict(cfg: ModelConfig, dtype=None) -> dict:
  """An HF config.json dict (Qwen3ForCausalLM or LlamaForCausalLM) describing cfg."""
  model_type = "qwen3" if cfg.qk_norm else "llama"
  dtype_name = jnp.dtype(cfg.param_dtype if dtype is None else dtype).name
  out = {
      "architectures": [_ARCHITECTURES[model_type]],
      "model_type": model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": None,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
      "dtype": dtype_name,
  }
  if model_type == "qwen3":
    out["use_sliding_window"] = False
  else:
    out["mlp_bias"] = False
  return out


# ----------------------------------------------------------------------------- tensor index


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
  """tensor name -> safetensors file, from the index file or the *.safetensors present."""
  index = path / INDEX_NAME
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise CheckpointError(f"{index}: malformed safetensors index ({e!r})") from e
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing:
      raise MissingInputError(f"{index}: lists shard files that do not exist: {missing}")
    return {name: path / f for name, f in weight_map.items()}
  files = sorted(path.glob("*.safetensors"))
  if not files:
    pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt*")]
    hint = f" (found {pickles}: pickle checkpoints are refused)" if pickles else ""
    raise MissingInputError(f"{path}: no *.safetensors weights{hint}")
  mapping = {}
  for f in files:
    with _open_safetensors(f) as handle:
      for name in handle.keys():
        mapping[name] = f
  return mapping


def _open_safetensors(file):
  try:
    return safe_open(str(file), framework="numpy")
  except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
    raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: "
                          f"{e}); truncated or corrupted?") from e


class _TensorReader:
  """Opens safetensors files lazily and reads single tensors with shape checks."""

  def __init__(self, files: dict[str, pathlib.Path]):
    self.files = files
    self._handles: dict[pathlib.Path, Any] = {}
    self.used: set[str] = set()
    self.bytes_read = 0  # of tensor data, by read()

  def _handle(self, file):
    if file not in self._handles:
      self._handles[file] = _open_safetensors(file)
    return self._handles[file]

  def check(self, name: str, shape: tuple[int, ...], where: pathlib.Path):
    """The handle holding tensor `name`, after checking from the file's header alone that it
    is there with this shape."""
    if name not in self.files:
      raise CheckpointError(f"{where}: missing tensor {name!r}")
    file = self.files[name]
    handle = self._handle(file)
    if name not in handle.keys():
      raise CheckpointError(f"{file}: missing tensor {name!r} (listed in {INDEX_NAME})")
    got = tuple(handle.get_slice(name).get_shape())
    if got != tuple(shape):
      raise CheckpointError(f"{file}: tensor {name!r} has shape {got}, expected {tuple(shape)}")
    self.used.add(name)
    return handle

  def refuse_unused(self, where: pathlib.Path) -> None:
    """An error for tensors in the files that nothing checked or read (another architecture)."""
    ignorable = re.compile(r"(.*rotary_emb\.inv_freq$)|(^lm_head\.weight$)")
    unused = sorted(n for n in self.files if n not in self.used and not ignorable.match(n))
    if unused:
      raise UnsupportedModelError(
          f"{where}: checkpoint has tensors this architecture does not use, e.g. {unused[:5]} "
          f"({len(unused)} in all)")

  def read(self, name: str, shape: tuple[int, ...], where: pathlib.Path,
           index: tuple[slice, ...] | None = None) -> np.ndarray:
    """Tensor `name` (checked to have `shape`), or only its block `index` (slices with step 1,
    one an axis): the bytes of that block alone are read."""
    file = self.files.get(name)
    handle = self.check(name, shape, where)
    try:
      if index is not None and any(s != slice(0, n) for s, n in zip(index, shape)):
        out = handle.get_slice(name)[index]
      else:
        out = handle.get_tensor(name)
      self.bytes_read += out.nbytes
      return out
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
      raise CheckpointError(f"{file}: tensor {name!r} does not read back ({type(e).__name__}: "
                            f"{e}); truncated or corrupted file?") from e


def _to_ours(name: str, hf: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
  if name in _IN_AXES:
    return hf.T.reshape(our_shape)
  return hf.reshape(our_shape)


def _hf_shape(name: str, our_shape: tuple[int, ...]) -> tuple[int, ...]:
  if name in _IN_AXES:
    k = _IN_AXES[name]
    return (math.prod(our_shape[k:]), math.prod(our_shape[:k]))
  return tuple(our_shape)


def _merged_range(sizes: tuple[int, ...], index: tuple[slice, ...]) -> tuple[slice, int]:
  """Axes of `sizes` merged into one, the first slowest (as an HF tensor stores them): the range
  of the merged axis that holds the block `index` spans of the first axis, whole in the others
  (the block's own range where the others are whole), and how many of the first axis that is."""
  inner = math.prod(sizes[1:])
  first = index[0]
  return slice(first.start * inner, first.stop * inner), first.stop - first.start


def _read_block(reader: "_TensorReader", name: str, hf_name: str, our_shape: tuple[int, ...],
                index: tuple[slice, ...], where: pathlib.Path) -> np.ndarray:
  """Block `index` of parameter `name` in our layout (one layer's, our_shape), read from HF
  tensor `hf_name` by its rows and columns alone: a linear weight's input axes are the HF
  tensor's columns and its output axes its rows (transposed, see _to_ours)."""
  hf_shape = _hf_shape(name, our_shape)
  if name not in _IN_AXES:
    return reader.read(hf_name, hf_shape, where, index)
  k = _IN_AXES[name]
  cols, n_in = _merged_range(our_shape[:k], index[:k])
  rows, n_out = _merged_range(our_shape[k:], index[k:])
  block = reader.read(hf_name, hf_shape, where, (rows, cols)).T
  block = block.reshape(n_in, *our_shape[1:k], n_out, *our_shape[k + 1:])
  # the axes after the first of each group were read whole: their slices are taken now
  return block[(slice(None), *index[1:k], slice(None), *index[k + 1:])]


def _to_hf(name: str, ours: np.ndarray) -> np.ndarray:
  if name in _IN_AXES:
    k = _IN_AXES[name]
    return np.ascontiguousarray(
        ours.reshape(math.prod(ours.shape[:k]), math.prod(ours.shape[k:])).T)
  return np.ascontiguousarray(ours)


# ----------------------------------------------------------------------------- load


def _lookup_sharding(shardings, path: tuple[str, ...], axes, shape):
  """A Sharding (or None) for one parameter from a callable or a nested pytree/State."""
  if shardings is None:
    return None
  if callable(shardings) and not hasattr(shardings, "__getitem__"):
    return shardings(path, axes, shape)
  node = shardings
  for key in path:
    try:
      node = node[key]
    except (KeyError, TypeError, IndexError) as e:
      raise KeyError(f"shardings has no entry for parameter {'/'.join(path)}") from e
  if isinstance(node, nnx.Variable):
    node = node.get_value()
  return node


def pretrained_config(path, dtype=jnp.float32, *, param_dtype=None, remat=False,
                      attention: str = "auto", check_weights: bool = True) -> ModelConfig:
  """The ModelConfig of a Hugging Face directory (config.json; dtype etc. as from_pretrained).
  check_weights: also check, from the safetensors headers alone (no tensor is read), that every
  tensor the model needs is there with its shape and none is left over: the errors
  from_pretrained would raise, at the cost of reading a few headers."""
  path = pathlib.Path(path)
  cfg = config_from_hf(read_config_json(path), where=str(path / CONFIG_NAME), dtype=dtype,
                       param_dtype=param_dtype, remat=remat, attention=attention)
  if check_weights:
    reader = _TensorReader(_weight_files(path))
    for name, shape in _hf_read_shapes(cfg).values():
      reader.check(name, shape, path)
    reader.refuse_unused(path)
  return cfg


def _hf_read_shapes(cfg: ModelConfig) -> dict[tuple, tuple[str, tuple[int, ...]]]:
  """(our parameter path, layer index or None) -> (the checkpoint's tensor name, its shape
  there), for every tensor of the checkpoint, in the order save_pretrained writes them: the
  embedding, each layer's, the final norm, the LM head (none when tied)."""
  V, H = cfg.vocab_size, cfg.hidden_size
  out = {(("embed",), None): ("model.embed_tokens.weight", (V, H))}
  for i in range(cfg.num_layers):
    for name, shape in layer_param_shapes(cfg).items():
      out[(("layers", name), i)] = (f"model.layers.{i}.{_LAYER_HF_NAMES[name]}",
                                     _hf_shape(name, shape[1:]))
  out[(("final_norm",), None)] = ("model.norm.weight", (H,))
  if not cfg.tie_word_embeddings:
    out[(("lm_head",), None)] = ("lm_head.weight", (V, H))
  return out


def from_pretrained(path, dtype=jnp.float32, *, param_dtype=None, shardings=None,
                    remat=False, attention: str = "auto",
                    progress_every_s: float = 10.0) -> Transformer:
  """Load a Hugging Face Qwen3/Llama directory (config.json + *.safetensors [+ index]).

  dtype: compute dtype (cfg.dtype); param_dtype: storage dtype (default: dtype).
  remat / attention: the run-time choices of ModelConfig (not stored in config.json).
  shardings: optional placement, either a callable (path tuple, logical axes, shape) ->
    jax.sharding.Sharding | None, or a pytree shaped like nnx.state(model) (e.g. from
    nnx.get_named_sharding) whose leaves are Shardings. Each device's block of a parameter is
    then read from the files by itself (jax.make_array_from_callback): a host of a multi-host
    run reads its own devices' shards, not the whole model; without one, each parameter is
    read whole onto the default device.
  progress_every_s: a read that takes longer logs (logger delta_jax.models) the parameters
    placed and the bytes read so far at most this often, and its total at the end.
  """
  path = pathlib.Path(path)
  cfg = pretrained_config(path, dtype, param_dtype=param_dtype, remat=remat,
                          attention=attention, check_weights=False)
  reader = _TensorReader(_weight_files(path))
  np_dtype = np.dtype(jnp.dtype(cfg.param_dtype))
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  tensors = _hf_read_shapes(cfg)

  def place(param_path, variable, shape, block):
    """Parameter param_path of `shape`, of which block(index) reads the block `index` (a tuple
    of slices); with a sharding each device's shard is read alone (on several hosts each reads
    its own devices' blocks), a block several devices hold (replicas) once."""
    axes = variable.get_metadata().get("out_sharding")
    sharding = _lookup_sharding(shardings, param_path, axes, shape)
    if sharding is None:
      variable.set_value(jnp.asarray(block(tuple(slice(0, n) for n in shape))))
      return
    read = {}

    def shard(index):
      index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
      key = tuple((s.start, s.stop) for s in index)
      if key not in read:
        read[key] = block(index)
      return read[key]

    variable.set_value(jax.make_array_from_callback(shape, sharding, shard))

  def block_reader(key, shape):
    """block(index) of parameter `key` (our layout): one tensor's, or for a stacked layer
    parameter the layers index[0] spans, each from its own tensor."""
    name = key[-1]
    if key[0] != "layers":
      return lambda index: _read_block(reader, name, tensors[(key, None)][0], shape, index,
                                       path).astype(np_dtype)
    return lambda index: np.stack([
        _read_block(reader, name, tensors[(key, i)][0], shape[1:], index[1:], path)
        .astype(np_dtype) for i in range(index[0].start, index[0].stop)])

  V, H = cfg.vocab_size, cfg.hidden_size
  todo = [(("embed",), model.embed, (V, H)), (("final_norm",), model.final_norm, (H,))]
  if not cfg.tie_word_embeddings:
    todo.append((("lm_head",), model.lm_head, (H, V)))
  todo += [(("layers", name), getattr(model.layers, name), shape)
           for name, shape in layer_param_shapes(cfg).items()]
  start = last = time.perf_counter()
  for done, (key, variable, shape) in enumerate(todo, 1):
    place(key, variable, shape, block_reader(key, shape))
    now = time.perf_counter()
    if now - last >= progress_every_s or (done == len(todo) and now - start >= progress_every_s):
      log.info("%s: %d of %d parameters read (%s), %.3g GB, %.0f s", path, done, len(todo),
               "/".join(key), reader.bytes_read / 1e9, now - start)
      last = now
  reader.refuse_unused(path)
  return model


# ----------------------------------------------------------------------------- save


def _parse_size(size) -> int:
  if isinstance(size, int):
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", str(size).upper())
  if not match:
    raise ValueError(f"max_shard_size: cannot parse {size!r} (use bytes or e.g. '5GB')")
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[match.group(2)]
  return int(float(match.group(1)) * scale)


def _fetch(x) -> np.ndarray:
  """The whole value of a (possibly sharded) array on this host. An array that spans processes
  is gathered from all of them (a collective: every process must fetch the same arrays in the
  same order)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _hf_tensors(model: Transformer) -> list[tuple[str, tuple[int, ...], Callable[[], Any]]]:
  """(HF name, HF shape, getter of the host array) for every tensor (_hf_read_shapes' list),
  without reading them."""
  lora = model.layers.lora_names()

  def layer_weight(name, i):  # with its LoRA pair (if any) merged in
    if f"{name}_lora_a" not in lora:
      return _fetch(getattr(model.layers, name)[i])
    p = {n: _fetch(getattr(model.layers, n)[i]) for n in (name, f"{name}_lora_a",
                                                           f"{name}_lora_b")}
    return np.asarray(merge_lora(model.layers.lora_scale, p)[name])

  def getter(key, i):
    name = key[-1]
    if key[0] == "layers":
      return lambda: _to_hf(name, layer_weight(name, i))
    return lambda: _to_hf(name, _fetch(getattr(model, name)[...]))

  return [(hf_name, hf_shape, getter(key, i))
          for (key, i), (hf_name, hf_shape) in _hf_read_shapes(model.cfg).items()]


def save_pretrained(model: Transformer, path, *, dtype=None, max_shard_size="5GB",
                    extra_config: Optional[dict] = None) -> pathlib.Path:
  """Write an HF directory (config.json + safetensors) that transformers can load. A model
  with LoRA adapters is written merged: each projection as W + (alpha / r) A B.

  dtype: storage dtype of the tensors (default: the parameters' dtype).
  max_shard_size: bytes or a string like "5GB"; above it the weights are split into
    model-0000k-of-0000n.safetensors files plus model.safetensors.index.json.
  extra_config: fields merged into config.json (e.g. eos_token_id, bos_token_id).
  Tensors are fetched from the devices one shard file at a time. Collective when the
  parameters span processes (multi-host): every process calls it, process 0 alone writes.
  """
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  cfg = model.cfg
  np_dtype = np.dtype(jnp.dtype(cfg.param_dtype if dtype is None else dtype))
  limit = _parse_size(max_shard_size)

  shards: list[list] = [[]]
  shard_bytes = 0
  total = 0
  for entry in _hf_tensors(model):
    nbytes = math.prod(entry[1]) * np_dtype.itemsize
    if shards[-1] and shard_bytes + nbytes > limit:
      shards.append([])
      shard_bytes = 0
    shards[-1].append(entry)
    shard_bytes += nbytes
    total += nbytes

  # Collective when the parameters span processes: every process fetches every tensor (the
  # gathers), process 0 alone touches the directory, and all leave together.
  writer = jax.process_index() == 0
  if writer:
    for stale in list(path.glob("*.safetensors")) + [path / INDEX_NAME]:
      if stale.is_file():
        stale.unlink()  # a previous save with another sharding must not shadow this one
  weight_map = {}
  for k, shard in enumerate(shards):
    fname = SINGLE_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = {name: get().astype(np_dtype) for name, _, get in shard}
    if writer:
      save_file(tensors, str(path / fname), metadata={"format": "pt"})
    weight_map.update({name: fname for name in tensors})
  if writer:
    if len(shards) > 1:
      index = {"metadata": {"total_size": total}, "weight_map": weight_map}
      (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    config = hf_config_dict(cfg, dtype=np_dtype)
    config.update(extra_config or {})
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"save_pretrained {path}")
  return path


# ----------------------------------------------------------------------------- LoRA adapters

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"


def save_peft_adapter(model: Transformer, path, *, base_model_name_or_path: str = ""
                      ) -> pathlib.Path:
  """Write the model's LoRA adapters as a PEFT LoRA directory (adapter_config.json +
  adapter_model.safetensors, float32), which peft's PeftModel.from_pretrained, vLLM's LoRA
  loading and the like apply to the base model the adapters were trained on (the weights at
  model.path: the base is frozen, so the base directory is that checkpoint itself).

  Layout: for projection `name` of layer i, lora_A.weight [r, in] = A[i]^T and lora_B.weight
  [out, r] = B[i]^T with the in / out axes flattened as in the projection's HF weight
  [out, in], under "base_model.model.model.layers.{i}.{self_attn|mlp}.{name}"; peft's scale
  lora_alpha / r is ours. Collective like save_pretrained (process 0 writes). ValueError
  without adapters."""
  cfg = model.cfg
  names = model.layers.lora_names()
  if not names:
    raise ValueError("save_peft_adapter: the model has no LoRA adapters (model.lora_rank = 0)")
  path = pathlib.Path(path)
  tensors = {}
  for target in cfg.lora_targets:
    a_all = _fetch(getattr(model.layers, f"{target}_lora_a")[...])  # [L, *in, r]
    b_all = _fetch(getattr(model.layers, f"{target}_lora_b")[...])  # [L, r, *out]
    module = _LAYER_HF_NAMES[target].removesuffix(".weight")
    for i in range(cfg.num_layers):
      a = a_all[i].reshape(-1, cfg.lora_rank)
      b = b_all[i].reshape(cfg.lora_rank, -1)
      prefix = f"base_model.model.model.layers.{i}.{module}"
      tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T, np.float32)
      tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T, np.float32)
  if jax.process_index() == 0:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank,
              "lora_alpha": cfg.lora_alpha, "target_modules": list(cfg.lora_targets),
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "modules_to_save": None,
              "base_model_name_or_path": base_model_name_or_path or None}
    (path / PEFT_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"save_peft_adapter {path}")
  return path
