"""The onespark vLLM plugin (entry point group `vllm.general_plugins`)."""
