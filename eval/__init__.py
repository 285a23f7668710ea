"""Evaluation entry points (`python -m eval.bpc --workdir runs/char_tiny`)."""
