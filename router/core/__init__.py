"""The router's logic, pure or nearly: the index of what each replica holds, vLLM's hybrid hit
rule over it, the prediction, the routing policy, the speculative overlay and the request
tokenizers. No sockets and no HTTP here (the remote tokenizer aside), so every piece is tested
exhaustively on its own; :mod:`router.server` wires it to the network."""
