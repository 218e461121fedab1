"""Write the tiny dummy-weight hybrid model vLLM serves in these experiments.

Gemma3-style text model: 4 layers alternating sliding-window (64) and full attention, hidden
128, 2 heads, 1 KV head, head_dim 64, vocab 2048, bfloat16; served with ``--load-format
dummy`` so no weights exist. The tokenizer is built locally with the ``tokenizers`` library: a
WordLevel vocabulary where word ``wN`` is one token (id N+7), specials ``<pad> <eos> <bos>
<unk>`` and role words ``<system> <user> <assistant>``, BOS prepended, and a chat template in
``tokenizer_config.json``. vLLM then reports two KV-cache groups: 0 sliding_window (64) and 1
full_attention (../../../shared/spec/real-vllm-on-cpu.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

VOCAB = 2048
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "query_pre_attn_scalar": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}


def word(token_id: int) -> str:
    """The vocabulary word whose id is ``token_id`` (ids below 7 are specials)."""
    return f"w{token_id - len(SPECIALS)}"


def write_model(
    directory: Path,
    sliding_window: int = 64,
    layer_types: Sequence[str] | None = None,
) -> Path:
    """Write config, generation config and tokenizer files into ``directory``.

    ``sliding_window`` and ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per
    layer; default ``CONFIG``'s alternating four) let a benchmark serve another hybrid pattern,
    e.g. three sliding-window layers per full-attention one; the defaults are the model the
    golden tests were recorded with.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), VOCAB):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIALS[:4])
    tok.save(str(directory / "tokenizer.json"))
    specials = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    layers = list(layer_types) if layer_types is not None else list(CONFIG["layer_types"])
    config = {
        **CONFIG,
        "sliding_window": sliding_window,
        "layer_types": layers,
        "num_hidden_layers": len(layers),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}, indent=2)
    )
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **specials,
                "add_bos_token": True,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return directory
