"""Serving: what runs beside the vLLM server: serve (one Spark), cluster (two), their one launch path (launch:
container flags, health wait, smoke request), the memory plan and guard (memory), doctor, the vLLM log's
stages (vllm_log), and the prompt-compression proxy (`onespark compress serve`). Standard library only at
module level: `install.sh --dry-run` imports the serving wing before any virtualenv exists, so httpx, torch,
transformers and llmlingua are imported inside the functions that need them (tests/test_wings.py)."""
