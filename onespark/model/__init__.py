"""What the model is: the supported specs and the Qwen3.5 checkpoint contract. Standard library only (the
system python3 reads it before any virtualenv exists); tests/test_wings.py holds that rule."""
