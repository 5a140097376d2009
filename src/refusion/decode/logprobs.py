"""Log-probabilities of committed tokens (`DecodeConfig.logprobs`; docs/DECODING.md, "Logprobs").

A token's log-probability is read from the distribution that committed it, as the model gives it: the log-softmax
of the raw logits (temperature 1, as OpenAI reports them), never the temperature-scaled or noised distribution a
token was sampled from. Pure functions on small tensors; the tensors stay on the logits' device until the output is
built (`TokenLogprobs.to_list`), so recording them adds no host synchronisation to a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refusion.decode.outputs import TokenLogprob


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of a run of tokens, as tensors (a sequence's record before it is returned)."""

    tokens: torch.Tensor
    """[n] token ids."""
    logprobs: torch.Tensor
    """[n] log-probability of each token."""
    top_ids: torch.Tensor
    """[n, k] the k most likely tokens of each distribution, most likely first."""
    top_logprobs: torch.Tensor
    """[n, k] their log-probabilities."""

    def __getitem__(self, index) -> TokenLogprobs:
        return TokenLogprobs(self.tokens[index], self.logprobs[index], self.top_ids[index], self.top_logprobs[index])

    def __len__(self) -> int:
        return self.tokens.numel()

    @staticmethod
    def cat(parts: list[TokenLogprobs], dim: int = 0) -> TokenLogprobs:
        """The parts joined along leading dim `dim` (0 or 1)."""
        return TokenLogprobs(*(torch.cat([getattr(p, name) for p in parts], dim)
                               for name in ("tokens", "logprobs", "top_ids", "top_logprobs")))

    def reshape(self, *shape: int) -> TokenLogprobs:
        """Leading dims reshaped to `shape` (the top-k dim stays last)."""
        tokens = self.tokens.reshape(shape)
        top_shape = (*tokens.shape, self.top_ids.shape[-1])  # explicit: -1 is ambiguous when k is 0
        return TokenLogprobs(tokens, self.logprobs.reshape(shape), self.top_ids.reshape(top_shape),
                             self.top_logprobs.reshape(top_shape))

    @staticmethod
    def where(choose: torch.Tensor, a: TokenLogprobs, b: TokenLogprobs) -> TokenLogprobs:
        """Entry i of `a` where choose[i], else of `b` (choose: [...] over the leading dims; broadcasts)."""
        return TokenLogprobs(torch.where(choose, a.tokens, b.tokens), torch.where(choose, a.logprobs, b.logprobs),
                             torch.where(choose[..., None], a.top_ids, b.top_ids),
                             torch.where(choose[..., None], a.top_logprobs, b.top_logprobs))

    def flatten(self) -> TokenLogprobs:
        """Leading dims flattened: [r, w] -> [r * w]."""
        return self.reshape(-1)

    def to_list(self) -> list[TokenLogprob]:
        """Python values (one host transfer)."""
        tokens, logprobs = self.tokens.tolist(), self.logprobs.double().tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.double().tolist()
        return [TokenLogprob(t, lp, list(zip(ids, lps))) for t, lp, ids, lps in zip(tokens, logprobs, top_ids,
                                                                                  top_logprobs)]


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] log-probabilities in float32 at least (float64 logits stay float64)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> TokenLogprobs:
    """logits [..., V] and the tokens committed from them [...] -> their log-probabilities and each distribution's
    `top` most likely tokens."""
    logp = log_softmax(logits)
    top_logprobs, top_ids = logp.topk(top, -1) if top else (logp[..., :0], tokens[..., None][..., :0])
    return TokenLogprobs(tokens, logp.gather(-1, tokens[..., None]).squeeze(-1), top_ids, top_logprobs)


def shifted_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> TokenLogprobs:
    """The AR log-probabilities of tokens [..., T] given everything before them in the same forward: token j reads
    the logits at j - 1 ([..., T, V]); token 0 reads its own (a value the callers never use: as in
    `infill.shifted_token_probs`)."""
    shifted = torch.cat([logits[..., :1, :], logits[..., :-1, :]], dim=-2)
    return token_logprobs(shifted, tokens, top)
