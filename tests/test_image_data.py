"""Image data (issue 31, item 3): preprocessing against transformers' CLIP processor, records, the batch, the cache.

Tolerance of the preprocessing check. Resize and crop are the same Pillow calls on 8-bit pixels, so before the
normalisation both sides hold identical bytes (checked exactly). transformers then computes in float32:
``fl(fl(fl(x/255) - fl(m)) / fl(s))``; ours is the float64 value ``v = (x/255 - m)/s``. With u = 2**-24 and
first-order error terms: the rounding of x/255 (<= u·1), of m (<= u·max m) and of the difference (<= u·|x/255 - m|
<= u·1) carry through the division: <= u·(2 + max m)/min s; the rounding of s and of the quotient add <= 2u·|v|,
|v| <= V = max over channels of max(m, 1 - m)/s. ``CLIP_BOUND`` is that sum (second order ~u², covered by 1%).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from kuangchao_core.data import image_cache, images
from kuangchao_core.data.image_data import build_image_dataset
from kuangchao_core.data.images import CLIP_MEAN, CLIP_STD, decode_image, normalise
from kuangchao_core.data.loader import collate
from kuangchao_core.data.tokenizer import ByteTokenizer

U32 = 2.0**-24
_V = max(max(m, 1 - m) / s for m, s in zip(CLIP_MEAN, CLIP_STD, strict=True))
CLIP_BOUND = 1.01 * U32 * ((2 + max(CLIP_MEAN)) / min(CLIP_STD) + 2 * _V)
SIZE, PER_IMAGE, IMAGE_TOKEN = 32, 16, 255


def _processor(**kw):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}, **kw)


def _images(tmp_path) -> list:
    """Files in every family of mode the reader converts, odd sizes in both orientations, PNG and JPEG."""
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (61, 37, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (33, 33), dtype=np.uint8), "L")
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal.info["transparency"] = 3
    out = []
    for name, im in [("rgb.png", rgb), ("rgba.png", rgba), ("grey.png", grey), ("pal.png", pal), ("rgb.jpg", rgb)]:
        kw = {"transparency": 3} if name == "pal.png" else {}
        im.save(tmp_path / name, **kw)
        out.append(tmp_path / name)
    return out


def _ours(path, **kw) -> np.ndarray:
    return normalise(decode_image(path, SIZE, **kw), torch.float64).numpy()


def _theirs(path, **kw) -> np.ndarray:
    with Image.open(path) as im:
        return _processor(**kw)(im, return_tensors="np")["pixel_values"][0].astype(np.float64)


def test_clip_constants_are_transformers():
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    assert tuple(OPENAI_CLIP_MEAN) == CLIP_MEAN and tuple(OPENAI_CLIP_STD) == CLIP_STD


def test_preprocessing_equals_clip_processor(tmp_path):
    for path in _images(tmp_path):
        raw = _theirs(path, do_rescale=False, do_normalize=False)
        assert np.array_equal(decode_image(path, SIZE).transpose(2, 0, 1).astype(np.float64), raw), path.name
        err = np.abs(_ours(path) - _theirs(path)).max()
        assert err <= CLIP_BOUND, (path.name, err, CLIP_BOUND)


def test_preprocessing_negative_controls(tmp_path, monkeypatch):
    """Bilinear instead of bicubic, and RGBA converted without compositing onto white, each break the check."""
    rgb, rgba = _images(tmp_path)[:2]
    assert np.abs(_ours(rgb, resample="bilinear") - _theirs(rgb)).max() > 100 * CLIP_BOUND
    monkeypatch.setattr(images, "_to_rgb", lambda im: im.convert("RGB"))
    assert np.abs(_ours(rgba) - _theirs(rgba)).max() > 100 * CLIP_BOUND


def _record(image: str, question: str = "<image>\nWhat colour?", answer: str = "red") -> dict:
    return {"image": image, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


def _write(tmp_path, records) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _build(path, **kw):
    return build_image_dataset(path, ByteTokenizer(), IMAGE_TOKEN, PER_IMAGE, SIZE, 96, **kw)


def test_placeholders_expanded_and_labels_masked(tmp_path):
    files = _images(tmp_path)
    path = _write(tmp_path, [_record(files[0].name), {"image": files[1].name, "caption": "noise"}])
    ds = _build(path, dtype=torch.float64)
    tok = ByteTokenizer()
    for row, answer in ((0, "red\n"), (1, "noise\n")):
        item = ds[row]
        ids, labels = item["input_ids"], item["labels"]
        holes = (ids == IMAGE_TOKEN).nonzero().flatten()
        assert len(holes) == PER_IMAGE and bool((holes.diff() == 1).all())  # one run of placeholders
        assert bool((labels[holes - 1] == -100).all()), "a label is taken on a placeholder"
        trained = labels[labels != -100].tolist()
        assert trained == tok.encode(answer), (row, trained)  # only the answer (and its end) is trained
        assert item["pixel_values"].shape == (1, 3, SIZE, SIZE)
    assert torch.equal(ds[0]["pixel_values"][0], normalise(decode_image(files[0], SIZE), torch.float64)[None][0])
    prompt, answer, pixels = ds.question(1)
    assert (
        tok.decode(prompt).endswith("\n") and prompt.count(IMAGE_TOKEN) == PER_IMAGE and tok.decode(answer) == "noise\n"
    )
    assert torch.equal(pixels, ds[1]["pixel_values"])


def test_batch_images_follow_row_order(tmp_path):
    """``collate`` concatenates the rows' images in row order (the order the placeholders are filled in)."""
    files = _images(tmp_path)
    ds = _build(_write(tmp_path, [_record(f.name) for f in files[:3]]))
    a, b = collate(ds, [0, 2, 1]), [ds[i]["pixel_values"] for i in (0, 2, 1)]
    assert a["pixel_values"].shape == (3, 3, SIZE, SIZE) and a["input_ids"].shape == (3, 96)
    assert torch.equal(a["pixel_values"], torch.cat(b))
    assert not torch.equal(a["pixel_values"], collate(ds, [0, 1, 2])["pixel_values"])  # control: order matters


