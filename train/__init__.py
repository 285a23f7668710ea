"""Training entry points (`python -m train.charlm --config train/configs/char_tiny.py`)."""
