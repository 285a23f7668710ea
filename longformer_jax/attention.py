"""`LongformerSelfAttention`: the one attention module of every model here.

One module serves the HF-compatible encoder (bidirectional band, global tokens with their own
projections, learned positions added outside) and the character LM (causal band, rotary
positions, no global projections), the way one attention module serves global and sliding
layers in flax's gemma. LED's encoder reuses it as the encoder does.

Projections: `query, key, value` serve the band; `query_global, key_global, value_global` (when
`global_projections="separate"`) serve global tokens (paper §3.1, "Linear Projections for Global
Attention"); `output` maps the heads back to the hidden width. Semantics: docs/design.md §1.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from longformer_jax import ops
from longformer_jax.layers import Initializer, dense, rotary

_ATTENTIONS = ("band", "full")
# How global attention is projected: its own q/k/v (the paper's), the band's, or not at all.
GLOBAL_PROJECTIONS = ("separate", "shared", "none")


class LongformerSelfAttention(nnx.Module):
  """Sliding-window + global self-attention, output projection included.

  Args:
    hidden_size, num_heads: E and H (head_dim D = E / H).
    window: one-sided window (a call may override it: the char LM's schedule grows windows).
    dilation: an int, or one int per head.
    causal: a causal band (then no global tokens).
    impl: the op's implementation ("auto", "reference", "chunked", "pallas").
    global_projections: "separate" creates `query_global, key_global, value_global` for global
      attention (the paper's §3.1); "shared" computes global attention with the band's
      `query, key, value` (the ablation the paper argues against); "none" takes no global mask.
    rope_base: apply rotary positions with this base to queries and keys (None: none).
    attention: "band", or "full" (dense attention through `jax.nn.dot_product_attention`, causal
      when `causal`: a baseline that ignores window and dilation).
    kernel_init: initialiser of the q/k/v (and global) projections; output_init: of `output`
      (default: kernel_init).
    mesh: the device mesh the activations are laid out on. Given one, the band op runs per
      shard inside `shard_map` (Pallas kernels cannot be partitioned by XLA), its batch split
      over every mesh axis but seq_axis. None: the caller's mesh decides (the op runs per shard
      on Explicit axes, on the caller's shards inside its shard_map, and leaves Auto axes to
      XLA; `ops.longformer_attention`).
    seq_axis: the mesh axis that splits sequences (sequence-parallel band attention with halo
      exchange, `ops.longformer_attention`): an axis of `mesh`, or with mesh=None an Explicit
      axis of the current mesh or the caller's shard_map axis; None: whole sequences on every
      device.
    The mesh is not a parameter or config: it is part of the module's static structure (its
    graphdef), so a model built for one mesh runs on that mesh. `attention="full"` ignores mesh
    and seq_axis: `jax.nn.dot_product_attention` is plain XLA, which GSPMD partitions by itself
    (gathering what the sharded sequence needs).
  """

  def __init__(self, hidden_size: int, num_heads: int, *, window: int,
               dilation: int | Sequence[int] = 1, causal: bool = False, impl: str = "auto",
               global_projections: str = "separate", rope_base: float | None = None,
               attention: str = "band", kernel_init: Initializer = nnx.initializers.normal(0.02),
               output_init: Initializer | None = None, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs, mesh: jax.sharding.Mesh | None = None,
               seq_axis: str | None = None):
    if hidden_size % num_heads:
      raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    if attention not in _ATTENTIONS:
      raise ValueError(f"attention must be one of {_ATTENTIONS}, got {attention!r}")
    if global_projections not in GLOBAL_PROJECTIONS:
      raise ValueError(f"global_projections must be one of {GLOBAL_PROJECTIONS}, got "
                       f"{global_projections!r}")
    head_dim = hidden_size // num_heads
    self.window = window
    dilation = (dilation,) * num_heads if isinstance(dilation, int) else tuple(dilation)
    if len(dilation) != num_heads:
      raise ValueError(f"dilation has {len(dilation)} entries for {num_heads} heads: {dilation}")
    # One int when every head agrees: the op then runs all heads as one group.
    self.dilation = dilation[0] if len(set(dilation)) == 1 else dilation
    self.causal = causal
    self.impl = impl
    self.rope_base = rope_base
    self.attention = attention
    if seq_axis is not None and not isinstance(seq_axis, str):
      raise TypeError(f"seq_axis={seq_axis!r}: expected one mesh axis name")
    self.mesh = mesh
    self.seq_axis = seq_axis
    init = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    in_axes = ("embed", "heads", "kv")
    qkv = lambda: dense(hidden_size, (num_heads, head_dim), in_axes, init=kernel_init, **init)
    self.query, self.key, self.value = qkv(), qkv(), qkv()
    self.global_projections = global_projections
    no_globals = (None, None, None)
    self.query_global, self.key_global, self.value_global = (
        (qkv(), qkv(), qkv()) if global_projections == "separate" else no_globals)
    self.output = dense((num_heads, head_dim), hidden_size, ("heads", "kv", "embed"),
                        init=kernel_init if output_init is None else output_init, **init)

  def copy_local_to_global(self) -> None:
    """Sets the global projections to copies of the band's (the paper's initialisation of the
    global projections, §3.1; `convert` does the same to HF weights). Raises ValueError without
    separate global projections."""
    if self.global_projections != "separate":
      raise ValueError(f"nothing to copy to: global_projections={self.global_projections!r}")
    for local, glob in ((self.query, self.query_global), (self.key, self.key_global),
                        (self.value, self.value_global)):
      glob.kernel[...] = jnp.array(local.kernel[...])
      glob.bias[...] = jnp.array(local.bias[...])

  def _project(self, q_proj, k_proj, v_proj, hidden_BxNxE):
    q_BxNxHxD, k_BxNxHxD = q_proj(hidden_BxNxE), k_proj(hidden_BxNxE)
    if self.rope_base is not None:
      q_BxNxHxD, k_BxNxHxD = rotary(q_BxNxHxD, self.rope_base), rotary(k_BxNxHxD, self.rope_base)
    return q_BxNxHxD, k_BxNxHxD, v_proj(hidden_BxNxE)

  def __call__(self, hidden_BxNxE: jax.Array, attention_mask_BxN: jax.Array | None = None,
               global_mask_BxN: jax.Array | None = None, *, window: int | None = None,
               max_global: int | None = None, output_attentions: bool = False):
    """Returns (output [B,N,E], probabilities [B,H,N,N] float32 if output_attentions else None).

    attention_mask: True for real tokens (None: all real). global_mask: True for global tokens,
    or None (then the global projections are not computed). window: this call's one-sided
    window (None: the module's). max_global: static bound on global tokens per row, needed by
    the op when global_mask is traced (see `ops.longformer_attention`). output_attentions runs
    the dense O(N^2) reference attention: for inspecting small inputs.
    """
    q_BxNxHxD, k_BxNxHxD, v_BxNxHxD = self._project(self.query, self.key, self.value,
                                                    hidden_BxNxE)
    global_qkv = None
    if global_mask_BxN is not None:
      if self.global_projections == "none":
        raise ValueError("a global_mask was given to an attention built without global "
                         "projections (global_projections='none')")
      global_qkv = ((q_BxNxHxD, k_BxNxHxD, v_BxNxHxD) if self.global_projections == "shared"
                    else self._project(self.query_global, self.key_global, self.value_global,
                                       hidden_BxNxE))
    probs_BxHxNxN = None
    if self.attention == "full":
      if global_mask_BxN is not None or output_attentions:
        raise ValueError("attention='full' takes no global_mask and no output_attentions")
      mask = None if attention_mask_BxN is None else attention_mask_BxN[:, None, None, :]
      out_BxNxHxD = jax.nn.dot_product_attention(q_BxNxHxD, k_BxNxHxD, v_BxNxHxD, mask=mask,
                                                 is_causal=self.causal)
      return self.output(out_BxNxHxD), None
    args = dict(window=self.window if window is None else window, dilation=self.dilation,
                causal=self.causal, attention_mask=attention_mask_BxN,
                global_mask=global_mask_BxN, global_qkv=global_qkv)
    if output_attentions:
      out_BxNxHxD, probs_BxHxNxN = ops.longformer_attention_reference(
          q_BxNxHxD, k_BxNxHxD, v_BxNxHxD, **args, return_probs=True)
    else:
      out_BxNxHxD = ops.longformer_attention(q_BxNxHxD, k_BxNxHxD, v_BxNxHxD, **args,
                                             impl=self.impl, max_global=max_global,
                                             mesh=self.mesh, seq_axis=self.seq_axis)
    return self.output(out_BxNxHxD), probs_BxHxNxN
