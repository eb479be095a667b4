"""HF checkpoint I/O and numerical parity with transformers' Qwen3 / Llama (CPU, fp32)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

# transformers' models are the reference here, and they need PyTorch (a test extra, which the
# main job's install leaves out): without it the module is skipped, not an import error.
torch = pytest.importorskip("torch")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from delta_jax import models

VOCAB = 160

# (name, class, config kwargs): GQA 4:1, 2:1, 1:1; head_dim != hidden/heads; tied and untied;
# rope theta 1e6 and 1e4.
CASES = [
    ("qwen3_gqa4_tied_hd16_1e6", Qwen3ForCausalLM, Qwen3Config,
     dict(hidden_size=48, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
          head_dim=16, rope_theta=1e6, tie_word_embeddings=True)),
    ("qwen3_gqa2_untied_1e4", Qwen3ForCausalLM, Qwen3Config,
     dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, rope_theta=1e4, tie_word_embeddings=False)),
    ("llama_mha_untied_1e4", LlamaForCausalLM, LlamaConfig,
     dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
          rope_theta=1e4, tie_word_embeddings=False)),
    ("llama_gqa2_tied_hd16_1e6", LlamaForCausalLM, LlamaConfig,
     dict(hidden_size=32, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, rope_theta=1e6, tie_word_embeddings=True)),
]


def _make_hf(model_cls, config_cls, kwargs, seed=0):
  """A tiny transformers model whose weights (norms included) are all clearly non-trivial."""
  torch.manual_seed(seed)
  config = config_cls(vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-6,
                      max_position_embeddings=256, **kwargs)
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model


def _batch(seed=0, batch=3, length=9):
  """Random ids with left padding, right padding and no padding; HF-style positions."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, VOCAB, (batch, length))
  mask = np.ones((batch, length), np.int64)
  mask[1, :3] = 0   # left padding
  mask[2, -2:] = 0  # right padding
  positions = np.maximum(mask.cumsum(1) - 1, 0)
  return ids, mask, positions


def _hf_forward(model, ids, mask, positions):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(positions), output_hidden_states=True)
  return out.logits.numpy(), out.hidden_states[-1].numpy()


@pytest.mark.parametrize("name,model_cls,config_cls,kwargs", CASES, ids=[c[0] for c in CASES])
def test_parity_with_transformers(tmp_path, name, model_cls, config_cls, kwargs):
  hf = _make_hf(model_cls, config_cls, kwargs)
  hf.save_pretrained(tmp_path / "hf")
  ids, mask, positions = _batch()
  ref_logits, ref_hidden = _hf_forward(hf, ids, mask, positions)
  # transformers' last hidden state is after the final norm: check it against lm_head.
  head = hf.get_output_embeddings().weight.detach().numpy()
  np.testing.assert_allclose(ref_hidden @ head.T, ref_logits, atol=1e-4)

  model = models.from_pretrained(tmp_path / "hf", dtype=jnp.float32)
  cfg = model.cfg
  assert cfg.qk_norm == (model_cls is Qwen3ForCausalLM)
  assert cfg.tie_word_embeddings == kwargs["tie_word_embeddings"]
  assert cfg.rope_theta == kwargs["rope_theta"]
  assert cfg.head_dim == kwargs.get("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
  out = model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask))
  valid = mask.astype(bool)
  assert out.logits.dtype == jnp.float32
  assert np.abs(np.asarray(out.logits)[valid] - ref_logits[valid]).max() <= 1e-4
  assert np.abs(np.asarray(out.hidden)[valid] - ref_hidden[valid]).max() <= 1e-4
  assert np.isfinite(np.asarray(out.logits)).all()  # padded rows too

  # Round trip: our save_pretrained loads in transformers with the same logits.
  models.save_pretrained(model, tmp_path / "ours")
  hf2 = model_cls.from_pretrained(tmp_path / "ours").eval()
  logits2, _ = _hf_forward(hf2, ids, mask, positions)
  assert np.abs(logits2[valid] - ref_logits[valid]).max() <= 1e-5


