"""char_tiny's training step against a PyTorch byte LM of the same shape, side by side.

  python benchmarks/charlm.py                          # 5 rounds x 5 steps per row, 256 x 8
  python benchmarks/charlm.py --rounds 9 --calls 10    # longer, for a loaded machine
  python benchmarks/charlm.py --tiny --out /tmp/charlm # a toy model, a few steps: a smoke run

Ours: the step `python -m train.charlm --preset char_tiny` trains, built by the trainer itself
(`training.Trainer(char_tiny(), task=CharLMTask(...)).train_step(0)`: `CharLMConfig.tiny()`, 4
layers x hidden 128, 4 heads, FFN 512, causal windows 32/64/96/128 from the bottom layer up, no
dilation, no global tokens, rotary positions, tied byte embedding; clipping to global norm 1 and
AdamW (b2 0.98, weight decay on matrices only) with the stage's learning-rate schedule; 256 x 8
bytes a step), jitted, its state donated.

The peer (`ByteLM`, written here with plain torch.nn modules): the same network. Pre-LayerNorm
blocks with q, k, v and output projections with biases, rotary positions on q and k (the halves
of each head rotated, as ours), `scaled_dot_product_attention` under a banded causal mask per
layer (query i sees keys i - w .. i, w that layer's window), a tanh-GELU MLP, a final LayerNorm
and logits through the tied byte embedding; next-byte cross-entropy; `clip_grad_norm_` to the
same norm and `torch.optim.AdamW` with the same betas, eps and weight decay (matrices and
embedding only) at the stage's peak learning rate (a schedule changes no cost). Eager PyTorch,
`torch.set_num_threads(cpu count)`.

Checked before anything is timed: the parameter counts (printed, must agree within 1%) and the
logits of both on one batch with OUR weights copied into the peer (float32, within 1e-3), so the
two compute the same function (the band, the rotation, the tied head). Then interleaved rounds
(benchmarks/attention.py's `interleaved_rounds`: each round runs both rows `--calls` steps, the
order rotated, the 1-minute load average before and after each round), summarised by
`harness.side_by_side`: each row's fastest and median step and tokens/s, and per round the
peer's fastest step over ours (= our tokens/s over the peer's) with its median and range.

Writes `<out>/charlm_vs_torch_<tiny|char_tiny>_cpu<n>_<date>_<commit>.json`, `.md` and `.png`
(the per-round ratios beside the load). CPU only: JAX is pinned to the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py

harness.pin_platform("cpu")  # before JAX is imported
# torch's OpenMP threads would otherwise spin after each torch step, taking the cores from our
# step that follows it in the round: both sides yield their cores when idle. Before torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax
import numpy as np
from flax import nnx

from attention import interleaved_rounds
from longformer_jax.causal_lm import num_params
from longformer_jax.tasks.charlm import CharLMTask, char_tiny
from longformer_jax.training.config import TrainConfig
from longformer_jax.training.loop import Trainer

PARAM_TOLERANCE = 0.01  # relative difference of the parameter counts
LOGIT_TOLERANCE = 1e-3  # max |ours - peer| logit, float32, same weights
# --tiny: a toy model of the same structure (2 layers, windows 8 and 16) on 64 x 2 bytes.
TINY_MODEL = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                  intermediate_size=64, attention_window=(8, 16))
TINY_SHAPE = dict(seq_len=64, batch_size=2)


def train_config(tiny: bool) -> TrainConfig:
  """char_tiny's run config (--tiny: the toy model and shape, everything else char_tiny's)."""
  cfg = char_tiny()
  if tiny:
    cfg = dataclasses.replace(cfg, model=cfg.model.replace(**TINY_MODEL),
                              stages=(dataclasses.replace(cfg.stages[0], **TINY_SHAPE),))
  return cfg


def make_bytes(cfg: TrainConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """One batch of the stage's shape: random bytes, the targets the inputs shifted by one."""
  stage = cfg.stages[0]
  rng = np.random.default_rng(seed)
  window = rng.integers(0, cfg.model.vocab_size, (stage.batch_size, stage.seq_len + 1),
                        dtype=np.int32)
  return {"inputs": window[:, :-1], "targets": window[:, 1:]}


# ------------------------------------------------------------------------------------------------
# Ours: the trainer's own step.


