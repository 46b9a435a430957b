"""Greedy answers to fixed held-out prompts at each evaluation: exact-match accuracy where the data has answers,
and a few generations as text (an MLflow artifact per evaluation).

The prompts come from the job's held-out data (:func:`sample_cases`): the synthetic corpus' held-out problems
(``<sep>a+b=`` → the sum and the separator; without the leading separator when packed as documents), sft records (synthetic instructions included) (the tokens before the first trained token → the first
trained span: the completion and its end token, or the first assistant turn), or text (the first tokens of each
held-out window, no answer). Every rank runs the same greedy loop on the same prompts (TP ranks gather the
vocabulary-split logits; ZeRO-3 ranks gather their blocks together), so the collectives line up and every rank
gets the same answers. Under pipeline parallelism each decoding step runs the virtual stages in order (activations
sent stage to stage, as the held-out loss does) and the last stage's choice of the next tokens is broadcast to every
stage.

What is sampled is ``train.samples`` (resolved by :func:`~kuangchao_core.config.settings.eval_settings`): ``count``
prompts (256 where the data has answers, none for plain text), ``max_new_tokens`` each (the longest answer; 48 for
text). Where the layout allows (:func:`~kuangchao_core.models.kv_cache.can_cache`: one process, DP, TP, CP, without
ZeRO-3 or sequence parallelism) the decoding keeps a key/value cache (:class:`~kuangchao_core.models.kv_cache.
KVCacheDecoder`): one forward of the prompt, then one token per forward; a pipeline, ZeRO-3 and sequence parallelism
decode without it, the whole sequence per new token, as before.

Rendering the answers as text never ends a job: the tokenizer shows an id outside its vocabulary as ``<unk:ID>``
(a model vocabulary padded beyond the tokenizer's), and should decoding fail all the same, the sample's text says it
could not be rendered and a warning names the ids and the error. Exact match is computed on the ids.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.config.train_schema import ANSWER_CASES, TEXT_NEW_TOKENS, TEXT_PROMPT_TOKENS
from kuangchao_core.errors import ConfigError
from kuangchao_core.models.kv_cache import KVCacheDecoder, can_cache
from kuangchao_core.models.ring_attention import use_attention

log = logging.getLogger("kuangchao.engine.samples")

#: held-out prompts answered at each evaluation by default where the data has answers (``train.samples.count``),
#: and how many of them are shown as text; the text defaults (prompt and new tokens) are the config's
SAMPLE_CASES = ANSWER_CASES
SHOWN = 4


@dataclass(frozen=True)
class Case:
    """One held-out prompt and, where the data has it, the expected continuation (ending with the stop token)."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...] | None