def test_attention_choice_reaches_loaded_model_and_keeps_parity(tmp_path):
  # from_pretrained(attention=...) sets the run-time implementation; the flash-style blockwise
  # path (used for long sequences) must agree with transformers just like the default.
  hf = _make_hf(Qwen3ForCausalLM, Qwen3Config, CASES[0][3], seed=2)
  hf.save_pretrained(tmp_path / "hf")
  ids, mask, positions = _batch(seed=2)
  ref_logits, _ = _hf_forward(hf, ids, mask, positions)
  valid = mask.astype(bool)
  model = models.from_pretrained(tmp_path / "hf", attention="blockwise")
  assert model.cfg.attention == "blockwise"
  logits = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)).logits)
  assert np.abs(logits[valid] - ref_logits[valid]).max() <= 1e-4


def test_peft_adapter_applied_by_peft_gives_our_logits(tmp_path):
  """save_peft_adapter's directory, applied by peft (PeftModel.from_pretrained) to the HF base
  the adapters were added to, gives the logits of our model with the adapters (LoRA rank 4,
  alpha 8, on q / v (one input axis), o (two) and down_proj (the MLP), every factor random);
  the adapters change those logits far beyond the tolerance."""
  from peft import PeftModel

  _, model_cls, config_cls, kwargs = CASES[1]
  _make_hf(model_cls, config_cls, kwargs, seed=3).save_pretrained(tmp_path / "base")
  model = models.from_pretrained(tmp_path / "base").add_lora(
      4, 8.0, ("q_proj", "v_proj", "o_proj", "down_proj"), seed=1)
  rng = np.random.default_rng(0)
  for name in model.layers.lora_names():  # B starts at 0: make every factor count
    var = getattr(model.layers, name)
    var[...] = jnp.asarray(0.3 * rng.standard_normal(var[...].shape), jnp.float32)
  models.save_peft_adapter(model, tmp_path / "adapter",
                           base_model_name_or_path=str(tmp_path / "base"))

  peft_model = PeftModel.from_pretrained(model_cls.from_pretrained(tmp_path / "base"),
                                         str(tmp_path / "adapter")).eval()
  ids, mask, positions = _batch(seed=3)
  valid = mask.astype(bool)
  want, _ = _hf_forward(peft_model, ids, mask, positions)
  got = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)).logits)
  assert np.abs(got[valid] - want[valid]).max() <= 1e-4
  base, _ = _hf_forward(model_cls.from_pretrained(tmp_path / "base").eval(), ids, mask, positions)
  assert np.abs(base[valid] - want[valid]).max() > 1e-1
  with pytest.raises(ValueError, match="no LoRA adapters"):
    models.save_peft_adapter(models.from_pretrained(tmp_path / "base"), tmp_path / "none")


def test_sharded_checkpoints_round_trip(tmp_path):
  hf = _make_hf(Qwen3ForCausalLM, Qwen3Config, CASES[1][3], seed=1)
  hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
  assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
  ids, mask, positions = _batch(seed=1)
  ref_logits, _ = _hf_forward(hf, ids, mask, positions)
  valid = mask.astype(bool)

  model = models.from_pretrained(tmp_path / "hf")
  logits = np.asarray(model(jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(mask)).logits)
  assert np.abs(logits[valid] - ref_logits[valid]).max() <= 1e-4

  # Our own sharded writer: several files + index, readable by transformers and by us.
  models.save_pretrained(model, tmp_path / "ours", max_shard_size=30_000)
  index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
  files = sorted((tmp_path / "ours").glob("*.safetensors"))
  assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
  hf2 = Qwen3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
  logits2, _ = _hf_forward(hf2, ids, mask, positions)
  assert np.abs(logits2[valid] - ref_logits[valid]).max() <= 1e-5
  reloaded = models.from_pretrained(tmp_path / "ours")
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reloaded))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_save_and_load(tmp_path):
  cfg = models.get_preset("tiny", num_layers=1)
  model = models.Transformer(cfg, rngs=nnx.Rngs(3))
  models.save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16)
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
  loaded = models.from_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
  assert loaded.cfg.dtype == jnp.bfloat16 and loaded.embed[...].dtype == jnp.bfloat16
  want = np.asarray(model.layers.q_proj[...].astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(loaded.layers.q_proj[...]), want)
  fp32 = models.from_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16, param_dtype=jnp.float32)
  assert fp32.embed[...].dtype == jnp.float32 and fp32.cfg.dtype == jnp.bfloat16