def test_decode_cache_by_content(tmp_path):
    files = _images(tmp_path)
    path, cache = _write(tmp_path, [_record(f.name) for f in files]), tmp_path / "cache"
    cold = _build(path, cache_dir=cache)
    assert (cold.report.cache_hits, cold.report.cache_misses) == (0, len(files))
    warm = _build(path, cache_dir=cache)
    assert (warm.report.cache_hits, warm.report.cache_misses) == (len(files), 0)
    assert np.array_equal(warm.pixels, cold.pixels) and np.array_equal(warm.pixels, _build(path).pixels)
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(files[0])  # edited content: a new entry
    edited = _build(path, cache_dir=cache)
    assert (edited.report.cache_hits, edited.report.cache_misses) == (len(files) - 1, 1)
    assert not np.array_equal(edited.pixels, cold.pixels)  # control: the edit is seen, not served stale
    entry = next(cache.rglob("*.u8"))
    entry.write_bytes(b"short")  # a damaged entry is rebuilt, not read
    assert image_cache.ImageCache(cache, SIZE).load(files[1]).shape == (SIZE, SIZE, 3)


def test_jpeg_bytes_in_memory_decode_like_file(tmp_path):
    """A JPEG goes through the same path (Pillow's JPEG decoder, YCbCr -> RGB)."""
    buf = io.BytesIO()
    Image.fromarray(np.full((20, 30, 3), 200, np.uint8)).save(buf, "JPEG")
    (tmp_path / "x.jpeg").write_bytes(buf.getvalue())
    assert decode_image(tmp_path / "x.jpeg", SIZE).shape == (SIZE, SIZE, 3)


def test_data_images_config(tmp_path):
    """``data.images`` is validated with field paths, said as unused in a text-only job (used with ``model.vision``), read by
    :func:`gate_settings` (a pixel limit from the config refuses an image)."""
    from kuangchao_core.config import ConfigError, config_from_dict
    from kuangchao_core.config.unused import unused_settings
    from kuangchao_core.data.image_data import gate_settings
    from kuangchao_core.errors import DataError

    base = {"task": {"name": "t"}}
    with pytest.raises(ConfigError) as info:
        config_from_dict({**base, "data": {"images": {"max_pixels": 0, "decode_worker": 2}}})
    assert {p for p, _ in info.value.errors} == {"data.images.max_pixels", "data.images.decode_worker"}
    cfg = config_from_dict({**base, "data": {"images": {"max_pixels": 1000, "decode_workers": 0}}})
    assert "data.images" in dict(unused_settings(cfg))  # a text-only job reads no images
    with_vision = config_from_dict({**base, "model": {"vision": {}}, "data": {"images": {"max_pixels": 1000}}})
    assert "data.images" not in dict(unused_settings(with_vision))
    assert "data.images" not in dict(unused_settings(config_from_dict(base)))  # control: defaults say nothing
    assert gate_settings(cfg.data) == {"max_pixels": 1000, "max_aspect_ratio": 20.0, "workers": 0, "cache_dir": None}
    path = _write(tmp_path, [_record(_images(tmp_path)[0].name)])  # 70 x 45 = 3150 pixels
    with pytest.raises(DataError, match="data.jsonl:1: .*3150 pixels, above the limit 1000"):
        _build(path, **gate_settings(cfg.data))
    assert len(_build(path, **gate_settings(config_from_dict(base).data))) == 1


