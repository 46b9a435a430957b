"""Image-text records (issue 31): LLaVA's conversation form or image + caption, tokenized with placeholders expanded.

A record is one JSON-lines object, either

- ``{"image": "dir/a.png", "conversations": [{"from": "human", "value": "<image>\\nWhat colour?"},
  {"from": "gpt", "value": "red"}, ...]}`` (LLaVA's form; ``from`` is ``human``/``gpt``/``system``), or
- ``{"image": "dir/a.png", "caption": "a red square"}`` (read as the prompt ``<image>\\n`` and the caption as its
  answer).

``image`` is one path or a list of paths, relative to the data directory (the directory of the JSON-lines file
unless ``image_root`` is given). A conversation holds exactly one ``<image>`` per image, in human or system turns,
never in the answers. The conversation becomes chat messages (human -> user, gpt -> assistant) rendered by
:func:`kuangchao_core.data.sft.chat_spans` as SFT data is; each span is split at ``<image>`` and every ``<image>``
becomes ``tokens_per_image`` copies of ``image_token_id``, never trained (the label there is -100). A caption is
trained with the end token after it, as an SFT completion is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuangchao_core.data.sft import chat_spans
from kuangchao_core.errors import DataError

PLACEHOLDER = "<image>"
ROLE_OF = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass
class ImageExample:
    """Token ids, whether the loss is taken on each, and the resolved image files in placeholder order."""

    ids: list[int]
    trained: list[bool]
    images: list[Path]
    where: str


def resolve_image(root: Path, rel: Any, where: str) -> Path:
    """``rel`` resolved under ``root``; a path that is absolute, or that leaves ``root`` once ``..`` and symlinks are
    resolved, is refused (``DataError`` naming the record); so is a missing file."""
    if not isinstance(rel, str) or not rel:
        raise DataError(f"{where}: 'image' must be a non-empty path string, got {rel!r}"[:300])
    if os.path.isabs(rel):
        raise DataError(f"{where}: image path {rel!r} is absolute; give it relative to the data directory {root}")
    try:
        base, target = root.resolve(), (root / rel).resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop (3.11: RuntimeError), too long
        raise DataError(f"{where}: image path {rel!r} cannot be resolved: {exc}"[:300]) from None
    if not target.is_relative_to(base):
        raise DataError(f"{where}: image path {rel!r} resolves to {target}, outside the data directory {base}")
    if not target.is_file():
        raise DataError(f"{where}: image {rel!r} does not exist (looked for {target})")
    return target


def image_paths(record: dict[str, Any], root: Path, where: str) -> list[Path]:
    """The record's images, resolved and checked by :func:`resolve_image`."""
    images = record.get("image")
    if images is None:
        raise DataError(f"{where}: an image record needs 'image' (a path or a list of paths)")
    images = images if isinstance(images, list) else [images]
    if not images:
        raise DataError(f"{where}: 'image' is an empty list")
    return [resolve_image(root, rel, where) for rel in images]


def record_messages(record: dict[str, Any], n_images: int, where: str) -> list[dict[str, str]] | None:
    """The conversation as chat messages (``None`` for a caption record); checks the placeholders pair up with the
    images and that no answer holds one."""
    conv = record.get("conversations")
    if conv is None:
        if not isinstance(record.get("caption"), str):
            raise DataError(f"{where}: an image record needs 'conversations' or a string 'caption'")
        if n_images != 1:
            raise DataError(f"{where}: a caption record takes one image, got {n_images}")
        return None
    if not isinstance(conv, list) or not conv:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    msgs, count = [], 0
    for i, turn in enumerate(conv):
        if not isinstance(turn, dict) or turn.get("from") not in ROLE_OF or not isinstance(turn.get("value"), str):
            raise DataError(
                f"{where}: conversations[{i}] must be {{'from': one of {list(ROLE_OF)}, 'value': a string}}"[:300]
            )
        role, n = ROLE_OF[turn["from"]], turn["value"].count(PLACEHOLDER)
        if n and role == "assistant":
            raise DataError(f"{where}: conversations[{i}] is an answer holding {PLACEHOLDER}; images go in questions")
        count += n
        msgs.append({"role": role, "content": turn["value"]})
    if count != n_images:
        raise DataError(f"{where}: {count} {PLACEHOLDER} placeholders for {n_images} images; they must pair up")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no gpt turn: nothing to train on")
    return msgs


def image_record_text(record: dict[str, Any], where: str) -> str:
    """An image record's text for the job's data check (``data.validation``): its image paths, one a line (the same
    question about another image is another record), then the turns' contents or the caption, placeholders as text.
    Raises ``DataError`` for a record whose form the gate refuses; its files are the gate's, in every rank."""
    images = record.get("image")
    images = images if isinstance(images, list) else [images]
    if not images or not all(isinstance(p, str) and p for p in images):
        raise DataError(f"{where}: an image record needs 'image': a path or a non-empty list of paths")
    msgs = record_messages(record, len(images), where)
    return "\n".join([*images, *([record["caption"]] if msgs is None else [m["content"] for m in msgs])])


def _encode(text: str, tokenizer: Any, image_token_id: int, where: str) -> list[int]:
    ids = tokenizer.encode(text)
    if image_token_id in ids:
        raise DataError(
            f"{where}: the text encodes to the image placeholder id {image_token_id}; it would be read as an image"
        )
    return ids


def encode_image_record(
    record: dict[str, Any], where: str, root: Path, tokenizer: Any, image_token_id: int, per_image: int
) -> ImageExample:
    """One record as an :class:`ImageExample` (see the module docstring)."""
    paths = image_paths(record, root, where)
    msgs = record_messages(record, len(paths), where)
    if msgs is None:
        spans = [(PLACEHOLDER + "\n", False), (record["caption"], True)]
    else:
        spans = chat_spans(msgs, tokenizer)
    ids: list[int] = []
    trained: list[bool] = []
    for text, on in spans:
        for k, piece in enumerate(text.split(PLACEHOLDER)):
            if k:
                ids += [image_token_id] * per_image
                trained += [False] * per_image
            t = _encode(piece, tokenizer, image_token_id, where) if piece else []
            ids += t
            trained += [on] * len(t)
    if msgs is None:
        ids.append(int(tokenizer.sep_id))
        trained.append(True)
    return ImageExample(ids, trained, paths, where)