@pytest.mark.devices(4)
def test_from_pretrained_places_parameters_with_given_shardings(tmp_path):
  cfg = models.get_preset("tiny", num_layers=1)
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  models.save_pretrained(model, tmp_path / "m")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
  rules = {"embed": "fsdp", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
           "vocab": "tensor"}
  seen = []

  def shardings(path, axes, shape):
    seen.append(path)
    spec = jax.sharding.PartitionSpec(*(rules.get(a) for a in axes))
    return jax.sharding.NamedSharding(mesh, spec)

  loaded = models.from_pretrained(tmp_path / "m", shardings=shardings)
  assert ("layers", "q_proj") in seen and ("embed",) in seen
  q = loaded.layers.q_proj[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(model.layers.q_proj[...]))
  ids = jnp.asarray(np.arange(12).reshape(2, 6) % cfg.vocab_size, jnp.int32)
  np.testing.assert_allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)

  # A pytree of shardings shaped like the state (what nnx.get_named_sharding returns) works too.
  tree = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                      nnx.state(model))
  replicated = models.from_pretrained(tmp_path / "m", shardings=tree)
  assert replicated.embed[...].sharding.is_fully_replicated
  assert len(replicated.embed[...].sharding.device_set) == 4


@pytest.mark.parametrize("rules,q_reads,q_block", [
    # the usual fsdp x tensor split: a linear weight's first merged axis (the heads) is split,
    # each element of q_proj read once, in blocks of an eighth of a layer's
    ({"embed": "fsdp", "q_heads": "tensor", "mlp": "tensor",
      "vocab": "tensor"}, 1, 1 / 8),
    # the layers, the vocabulary over both mesh axes, and an inner merged axis (head_dim, under
    # the heads in the HF tensor's rows): each of a layer's 4 head_dim blocks reads the layer's
    # q_proj rows whole, then cuts its block
    ({"layers": "fsdp", "head_dim": "tensor", "vocab": ("fsdp", "tensor"), "norm": "tensor"}, 4,
     1),
])
@pytest.mark.devices(8)
def test_from_pretrained_reads_each_shard_by_itself(tmp_path, monkeypatch, rules, q_reads,
                                                    q_block):
  """With shardings, each device's block of a parameter is read from the file alone (on
  several hosts each reads its own devices' shards, not the whole model), a block several
  devices hold once; the model is the one read whole and placed as asked, whichever axes the
  mesh splits."""
  from delta_jax.models import hf_io

  cfg = models.get_preset("tiny")
  model = models.Transformer(cfg, rngs=nnx.Rngs(2))
  models.save_pretrained(model, tmp_path / "m")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  shardings = lambda path, axes, shape: jax.sharding.NamedSharding(  # noqa: E731
      mesh, jax.sharding.PartitionSpec(*(rules.get(a) for a in axes)))
  read, real_read = {}, hf_io._TensorReader.read  # tensor -> sizes of the blocks read

  def counting_read(self, name, shape, where, index=None):
    out = real_read(self, name, shape, where, index)
    read.setdefault(name, []).append(out.size)
    return out

  monkeypatch.setattr(hf_io._TensorReader, "read", counting_read)
  loaded = models.from_pretrained(tmp_path / "m", shardings=shardings)
  got = nnx.to_flat_state(nnx.state(loaded, nnx.Param))
  want = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  assert len(got) == len(want)
  for path, var in got:
    value, axes = var.get_value(), var.get_metadata().get("out_sharding")
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want[path].get_value()),
                                  err_msg=str(path))
    assert value.sharding == shardings(path, axes, value.shape), path
  H, V = cfg.hidden_size, cfg.vocab_size
  q_layer = H * cfg.num_heads * cfg.head_dim
  q = read["model.layers.0.self_attn.q_proj.weight"]
  assert sum(q) == q_reads * q_layer and max(q) == q_block * q_layer, q
  assert sum(read["model.embed_tokens.weight"]) == sum(read["lm_head.weight"]) == V * H
  assert max(read["model.embed_tokens.weight"]) == V * H // 8
  assert sum(read["model.norm.weight"]) == H  # replicated (first case) or split: read once
  ids = jnp.asarray(np.arange(12).reshape(2, 6) % V, jnp.int32)
  np.testing.assert_allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)
  # A bfloat16 checkpoint (as published), read by shards into bfloat16 and into float32.
  models.save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16)
  for param_dtype in jnp.bfloat16, jnp.float32:
    whole = models.from_pretrained(tmp_path / "bf16", jnp.bfloat16, param_dtype=param_dtype)
    by_shard = models.from_pretrained(tmp_path / "bf16", jnp.bfloat16, param_dtype=param_dtype,
                                      shardings=shardings)
    for a, b in zip(jax.tree.leaves(nnx.state(by_shard)), jax.tree.leaves(nnx.state(whole))):
      assert a.dtype == param_dtype
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_long_read_logs_its_progress(tmp_path, caplog):
  """from_pretrained logs the parameters placed and the bytes read as it goes (here after every
  parameter), ending with the whole: every stacked parameter once, the tensors' bytes."""
  import logging

  cfg = models.get_preset("tiny")
  models.save_pretrained(models.Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path / "m")
  with caplog.at_level(logging.INFO, logger="delta_jax.models"):
    models.from_pretrained(tmp_path / "m", progress_every_s=0.0)
  lines = [r.getMessage() for r in caplog.records if r.name == "delta_jax.models"]
  n = 3 + len(models.transformer.layer_param_shapes(cfg))  # embed, final norm, lm_head, stacks
  assert len(lines) == n and lines[0].startswith(f"{tmp_path / 'm'}: 1 of {n} parameters read")
  params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(models.Transformer(
      cfg, rngs=nnx.Rngs(0)), nnx.Param)))
  assert f"{n} of {n} parameters read (layers/" in lines[-1]
  assert f", {params / 1e9:.3g} GB, " in lines[-1], (lines[-1], params)
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="delta_jax.models"):
    models.from_pretrained(tmp_path / "m")  # quick: nothing logged
  assert not [r for r in caplog.records if r.name == "delta_jax.models"]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt") / "tiny"
  model = models.Transformer(models.get_preset("tiny", num_layers=1), rngs=nnx.Rngs(0))
  models.save_pretrained(model, path)
  return path


