"""The demo's verifiable task: multi-digit addition with an exact reward.

A prompt is ``BOS a + b =`` with both operands written with exactly
``digits`` decimal digits (leading zeros kept, so every prompt has the same
length ``2·digits + 3``).  The answer is the sum written least-significant
digit first (no leading zeros), then ``EOS``: reversed order lets a
left-to-right model compute each digit from the carry it has just produced,
so a small transformer learns it in minutes on a CPU.  The reward is exact:
1.0 when the response up to its first ``EOS`` equals the answer, else 0.0.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

PLUS, EQUALS, EOS, BOS = 10, 11, 12, 13
VOCAB_SIZE = 14
_CHARS = "0123456789+=$^"  # for printing: EOS '$', BOS '^'


class AdditionTask:
    """Random addition problems, their reference answers and the exact reward.

    Args:
        digits: operand length in decimal digits (1..9).

    Attributes:
        prompt_len: ``2·digits + 3`` tokens; max_answer_len: ``digits + 2``
            tokens (sum digits plus ``EOS``).
    """

    def __init__(self, digits: int = 4):
        if not 1 <= digits <= 9:
            raise ValueError(f"AdditionTask: digits must be in 1..9, got {digits}")
        self.digits = digits
        self.prompt_len = 2 * digits + 3
        self.max_answer_len = digits + 2
        self._pow = 10 ** torch.arange(digits - 1, -1, -1)

    def sample(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """``n`` random problems: operands ``(n, 2)`` int64 and prompts ``(n, prompt_len)`` int64."""
        ops = torch.randint(0, 10 ** self.digits, (n, 2), generator=generator)
        digs = (ops.unsqueeze(-1) // self._pow) % 10  # (n, 2, digits), most significant first
        col = lambda v: torch.full((n, 1), v, dtype=torch.long)
        prompts = torch.cat([col(BOS), digs[:, 0], col(PLUS), digs[:, 1], col(EQUALS)], dim=1)
        return ops, prompts

    def answers(self, ops: Tensor) -> tuple[Tensor, Tensor]:
        """Reference answers for operands ``(n, 2)``.

        Returns tokens ``(n, max_answer_len)`` int64 (sum digits least
        significant first, ``EOS``, then ``EOS`` padding) and lengths ``(n,)``
        int64 counting the ``EOS``.
        """
        total = ops.sum(dim=1)
        ndig = torch.where(total > 0, torch.floor(torch.log10(total.clamp_min(1).double())).long() + 1, 1)
        k = torch.arange(self.max_answer_len)
        digs = (total.unsqueeze(1) // 10 ** k.clamp_max(self.digits)) % 10  # least significant first
        tokens = torch.where(k < ndig.unsqueeze(1), digs, torch.full_like(digs, EOS))
        return tokens, ndig + 1

    def reward(self, responses: Tensor, ops: Tensor) -> Tensor:
        """Exact-match reward ``(n,)`` float32 in {0, 1} for ``responses`` ``(n, T)`` int64.

        Tokens after the first ``EOS`` are ignored; a response without ``EOS``
        or with a wrong digit scores 0.
        """
        ref, length = self.answers(ops)
        n, T = responses.shape
        L = self.max_answer_len
        resp = responses[:, :L] if T >= L else torch.cat([responses, torch.full((n, L - T), -1)], dim=1)
        k = torch.arange(L)
        ok = ((resp == ref) | (k >= length.unsqueeze(1))).all(dim=1)
        return ok.float()

    @staticmethod
    def render(tokens: Tensor) -> str:
        """Text form of a 1-D token tensor (``$`` = EOS, ``^`` = BOS), for logs and tests."""
        return "".join(_CHARS[int(t)] for t in tokens)