@torch.no_grad()
def greedy_decode(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    max_new: int,
    stop_id: int,
    device: Any = "cpu",
    next_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    decoder: KVCacheDecoder | None = None,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (batched by prompt length), each up to ``max_new`` tokens and ending at
    the first ``stop_id`` (included). ``logits_fn(ids) -> (batch, seq, vocab)`` full-vocabulary logits; or
    ``next_fn(ids) -> (batch,)`` the next tokens themselves (pipeline stages); or ``decoder``, a key/value cache
    decoder (``prefill(ids)`` then ``step(tokens)``, each returning the next tokens)."""
    if next_fn is None and decoder is None:
        next_fn = lambda ids: logits_fn(ids)[:, -1, :].argmax(-1)  # noqa: E731
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for length in sorted(by_len):
        idx = by_len[length]
        ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long, device=device)
        done = [False] * len(idx)
        nxt = ids[:, -1]
        for k in range(max_new):
            if decoder is not None:
                nxt = decoder.prefill(ids) if k == 0 else decoder.step(nxt)
            else:
                nxt = next_fn(ids)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    out[idx[j]].append(int(t))
                    done[j] = t == stop_id
            if all(done):
                break
            if decoder is None:  # the cache holds what came before
                ids = torch.cat([ids, nxt[:, None]], dim=1)
    return out


def exact_match(outputs: Sequence[Sequence[int]], cases: Sequence[Case]) -> float | None:
    """Share of the cases with an answer whose output is exactly it (None when no case has one)."""
    scored = [(list(o), list(c.answer)) for o, c in zip(outputs, cases, strict=True) if c.answer is not None]
    if not scored:
        return None
    return sum(o == a for o, a in scored) / len(scored)


def _sft_case(ids: Sequence[int], trained: Sequence[bool]) -> Case | None:
    first = next((i for i, t in enumerate(trained) if t), None)
    if first is None or first == 0:
        return None
    end = first
    while end < len(trained) and trained[end]:
        end += 1
    return Case(tuple(int(t) for t in ids[:first]), tuple(int(t) for t in ids[first:end]))


def sample_cases(dataset: Any, n: int = SAMPLE_CASES) -> list[Case]:
    """Up to ``n`` held-out cases of an evaluation ``dataset`` (see the module docstring)."""
    corpus = getattr(dataset, "corpus", None)
    tok = dataset.tokenizer
    if corpus is not None and hasattr(corpus, "heldout_pairs"):
        sep = int(tok.sep_id)
        # packed end to end, a problem follows the previous one's separator; packed as documents it starts afresh
        lead = [] if getattr(dataset, "starts", None) is not None else [sep]
        return [
            Case(tuple([*lead, *tok.encode(corpus.prompt(a, b))]), tuple([*tok.encode(corpus.answer(a, b)), sep]))
            for a, b in corpus.heldout_pairs[:n]
        ]
    examples = getattr(dataset, "examples", None)
    if examples is not None:  # sft records
        cases = [c for c in (_sft_case(ex.ids, ex.trained) for ex in examples) if c is not None]
        return cases[:n]
    cases = []
    for i in range(min(n, len(dataset))):
        ids = dataset[i]["input_ids"][:TEXT_PROMPT_TOKENS]
        cases.append(Case(tuple(int(t) for t in ids), None))
    return cases


class SampleEvaluator:
    """Answers the held-out cases greedily; ``__call__() -> (exact_match or None, text of the first answers)``.
    Collective: call it on every rank.

    Under context parallelism (``cp_attention``: the attention the model trains with) every CP rank decodes the
    whole prompts itself with plain attention (the parameters are the same on every CP rank, so the answers are
    too): a prompt of any length, no sharding, at the cost of the CP ranks repeating the same decoding."""

    cp_attention: Callable | None = None

    def __init__(
        self,
        logits_fn: Callable | None,
        model: torch.nn.Module,
        cases: list[Case],
        tokenizer: Any,
        device: Any,
        next_fn: Callable | None = None,
        max_new: int | None = None,
        decoder: KVCacheDecoder | None = None,
    ):
        self.logits_fn = logits_fn
        self.next_fn = next_fn
        self.decoder = decoder  # a key/value cache decoder where the layout allows one
        self.model = model
        self.cases = cases
        self.tokenizer = tokenizer
        self.device = device
        self.max_new = new_tokens(cases, max_new)

    def __call__(self) -> tuple[float | None, str]:
        was_training = self.model.training
        self.model.eval()
        if self.cp_attention is not None:
            use_attention(self.model, None)
        try:
            prompts = [c.prompt for c in self.cases]
            stop = int(self.tokenizer.sep_id)
            outputs = greedy_decode(
                self.logits_fn, prompts, self.max_new, stop, self.device, self.next_fn, self.decoder
            )
        finally:
            self.model.train(was_training)
            if self.cp_attention is not None:
                use_attention(self.model, self.cp_attention)
        return exact_match(outputs, self.cases), self.render(outputs)

    def render(self, outputs: Sequence[Sequence[int]]) -> str:
        """The first :data:`SHOWN` prompts with their greedy output (and the expected answer where known); a text the
        tokenizer cannot decode is shown as not rendered (with a warning), never raised."""
        dec = self._text
        lines = []
        for i, (case, out) in enumerate(zip(self.cases[:SHOWN], outputs, strict=False)):
            lines.append(f"[{i + 1}] prompt:   {dec(list(case.prompt))}")
            lines.append(f"    output:   {dec(list(out))}")
            if case.answer is not None:
                mark = "exact" if list(out) == list(case.answer) else "wrong"
                lines.append(f"    expected: {dec(list(case.answer))} ({mark})")
        return "\n".join(lines) + "\n"

    def _text(self, ids: list[int]) -> str:
        """``repr`` of the decoded ``ids``, or a note that they could not be rendered (logged as a warning)."""
        try:
            return repr(self.tokenizer.decode(ids))
        except Exception as exc:  # a tokenizer's own failure: the sample is lost, never the job
            log.warning("greedy sample: cannot render ids %s as text: %s: %s", ids, type(exc).__name__, exc)
            return f"<could not be rendered: ids {ids} ({type(exc).__name__}: {exc})>"


def new_tokens(cases: Sequence[Case], max_new: int | None = None) -> int:
    """Tokens generated per prompt: ``max_new`` (``train.samples.max_new_tokens``), else the longest answer of the
    ``cases``, else :data:`TEXT_NEW_TOKENS` (text)."""
    answers = [len(c.answer) for c in cases if c.answer is not None]
    return int(max_new) if max_new else (max(answers) if answers else TEXT_NEW_TOKENS)


def fitting_cases(cases: list[Case], max_len: int | None, max_new: int | None = None) -> list[Case]:
    """The cases whose prompt and greedy continuation (but its last token) fit in ``max_len`` positions (the model's
    ``max_seq_len``; None: all), ``max_new`` as :func:`new_tokens`. Raises :class:`ConfigError` naming
    ``model.max_seq_len`` when none fits: the evaluation would fail at its first sample, after the steps before it,
    in every attempt (the config's validation refuses it earlier where the config tells, ``config.checks``)."""
    new = new_tokens(cases, max_new)
    fit = [c for c in cases if not max_len or len(c.prompt) + new - 1 <= max_len]  # the last token is never fed
    if cases and not fit:
        need = min(len(c.prompt) for c in cases) + new - 1
        raise ConfigError(
            [
                (
                    "model.max_seq_len",
                    f"{max_len} positions cannot hold an evaluation's greedy sample (a prompt of {need + 1 - new} and "
                    f"{new} new tokens, the last never fed back): raise model.max_seq_len to at least {need}",
                )
            ]
        )
    if len(fit) < len(cases):
        log.warning(
            "greedy samples: %d of %d held-out prompts are too long for model.max_seq_len %d and are left out",
            len(cases) - len(fit),
            len(cases),
            max_len,
        )
    return fit


def sample_evaluator_for(
    parts: Any,
    mesh: Any,
    dataset: Any,
    device: Any,
    max_len: int | None = None,
    count: int = SAMPLE_CASES,
    max_new: int | None = None,
    zero_stage: int = 0,
) -> tuple[SampleEvaluator | None, str]:
    """The sample evaluator of this job's model part (``count`` prompts, ``max_new`` tokens each as
    :func:`new_tokens`), or None with the reason. ``max_len``: the model's ``max_seq_len`` (see
    :func:`fitting_cases`); ``zero_stage``: the job's (ZeRO-3 decodes without the key/value cache)."""
    if count < 1:
        return None, "train.samples.count is 0 (the default for plain text: it has no answers to score)"
    cases = fitting_cases(sample_cases(dataset, count), max_len, max_new)
    if not cases:
        return None, "the held-out data has no prompts"
    model = parts.model
    gather = getattr(model, "gather_logits", None)
    head = gather if gather is not None and mesh.tp > 1 else (lambda logits: logits)
    logits_fn = (lambda ids: gather(model(ids))) if gather is not None and mesh.tp > 1 else model
    tok = dataset.tokenizer
    if parts.executor is not None:
        next_fn = PipelinedNextTokens(parts.executor, head)
        out = SampleEvaluator(None, model, cases, tok, device, next_fn, max_new)
    else:
        cached = can_cache(model, False, zero_stage)
        decoder = KVCacheDecoder(model, head) if cached else None
        out = SampleEvaluator(logits_fn, model, cases, tok, device, max_new=max_new, decoder=decoder)
    out.cp_attention = getattr(parts, "cp_attention", None)
    return out, ""


class PipelinedNextTokens:
    """``(ids) -> next tokens`` through the pipeline: the virtual stages in order, each on its rank, activations sent
    to the next stage's rank; the last stage picks the greedy tokens from its (TP-gathered, by ``head``) logits and
    broadcasts them over the pipeline group, so every stage continues the same sequences. Collective over PP."""

    def __init__(self, executor: Any, head: Callable[[torch.Tensor], torch.Tensor]):
        self.executor = executor
        self.head = head

    def __call__(self, ids: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The next tokens of ``ids``; ``inputs``: the chunks' keyword inputs (a vision-language model's images)."""
        from kuangchao_core.comm import primitives as P

        ex = self.executor
        y = ex.forward_only(ids, inputs)
        if y is not None:
            nxt = self.head(y)[:, -1, :].argmax(-1)
        else:
            nxt = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
        P.broadcast(nxt, src=ex.group.ranks[(ex.num_stages - 1) % ex.p], group=ex.group)
        return nxt