def test_batches_read_back_from_the_cache_equal_in_memory(tmp_path):
    """``keep_pixels=False``: each batch's images come from the cache on the pool, equal to the in-memory batch for
    every pool size; an image spoiled after the gate is refused when its batch is read."""
    from kuangchao_core.errors import DataError

    files = _images(tmp_path)
    path = _write(tmp_path, [_record(f.name) for f in files])
    rows = [4, 0, 2, 3]
    want = collate(_build(path), rows)
    for workers in (0, 1, 3):
        lazy = _build(path, cache_dir=tmp_path / "c", keep_pixels=False, workers=workers)
        assert len(lazy.pixels) == len(files) and not isinstance(lazy.pixels, np.ndarray)
        got = collate(lazy, rows)
        assert all(torch.equal(got[k], want[k]) for k in want), workers
    with pytest.raises(DataError, match="set data.cache_dir"):
        _build(path, keep_pixels=False)
    blob = files[0].read_bytes()
    files[0].write_bytes(blob[: len(blob) // 2])  # spoiled after the gate: a new content, not in the cache
    with pytest.raises(DataError, match="no longer passes the data gate"):
        collate(lazy, [0])


def test_batch_feeds_the_vision_language_model(tmp_path):
    """A collated batch of the generated set runs through the LLaVA model: its placeholders pair up with the images'
    features (``merge_image_features`` checks the count), the loss is finite and reaches the vision tower; the
    controls drop an image (the merge refuses) and swap two rows' images (the answers' logits change)."""
    from kuangchao_core.config.vision_schema import VisionSection
    from kuangchao_core.data.image_data import placeholder_settings
    from kuangchao_core.data.shapes import make_shape_set
    from kuangchao_core.models.vision import vision_config
    from kuangchao_core.models.vlm import VisionLanguageModel
    from tests.fixtures import tiny_llama

    torch.manual_seed(0)
    cfg = tiny_llama()
    vcfg = vision_config(None, cfg.vocab_size)
    model = VisionLanguageModel(cfg, vcfg).double()
    make_shape_set(tmp_path, num_train=4, num_heldout=0, seed=1, size=vcfg.image_size)
    settings = placeholder_settings(VisionSection(), cfg.vocab_size)
    assert settings == placeholder_settings(vcfg, cfg.vocab_size)  # the section and the model's config agree
    ds = build_image_dataset(tmp_path / "train.jsonl", ByteTokenizer(), seq_len=96, dtype=torch.float64, **settings)
    batch = collate(ds, [0, 5, 10])  # three images: rows 0, 5 and 10 are about images 0, 1 and 2
    logits = model(batch["input_ids"], batch["pixel_values"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    loss.backward()
    assert torch.isfinite(loss) and model.vision_tower.embeddings.patch_embedding.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="placeholder"):
        model(batch["input_ids"], batch["pixel_values"][:2])
    swapped = model(batch["input_ids"], batch["pixel_values"][[1, 0, 2]])
    answer = batch["labels"] != -100
    assert not torch.allclose(swapped[answer][:2], logits[answer][:2])


def test_parquet_records_resolve_beside_their_file(tmp_path):
    """Records in a parquet file (as sft data may be) find their images beside the file too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = _images(tmp_path)
    pq.write_table(
        pa.Table.from_pylist([_record(files[0].name), _record(files[1].name, answer="x")]), tmp_path / "d.parquet"
    )
    ds = _build(tmp_path / "d.parquet")
    assert len(ds) == 2 and ds.examples[1].where.endswith("d.parquet#row1")
