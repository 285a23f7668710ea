"""Evaluation commands: `python -m eval.<name>` or `longformer-eval-<name>`."""
