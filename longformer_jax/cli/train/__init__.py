"""Training commands: `python -m train.<name>` or `longformer-train-<name>`."""