def our_step(cfg: TrainConfig, batch: dict[str, np.ndarray]):
  """(step, trainer): `step()` runs one of the trainer's jitted training steps of stage 0 on
  `batch` (its state donated and kept) and returns its loss (waited for)."""
  rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1).reshape(-1)
  trainer = Trainer(cfg, task=CharLMTask(train_data=rows, valid_data=rows))
  step_fn = trainer.train_step(0)
  arrays = trainer.global_batch(batch, cfg.stages[0].batch_size)
  holder = {"state": trainer.init_state()}

  def step():
    holder["state"], metrics = step_fn(holder["state"], arrays)
    return jax.block_until_ready(metrics["loss"])

  step.holder = holder
  return step, trainer


# ------------------------------------------------------------------------------------------------
# The peer: a PyTorch byte LM of the same shape.


def build_torch_peer(torch, cfg: TrainConfig):
  """The peer model for `cfg.model` (a CharLMConfig): see the module docstring."""
  nn, functional = torch.nn, torch.nn.functional
  model_cfg = cfg.model
  hidden, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
  head_dim = hidden // heads
  seq = cfg.stages[0].seq_len
  windows = cfg.stage_windows(0)
  if any(d != 1 for layer in model_cfg.layer_dilations for d in layer):
    raise ValueError(f"the peer has no dilation; attention_dilation="
                     f"{model_cfg.attention_dilation!r}")
  if model_cfg.hidden_act != "gelu_new":
    raise ValueError(f"the peer's MLP is tanh-GELU (gelu_new); hidden_act="
                     f"{model_cfg.hidden_act!r}")

  # Rotary angles [N, D/2]: position * base^(-2k/D), as longformer_jax.layers.rotary.
  inv_freq = model_cfg.rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32)
                                     / head_dim)
  angle = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
  cos, sin = torch.cos(angle), torch.sin(angle)

  def rotate(x_BxHxNxD):
    x1, x2 = x_BxHxNxD.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

  def band_mask(window: int):
    """True where query i may attend key j: i - window <= j <= i."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    return (j <= i) & (i - j <= window)

  class Block(nn.Module):
    def __init__(self, window: int):
      super().__init__()
      eps = model_cfg.layer_norm_eps
      self.ln_attn = nn.LayerNorm(hidden, eps=eps)
      self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
      self.output = nn.Linear(hidden, hidden)
      self.ln_mlp = nn.LayerNorm(hidden, eps=eps)
      self.intermediate = nn.Linear(hidden, model_cfg.intermediate_size)
      self.mlp_output = nn.Linear(model_cfg.intermediate_size, hidden)
      self.register_buffer("mask", band_mask(window), persistent=False)

    def forward(self, x_BxNxE):
      batch, n, _ = x_BxNxE.shape
      h = self.ln_attn(x_BxNxE)
      split = lambda t: t.view(batch, n, heads, head_dim).transpose(1, 2)
      q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
      attended = functional.scaled_dot_product_attention(rotate(q), rotate(k), v,
                                                         attn_mask=self.mask)
      x_BxNxE = x_BxNxE + self.output(attended.transpose(1, 2).reshape(batch, n, hidden))
      h = functional.gelu(self.intermediate(self.ln_mlp(x_BxNxE)), approximate="tanh")
      return x_BxNxE + self.mlp_output(h)

  class ByteLM(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(model_cfg.vocab_size, hidden)
      self.layers = nn.ModuleList(Block(w) for w in windows)
      self.ln_final = nn.LayerNorm(hidden, eps=model_cfg.layer_norm_eps)

    def forward(self, tokens_BxN):
      x = self.embed(tokens_BxN)
      for layer in self.layers:
        x = layer(x)
      return self.ln_final(x) @ self.embed.weight.T  # the tied byte head

  if not model_cfg.tie_word_embeddings:
    raise ValueError("the peer ties its byte head to the embedding; tie_word_embeddings=False")
  return ByteLM()


def copy_weights(torch, peer, ours) -> None:
  """Our LongformerForCausalLM's parameters into the peer (a torch Linear weight is [out, in]:
  our kernel flattened to [in, out], transposed)."""
  params = nnx.to_pure_dict(nnx.state(ours, nnx.Param))

  def put(target, value):
    value = torch.from_numpy(np.array(value, np.float32))
    if tuple(target.shape) != tuple(value.shape):
      raise ValueError(f"shape {tuple(value.shape)} for a peer parameter of shape "
                       f"{tuple(target.shape)}")
    target.data.copy_(value)

  def linear(target, dense, n_in: int):
    kernel = np.asarray(dense["kernel"], np.float32)
    put(target.weight, kernel.reshape(int(np.prod(kernel.shape[:n_in])), -1).T)
    put(target.bias, np.asarray(dense["bias"], np.float32).reshape(-1))

  def norm(target, ln):
    put(target.weight, ln["scale"])
    put(target.bias, ln["bias"])

  with torch.no_grad():
    put(peer.embed.weight, params["embed"]["embedding"])
    norm(peer.ln_final, params["ln_final"])
    for i, layer in enumerate(peer.layers):
      p = params["layers"][i]
      norm(layer.ln_attn, p["ln_attn"])
      norm(layer.ln_mlp, p["ln_mlp"])
      for name in ("query", "key", "value"):
        linear(getattr(layer, name), p["attention"][name], 1)
      linear(layer.output, p["attention"]["output"], 2)
      linear(layer.intermediate, p["intermediate"], 1)
      linear(layer.mlp_output, p["output"], 1)


def torch_step(torch, cfg: TrainConfig, peer, batch: dict[str, np.ndarray]):
  """`step()`: one peer training step on `batch` (clip, AdamW), returning its loss (a float)."""
  stage = cfg.stages[0]
  decay = [p for p in peer.parameters() if p.ndim >= 2]
  no_decay = [p for p in peer.parameters() if p.ndim < 2]
  optimizer = torch.optim.AdamW(
      [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)],
      lr=stage.learning_rate, betas=(cfg.adam_b1, cfg.adam_b2), eps=cfg.adam_eps)
  inputs = torch.from_numpy(batch["inputs"]).long()
  targets = torch.from_numpy(batch["targets"]).long()
  peer.train()

  def step():
    optimizer.zero_grad(set_to_none=True)
    logits = peer(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(peer.parameters(), cfg.clip_norm)
    optimizer.step()
    return float(loss.detach())

  return step


# ------------------------------------------------------------------------------------------------


def check_same_function(torch, cfg: TrainConfig, trainer: Trainer, peer,
                        batch: dict[str, np.ndarray]) -> float:
  """Max |our logits - the peer's| on `batch` with our initial weights copied into the peer."""
  ours = trainer.model(trainer.init_state().params)
  copy_weights(torch, peer, ours)
  logits = nnx.jit(lambda model, tokens: model(tokens, windows=cfg.stage_windows(0)))
  with jax.default_matmul_precision("highest"):
    our_logits = np.asarray(logits(ours, batch["inputs"]), np.float32)
  peer.eval()
  with torch.no_grad():
    peer_logits = peer(torch.from_numpy(batch["inputs"]).long()).numpy()
  return float(np.max(np.abs(our_logits - peer_logits)))


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, "
                                                               "2 with --tiny)")
  parser.add_argument("--calls", type=int, default=None,
                      help="training steps per row per round (default 5, 2 with --tiny)")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps per row first (ours compiles in the first)")
  harness.common_arguments(parser, out=harness.default_out(),
                           tiny_help="a toy model of the same structure (2 layers x hidden 32, "
                                     "windows 8 and 16) on 64 x 2 bytes: a smoke run")
  args = parser.parse_args(argv)
  args.rounds = 2 if args.rounds is None and args.tiny else (args.rounds or 5)
  args.calls = 2 if args.calls is None and args.tiny else (args.calls or 5)
  for name in ("rounds", "calls"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.warmup < 1:
    parser.error(f"--warmup must be >= 1 (the first step compiles), got {args.warmup}")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  try:
    import torch
  except ImportError as e:
    print(f"error: the peer needs torch ({e})", file=sys.stderr)
    sys.exit(1)
  torch.set_num_threads(os.cpu_count() or 1)
  torch.manual_seed(0)
  cfg = train_config(args.tiny)
  stage, model_cfg = cfg.stages[0], cfg.model
  tokens_per_step = stage.seq_len * stage.batch_size
  stamp = harness.stamp() | {"cpu_count": os.cpu_count(), "torch": torch.__version__,
                             "rounds": args.rounds, "calls": args.calls, "warmup": args.warmup}
  name = "tiny" if args.tiny else "char_tiny"
  result = dict(
      stamp=stamp, config=name, seq=stage.seq_len, batch=stage.batch_size,
      tokens_per_step=tokens_per_step,
      model=dict(layers=model_cfg.num_hidden_layers, hidden=model_cfg.hidden_size,
                 heads=model_cfg.num_attention_heads, intermediate=model_cfg.intermediate_size,
                 vocab=model_cfg.vocab_size, windows=list(cfg.stage_windows(0)),
                 dilation=1, global_tokens=0, attention_impl=model_cfg.attention_impl,
                 dtype=model_cfg.dtype.name),
      optimizer=dict(name="clip to global norm + AdamW", clip_norm=cfg.clip_norm,
                     learning_rate=stage.learning_rate, betas=[cfg.adam_b1, cfg.adam_b2],
                     eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                     decayed="parameters with ndim >= 2"))
  print(stamp, flush=True)
  print(f"{name}: {result['model']}, {stage.seq_len} x {stage.batch_size} bytes a step",
        flush=True)
  out = pathlib.Path(args.out)
  path = out / f"charlm_vs_torch_{name}_cpu{os.cpu_count()}_{stamp['date']}_{stamp['commit']}.json"

  batch = make_bytes(cfg)
  step_ours, trainer = our_step(cfg, batch)
  peer = build_torch_peer(torch, cfg)
  result["params"] = dict(ours=num_params(trainer.model(step_ours.holder["state"].params)),
                          torch=int(sum(p.numel() for p in peer.parameters())))
  relative = abs(result["params"]["ours"] - result["params"]["torch"]) / result["params"]["ours"]
  print(f"parameters: ours {result['params']['ours']:,}, torch {result['params']['torch']:,}",
        flush=True)
  diff = check_same_function(torch, cfg, trainer, peer, batch)
  result["agreement"] = dict(max_abs_logit_diff=diff, tolerance=LOGIT_TOLERANCE,
                             params_relative_diff=round(relative, 6),
                             params_tolerance=PARAM_TOLERANCE,
                             what="logits on the timed batch, float32, our initial weights "
                                  "copied into the peer")
  print(f"agreement: max |ours - torch| logit = {diff:.2e}", flush=True)
  if not (diff <= LOGIT_TOLERANCE and relative <= PARAM_TOLERANCE):
    result["status"] = "failed: the peer is not the same model; nothing timed"
    harness.write_json(path, result)
    print(f"error: {result['status']}: {result['agreement']}; wrote {path}", file=sys.stderr)
    sys.exit(1)

  step_torch = torch_step(torch, cfg, peer, batch)
  ours_name = "ours: longformer_jax char_tiny train step (Trainer, jit)"
  peer_name = "torch byte LM (eager, banded causal mask, AdamW)"
  rows = [(ours_name, "step", step_ours), (peer_name, "step", step_torch)]
  result["first_step_loss"] = harness.warm_up(rows, args.warmup)
  times, loads = interleaved_rounds(rows, args.rounds, args.calls)
  result["summary"] = harness.side_by_side([ours_name, peer_name], times, loads,
                                           tokens_per_step=tokens_per_step)
  result["status"] = "ok"
  harness.write_side_by_side(path, result, markdown(result, args),
                             f"{name} training step vs torch, per round")
  return result | {"path": str(path)}


def markdown(result: dict, args) -> str:
  st, m, p, a = result["stamp"], result["model"], result["params"], result["agreement"]
  command = ("python benchmarks/charlm.py" + (" --tiny" if args.tiny else "")
             + f" --rounds {st['rounds']} --calls {st['calls']}")
  header = (f"{result['config']} training step, ours vs a PyTorch byte LM of the same shape side "
            f"by side, {st['device']} ({st['cpu_count']} cores), {m['dtype']}, jax {st['jax']}, "
            f"torch {st['torch']}, {st['date']}, commit {st['commit']}. {m['layers']} layers x "
            f"hidden {m['hidden']}, {m['heads']} heads, FFN {m['intermediate']}, vocabulary "
            f"{m['vocab']}, causal windows {m['windows']} (bottom to top), "
            f"{result['seq']} x {result['batch']} bytes a step; parameters: ours {p['ours']:,}, "
            f"torch {p['torch']:,}; logits with the same weights within "
            f"{a['max_abs_logit_diff']:.1e}. {st['rounds']} interleaved rounds x {st['calls']} "
            f"steps per row (`{command}`).")
  return header + "\n\n" + harness.side_by_side_markdown(result["summary"])


if __name__ == "__main__":
  main()
