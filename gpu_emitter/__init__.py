"""Engine side: a torch-backed hybrid BlockPool that publishes vLLM-compatible KV events,
and a simulated vLLM replica built on it. The only package that needs torch."""
