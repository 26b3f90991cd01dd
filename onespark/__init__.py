"""onespark: Qwen3.5-122B-A10B on one DGX Spark (checkpoint tools and CLI)."""

__version__ = "0.1.0"