def _copy(src, dst):
  dst.mkdir()
  for f in src.iterdir():
    (dst / f.name).write_bytes(f.read_bytes())
  return dst


@pytest.fixture(params=["from_pretrained", "pretrained_config"])
def load(request):
  """The loader, and the check a run makes at start-up without reading a tensor
  (pretrained_config): the same error for each bad input."""
  return getattr(models, request.param)


def test_missing_config_json(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  (path / "config.json").unlink()
  with pytest.raises(FileNotFoundError, match="config.json"):
    load(path)


def test_malformed_config_json(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  (path / "config.json").write_text('{"model_type": "qwen3", ')
  with pytest.raises(models.CheckpointError, match=r"config\.json: malformed JSON"):
    load(path)


def test_missing_config_field(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  config = json.loads((path / "config.json").read_text())
  del config["hidden_size"]
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.CheckpointError, match=r"config\.json: missing required field 'hidden_size'"):
    load(path)


def test_missing_tensor(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  tensors = load_file(str(path / "model.safetensors"))
  del tensors["model.layers.0.self_attn.k_norm.weight"]
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError,
                     match=r"missing tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"):
    load(path)


def test_wrong_tensor_shape(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  tensors = load_file(str(path / "model.safetensors"))
  tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:5]
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.CheckpointError,
                     match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' "
                           r"has shape \(5, 64\), expected \(128, 64\)"):
    load(path)


@pytest.mark.parametrize("change,pattern", [
    ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "qwen3_moe"),
    ({"num_experts": 8}, "mixture-of-experts"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_architecture(tmp_path, tiny_checkpoint, load, change, pattern):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  config = json.loads((path / "config.json").read_text())
  config.update(change)
  (path / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.UnsupportedModelError, match=pattern) as info:
    load(path)
  assert "config.json" in str(info.value)


def test_pickle_only_directory_is_refused(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  (path / "model.safetensors").rename(path / "pytorch_model.bin")
  with pytest.raises(FileNotFoundError, match="pickle"):
    load(path)


def test_unexpected_tensors_are_refused(tmp_path, tiny_checkpoint, load):
  path = _copy(tiny_checkpoint, tmp_path / "c")
  tensors = load_file(str(path / "model.safetensors"))
  tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros((128,), np.float32)
  save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(models.UnsupportedModelError, match=r"q_proj\.bias"):
    load(path)


def test_published_qwen3_config_json_gives_the_preset():
  """The Qwen/Qwen3-8B config.json as published (transformers 4.51 format)."""
  published = {
      "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
      "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
      "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
      "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
      "vocab_size": 151936}
  assert models.config_from_hf(published) == models.get_preset("qwen3-8b")
  # The transformers>=5 form (rope_parameters) and our own writer give the same config.
  v5 = dict(published, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  del v5["rope_theta"], v5["rope_scaling"]
  assert models.config_from_hf(v5) == models.get_preset("qwen3-8b")
  ours = models.hf_config_dict(models.get_preset("qwen3-8b"))
  assert models.config_from_hf(ours) == models.get_preset("qwen3-8b")


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_safetensors_names_the_file(tmp_path, tiny_checkpoint, keep):
  """A weights file cut short (a copy that died half way) is an error naming the file, whether
  the cut lands in the tensor data or (keep=0.999) only loses the last bytes."""
  path = _copy(tiny_checkpoint, tmp_path / "c")
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[:int(len(data) * keep)])
  for load in models.from_pretrained, models.pretrained_config:
    with pytest.raises(models.CheckpointError, match=r"model\.safetensors.*(truncated|corrupted)"):
      load(path)


def test_pretrained_config_reads_no_tensor(tmp_path, tiny_checkpoint, monkeypatch):
  """pretrained_config checks a directory from its config.json and safetensors headers: no
  tensor's data is read, also across a sharded checkpoint's index, and it is the config
  from_pretrained builds the model with."""
  from delta_jax.models import hf_io

  sharded = tmp_path / "sharded"
  models.save_pretrained(models.from_pretrained(tiny_checkpoint), sharded, max_shard_size=30_000)
  assert (sharded / hf_io.INDEX_NAME).is_file()
  real_open, opened = hf_io.safe_open, []

  class NoTensors:
    def __init__(self, handle):
      self.handle = handle

    def __enter__(self):
      self.handle.__enter__()
      return self

    def __exit__(self, *exc):
      return self.handle.__exit__(*exc)

    def __getattr__(self, name):
      if name == "get_tensor":
        raise AssertionError("a tensor was read")
      return getattr(self.handle, name)

  def safe_open(*args, **kw):
    opened.append(args[0])
    return NoTensors(real_open(*args, **kw))

  for path in tiny_checkpoint, sharded:
    monkeypatch.setattr(hf_io, "safe_open", safe_open)
    cfg = models.pretrained_config(path, jnp.bfloat16, remat="full", attention="xla")
    monkeypatch.setattr(hf_io, "safe_open", real_open)
    assert opened and cfg == models.from_pretrained(path, jnp.bfloat16, remat="full",
                                                   attention="xla").cfg
    opened.clear()
  monkeypatch.setattr(hf_io, "safe_open", safe_open)
  with pytest.raises(models.CheckpointError, match="a tensor was read"):  # the check's check
    models.from_pretrained(tiny_checkpoint)
