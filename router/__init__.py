"""kvrouter's routing side: block hashing, the per-group index, vLLM's hybrid hit rule,
scoring and the HTTP faces. Imports without torch."""
