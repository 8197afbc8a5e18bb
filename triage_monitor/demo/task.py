"""The demo's verifiable tasks: multi-digit addition (exact reward) and a free walk (partial credit).

A prompt is ``BOS a + b =`` with both operands written with exactly
``digits`` decimal digits (leading zeros kept, so every prompt has the same
length ``2·digits + 3``).  The answer is the sum written least-significant
digit first (no leading zeros), then ``EOS``: reversed order lets a
left-to-right model compute each digit from the carry it has just produced,
so a small transformer learns it in minutes on a CPU.  The reward is exact:
1.0 when the response up to its first ``EOS`` equals the answer, else 0.0.

:class:`WalkTask` is the long-response task of the mismatch study: 64-token
responses (4 segments of 16 tokens) with many valid answers and partial credit, so the policy keeps its
entropy under RL (on a task with one right answer GRPO sharpens the policy
until learner and sampler agree on almost every token and the mismatch heals
itself).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

Tensor = torch.Tensor

PLUS, EQUALS, EOS, BOS = 10, 11, 12, 13
VOCAB_SIZE = 14
_CHARS = "0123456789+=$^"  # for printing: EOS '$', BOS '^'


class Problems(NamedTuple):
    """A task's ``sample``: what defines each problem (addition: operands, walk: allowed digits) and the prompts."""

    spec: Tensor
    prompts: Tensor


class ReferenceAnswers(NamedTuple):
    """A task's ``answers``: the reference answer tokens ``(n, T)`` int64 and their lengths ``(n,)`` int64."""

    tokens: Tensor
    lengths: Tensor


