"""Tiny random RoPE causal LMs for tests and benchmarks (built in milliseconds, no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from refusion.model.kernels.row_exact import register_with_transformers

TINY_VOCAB = 64
TINY_MASK_ID = 63
TINY_EOS_ID = 2


def tiny_model(arch: str = "qwen3", *, vocab_size: int = TINY_VOCAB, hidden_size: int = 32, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, max_positions: int = 1024, seed: int = 0,
               dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", **config_overrides):
    """A randomly initialised `arch` model ("qwen3", "llama", "qwen2", "mistral") with a mask token.

    The mask token is the last vocabulary id and EOS is id 2, both stored in the config. `config_overrides`
    are passed to the config (e.g. ``sliding_window=4``).
    """
    model_type = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}[arch]
    extra = {"intermediate_size": 2 * hidden_size} | ({"head_dim": hidden_size // heads} if model_type == "qwen3"
                                                        else {})
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False, eos_token_id=TINY_EOS_ID,
        bos_token_id=1, pad_token_id=0, **(extra | config_overrides),
    )
    config.mask_token_id = vocab_size - 1
    torch.manual_seed(seed)
    register_with_transformers()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    # Random init gives near-uniform logits; sharpen them so that thresholds are crossed both ways.
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model.eval()


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(*, with_mask: bool = True, extra_chars: str = ""):
    """A character-level tokenizer matching `tiny_model` (vocab 64, EOS/turn end 2, <|mask|> 63), built offline.

    Ids: 0 <pad>, 1 <s>, 2 <|im_end|>, 3 <|im_start|>, 4.. lower-case letters, digits, space, newline and
    punctuation (input is lower-cased; unknown characters become "?"), 63 <|mask|>. It has a ChatML chat
    template. `with_mask=False` leaves out <|mask|> (id 63 is then unused), for testing mask-token setup.
    `extra_chars` (e.g. "{}[]", what JSON needs beyond the default characters) take ids 63, 64, ... and move
    <|mask|> to the last id: pair it with `tiny_model(vocab_size=TINY_VOCAB + len(extra_chars))`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!+-*/=():;'\"#$%<>_")
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    assert len(vocab) <= TINY_MASK_ID, len(vocab)
    vocab.update({c: TINY_MASK_ID + i for i, c in enumerate(extra_chars)})
    if with_mask:
        vocab["<|mask|>"] = TINY_MASK_ID + len(extra_chars)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    extra = ["<|mask|>"] if with_mask else []
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>", unk_token="?",
        additional_special_tokens=["<|im_start|>", *extra],
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer
