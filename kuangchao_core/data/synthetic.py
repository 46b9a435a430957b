"""A corpus the project generates itself: addition problems ``"a+b=c"`` (task ``arithmetic``) or subtraction
problems ``"a-b=c"`` (task ``subtraction``, negative answers included) with ``0 <= a, b < max_operand``.

As text (the default) every problem is one document; as instructions (``data.synthetic.instructions``) every problem
is a prompt/completion record (``"a-b="`` → ``"c"``) trained on its answer only, as ``data.format: sft`` records are.

Every (a, b) pair is a problem. A seeded permutation of all pairs puts the first ``num_eval`` aside as the held-out
set; training lines are drawn uniformly, with replacement, from the remaining pool, so the two are disjoint. Packed
with the separator (a newline for the byte tokenizer) the stream reads ``"a+b=c\\n"`` line after line.

Known loss floor: a line is a one-to-one function of its (a, b) pair, and lines are independent and uniform over
the pool, so the stream carries exactly ``ln(pool size)`` nats per line, whatever the tokenization. The entropy
rate is therefore ``ln(pool size) / E[tokens per line incl. separator]`` nats per token (about 1.0 for the byte
tokenizer): the operand digits are random, the ``=``, answer and separator tokens are fully determined. A model
that sees each line from its start can reach this floor; windows that cut a line lose its start, so the exact
optimum for packed windows is slightly above it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.errors import DataError

#: task name -> (operator, how a problem is asked: a format of a, b and op, up to where the answer starts)
TASKS = {
    "arithmetic": ("+", "{a}{op}{b}="),
    "addition": ("+", "{a}{op}{b}="),
    "subtraction": ("-", "{a}{op}{b}="),
    "addition-question": ("+", "What is {a} plus {b}? "),
}


class ArithmeticCorpus:
    """Deterministic addition corpus from ``seed``; see the module docstring."""

    def __init__(
        self,
        num_train: int,
        num_eval: int,
        seed: int,
        max_operand: int = 100,
        tokenizer=None,
        op: str = "+",
        question: str = "{a}{op}{b}=",
    ):
        if op not in ("+", "-"):
            raise DataError(f"synthetic operator must be + or -, got {op!r}")
        self.op = op
        self.question = question
        pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
        total = len(pairs)
        if num_train < 1:
            raise DataError(f"data.synthetic.num_train must be >= 1, got {num_train}")
        if not 0 <= num_eval < total:
            raise DataError(
                f"data.synthetic.num_eval must be in [0, {total}) for operands below {max_operand}, got {num_eval}"
            )
        self.num_train = int(num_train)
        self.num_eval = int(num_eval)
        self.seed = int(seed)
        self.max_operand = int(max_operand)
        self.tokenizer = tokenizer or ByteTokenizer()
        order = np.random.default_rng([self.seed, 0]).permutation(total)
        self.heldout_pairs = [pairs[int(i)] for i in order[:num_eval]]
        self.pool_pairs = [pairs[int(i)] for i in order[num_eval:]]
        draws = np.random.default_rng([self.seed, 1]).integers(0, len(self.pool_pairs), size=num_train)
        self.train_pairs = [self.pool_pairs[int(i)] for i in draws]

    def answer(self, a: int, b: int) -> str:
        """The answer of problem (a, b)."""
        return str(a + b if self.op == "+" else a - b)

    def prompt(self, a: int, b: int) -> str:
        """The question of problem (a, b), up to where its answer starts."""
        return self.question.format(a=a, b=b, op=self.op)

    def line(self, a: int, b: int) -> str:
        """The document for one problem."""
        return self.prompt(a, b) + self.answer(a, b)

    def records(self, split: str = "train") -> list[dict[str, str]]:
        """The problems of ``split`` as prompt/completion records (instruction style)."""
        pairs = self._pairs(split)
        return [{"prompt": self.prompt(a, b), "completion": self.answer(a, b)} for a, b in pairs]

    def _pairs(self, split: str) -> list[tuple[int, int]]:
        if split == "train":
            return self.train_pairs
        if split == "eval":
            return self.heldout_pairs
        raise DataError(f"unknown split {split!r}; use 'train' or 'eval'")

    def documents(self, split: str = "train") -> list[str]:
        """The documents of ``split`` (``train`` or ``eval``) in stream order."""
        return [self.line(a, b) for a, b in self._pairs(split)]

    def loss_floor(self, documents: bool = False) -> float:
        """Entropy rate of the training stream in nats per counted label (separators included): the pair's entropy
        over the tokens of its line. With ``documents`` packing no label predicts a document's first token (it is
        an input only), so the floor is the pair's entropy given that token over the remaining tokens."""
        tok = self.tokenizer
        lines = [tok.encode(self.line(a, b)) for a, b in self.pool_pairs]
        mean_len = sum(len(t) + 1 for t in lines) / len(lines)
        if not documents:
            return math.log(len(self.pool_pairs)) / mean_len
        firsts: dict[int, int] = {}
        for t in lines:
            firsts[t[0]] = firsts.get(t[0], 0) + 1
        n = len(lines)
        first_entropy = -sum(c / n * math.log(c / n) for c in firsts.values())
        return (math.log(n) - first_entropy) / (mean_len - 1)

    @torch.no_grad()
    def heldout_accuracy(self, model, n: int | None = None, device: str | torch.device = "cpu") -> float:
        """Share of the first ``n`` held-out problems whose answer ``model`` decodes greedily and exactly.

        The prompt is ``<sep>a+b=``; decoding stops at the separator or after as many tokens as the longest answer
        of these problems plus one. ``model(input_ids) -> logits`` (batch, seq, vocab).
        """
        pairs = self.heldout_pairs[: (len(self.heldout_pairs) if n is None else n)]
        if not pairs:
            raise DataError("no held-out problems: set data.synthetic.num_eval >= 1")
        tok = self.tokenizer
        was_training = getattr(model, "training", False)
        if hasattr(model, "eval"):
            model.eval()
        max_new = max(len(tok.encode(self.answer(a, b))) for a, b in pairs) + 1
        by_len: dict[int, list[tuple[list[int], str]]] = {}
        for a, b in pairs:
            prompt = [tok.sep_id] + tok.encode(self.prompt(a, b))
            by_len.setdefault(len(prompt), []).append((prompt, self.answer(a, b)))
        correct = 0
        try:
            for group in by_len.values():
                ids = torch.tensor([p for p, _ in group], dtype=torch.long, device=device)
                done = torch.zeros(len(group), dtype=torch.bool, device=device)
                out: list[list[int]] = [[] for _ in group]
                for _ in range(max_new):
                    nxt = model(ids)[:, -1, :].argmax(-1)
                    for i, t in enumerate(nxt.tolist()):
                        if not done[i]:
                            if t == tok.sep_id:
                                done[i] = True
                            else:
                                out[i].append(t)
                    if bool(done.all()):
                        break
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                for i, (_, answer) in enumerate(group):
                    correct += int(bool(done[i]) and tok.decode(out[i]) == answer)
        finally:
            if was_training:
                model.train()
        return correct / len(pairs)


def make_corpus(task: str, num_train: int, num_eval: int, seed: int, tokenizer=None) -> ArithmeticCorpus:
    """The synthetic corpus named ``task`` (:data:`TASKS`: ``arithmetic`` (alias ``addition``), ``subtraction``,
    ``addition-question``: the sums asked in words, ``What is a plus b?``)."""
    if task not in TASKS:
        raise DataError(f"data.synthetic.task: unknown task {task!r}; choose one of {list(TASKS)}")
    op, question = TASKS[task]
    return ArithmeticCorpus(num_train, num_eval, seed, tokenizer=tokenizer, op=op, question=question)
