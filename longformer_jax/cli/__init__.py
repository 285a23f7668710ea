"""The settings layer: how a command line becomes a command's frozen config (`settings`). The
commands themselves are `longformer_jax.commands`."""