class AdditionTask:
    """Random addition problems, their reference answers and the exact reward.

    Args:
        digits: operand length in decimal digits (1..9).

    Attributes:
        prompt_len: ``2·digits + 3`` tokens; max_answer_len: ``digits + 2``
            tokens (sum digits plus ``EOS``); vocab_size: :data:`VOCAB_SIZE`.
    """

    def __init__(self, digits: int = 4):
        if not 1 <= digits <= 9:
            raise ValueError(f"AdditionTask: digits must be in 1..9, got {digits}")
        self.digits = digits
        self.vocab_size = VOCAB_SIZE
        self.prompt_len = 2 * digits + 3
        self.max_answer_len = digits + 2
        self._pow = 10 ** torch.arange(digits - 1, -1, -1)

    def sample(self, n: int, generator: torch.Generator) -> Problems:
        """``n`` random problems: operands ``(n, 2)`` int64 and prompts ``(n, prompt_len)`` int64."""
        ops = torch.randint(0, 10 ** self.digits, (n, 2), generator=generator)
        digs = (ops.unsqueeze(-1) // self._pow) % 10  # (n, 2, digits), most significant first
        col = lambda v: torch.full((n, 1), v, dtype=torch.long)
        prompts = torch.cat([col(BOS), digs[:, 0], col(PLUS), digs[:, 1], col(EQUALS)], dim=1)
        return Problems(ops, prompts)

    def answers(self, ops: Tensor, generator: Optional[torch.Generator] = None) -> ReferenceAnswers:
        """Reference answers for operands ``(n, 2)`` (``generator`` is unused: the answer is unique).

        Returns tokens ``(n, max_answer_len)`` int64 (sum digits least
        significant first, ``EOS``, then ``EOS`` padding) and lengths ``(n,)``
        int64 counting the ``EOS``.
        """
        total = ops.sum(dim=1)
        ndig = torch.where(total > 0, torch.floor(torch.log10(total.clamp_min(1).double())).long() + 1, 1)
        k = torch.arange(self.max_answer_len, device=ops.device)
        digs = (total.unsqueeze(1) // 10 ** k.clamp_max(self.digits)) % 10  # least significant first
        tokens = torch.where(k < ndig.unsqueeze(1), digs, torch.full_like(digs, EOS))
        return ReferenceAnswers(tokens, ndig + 1)

    def reward(self, responses: Tensor, ops: Tensor) -> Tensor:
        """Exact-match reward ``(n,)`` float32 in {0, 1} for ``responses`` ``(n, T)`` int64.

        Tokens after the first ``EOS`` are ignored; a response without ``EOS``
        or with a wrong digit scores 0.
        """
        ref, length = self.answers(ops)
        n, T = responses.shape
        L = self.max_answer_len
        resp = responses[:, :L] if T >= L else torch.cat(
            [responses, torch.full((n, L - T), -1, device=responses.device)], dim=1)
        k = torch.arange(L, device=responses.device)
        ok = ((resp == ref) | (k >= length.unsqueeze(1))).all(dim=1)
        return ok.float()

    @staticmethod
    def render(tokens: Tensor) -> str:
        """Text form of a 1-D token tensor (``$`` = EOS, ``^`` = BOS), for logs and tests."""
        return "".join(_CHARS[int(t)] for t in tokens)


class WalkTask:
    """A long-response task that keeps its entropy under RL: a free walk over an allowed alphabet.

    A prompt is ``BOS d₁ … d_k =``: ``k = alphabet`` distinct decimal digits
    (sorted), the allowed symbols.  The response is exactly ``length`` tokens
    (no ``EOS``; every position is a scored token).  A token is *valid* when it
    is one of the allowed digits and differs from the token before it (the
    first token only has to be allowed).  The reward is noisy partial credit:
    the share of valid tokens, in [0, 1].  Every walk through the allowed
    digits that never repeats a symbol scores 1, so an optimal policy keeps
    ``ln(alphabet − 1)`` nats of entropy per token (ln 3 ≈ 1.10 for the
    default 4 symbols): GRPO has no reason to collapse it to one answer.

    Args:
        length: response tokens (>= 1; 64 with 16-token segments gives 4 segments per response).
        alphabet: allowed digits per prompt (2..9).
        vocab_tail: extra token ids ``VOCAB_SIZE … VOCAB_SIZE + vocab_tail − 1`` that are never valid
            (a long-tail vocabulary: the policy must learn to give them no mass).

    Attributes:
        prompt_len: ``alphabet + 2``; max_answer_len: ``length``; vocab_size: ``VOCAB_SIZE + vocab_tail``.
    """

    def __init__(self, length: int = 64, alphabet: int = 4, vocab_tail: int = 0):
        if not isinstance(length, int) or length < 1:
            raise ValueError(f"WalkTask: length must be an integer >= 1, got {length!r}")
        if not 2 <= alphabet <= 9:
            raise ValueError(f"WalkTask: alphabet must be in 2..9, got {alphabet}")
        if vocab_tail < 0:
            raise ValueError(f"WalkTask: vocab_tail must be >= 0, got {vocab_tail}")
        self.length, self.alphabet = length, alphabet
        self.vocab_size = VOCAB_SIZE + vocab_tail
        self.prompt_len = alphabet + 2
        self.max_answer_len = length

    def sample(self, n: int, generator: torch.Generator) -> Problems:
        """``n`` random problems: allowed digits ``(n, alphabet)`` int64 (sorted) and prompts ``(n, prompt_len)``."""
        allowed = torch.rand(n, 10, generator=generator).argsort(1)[:, :self.alphabet].sort(1).values
        col = lambda v: torch.full((n, 1), v, dtype=torch.long)
        return Problems(allowed, torch.cat([col(BOS), allowed, col(EQUALS)], dim=1))

    def valid(self, responses: Tensor, allowed: Tensor) -> Tensor:
        """Per-token validity ``(n, T)`` bool of ``responses`` ``(n, T)`` int64 for ``allowed`` ``(n, alphabet)``."""
        ok = (responses.unsqueeze(2) == allowed.unsqueeze(1)).any(2)
        repeat = torch.zeros_like(ok)
        repeat[:, 1:] = responses[:, 1:] == responses[:, :-1]
        return ok & ~repeat

    def reward(self, responses: Tensor, allowed: Tensor) -> Tensor:
        """Partial-credit reward ``(n,)`` float32: the share of valid tokens among the first ``length``
        (missing positions count as invalid)."""
        r = responses[:, :self.length]
        return self.valid(r, allowed).float().sum(1) / self.length

    def answers(self, allowed: Tensor, generator: Optional[torch.Generator] = None) -> ReferenceAnswers:
        """Reference walks for the warm start: uniform over the allowed digits, never repeating one.

        Returns tokens ``(n, length)`` int64 and lengths ``(n,)`` (all ``length``).
        """
        n = allowed.shape[0]
        idx = torch.randint(0, self.alphabet, (n,), generator=generator)
        cols = [idx]
        for _ in range(self.length - 1):  # step to one of the other alphabet − 1 symbols
            idx = (idx + torch.randint(1, self.alphabet, (n,), generator=generator)) % self.alphabet
            cols.append(idx)
        return ReferenceAnswers(allowed.gather(1, torch.stack(cols, 1)),
                                torch.full((n,), self.length, dtype=torch.long))

    @staticmethod
    def render(tokens: Tensor) -> str:
        """Text form of a 1-D token tensor."""
        return AdditionTask.render(tokens)


#: The demo's tasks by name.
TASKS = {"addition": AdditionTask, "walk": WalkTask}
