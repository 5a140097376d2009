"""Turn a plain AR causal LM into a ReFusion model: add `<|mask|>` (docs/TRAINING.md, "The objective, step by step").

The only architectural requirement of ReFusion is a mask token. `add_mask_token` adds it to the
tokenizer, gives it an embedding row equal to the mean of the existing rows, and records its id as
`config.mask_token_id`, the form in which a saved ReFusion checkpoint carries it (`special_tokens.py` reads it
from there at load). A model that already has one (the released checkpoint, or a model prepared before) keeps
its weights exactly as they are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from refusion.model.setup import attach_setup, setup_of
from refusion.model.special_tokens import MASK_TOKEN


def add_mask_token(model, tokenizer, *, token: str = MASK_TOKEN) -> int:
    """Give `model` and `tokenizer` a mask token; return its id (docs/TRAINING.md, "The objective, step by step").

    1. The model already has a mask token (`setup_of(model).special_tokens`: resolved at load from its config or its
       tokenizer): check the tokenizer agrees, record it in `model.config.mask_token_id`, change no weight.
    2. Otherwise add `token` to the tokenizer as a special token (if absent), grow the embeddings when the
       id falls outside them, set the token's input (and untied output) row to the mean row, and store
       the id in `model.config.mask_token_id` (and in the model's `ModelSetup`, when refusion prepared it).
    """
    vocab = tokenizer.get_vocab()
    setup = setup_of(model)
    tokens = setup.special_tokens
    existing = tokens.mask_token_id
    if existing is not None:
        _check_tokenizer_agrees(vocab, token, existing)
        model.config.mask_token_id = int(existing)
        return int(existing)
    if token not in vocab:
        tokenizer.add_special_tokens({"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
    mask_id = tokenizer.convert_tokens_to_ids(token)
    old_rows = model.get_input_embeddings().weight.shape[0]
    if mask_id >= old_rows:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
    _set_rows_to_mean(model, mask_id, n_reference_rows=min(old_rows, mask_id))
    model.config.mask_token_id = mask_id
    if setup.prepared:
        attach_setup(model, setup.replace(special_tokens=replace(tokens, mask_token_id=mask_id)))
    return mask_id


def _check_tokenizer_agrees(vocab: dict[str, int], token: str, mask_id: int) -> None:
    if token in vocab and vocab[token] != mask_id:
        raise ValueError(
            f"the model config says mask_token_id={mask_id} but the tokenizer maps {token!r} to {vocab[token]}"
        )


@torch.no_grad()
def _set_rows_to_mean(model, row: int, *, n_reference_rows: int) -> None:
    """Set embedding row `row` (input, and output when untied) to the mean of rows [0, n_reference_rows)."""
    embeddings = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != embeddings[0].data_ptr():
        embeddings.append(output.weight)
    for weight in embeddings:
        weight[row] = weight[:n_reference_rows].float().mean(dim=0).to(weight.dtype)
