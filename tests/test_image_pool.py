"""The decode pool and the data-wait timer (issue 31, item 3).

Order: items finish out of order on purpose (later items sleep less), yet the results come back in the items'
order for every pool size, equal to the one-thread run; the control shows the finishing order really was
scrambled, so the ordering is the pool's doing. Bound: never more than ``depth`` items in flight. Wait: a loader
whose batches take ``SLOW`` seconds to prepare, behind a step of ``STEP`` seconds: with prefetch the step finds its
batch ready (waits well under ``SLOW``), without prefetch (the control, depth 0) it waits at least ``SLOW``.
"""

from __future__ import annotations

import threading
import time

import pytest

from kuangchao_core.data.image_data import build_image_dataset
from kuangchao_core.data.image_pool import DataWait, ordered_map
from kuangchao_core.data.loader import PrefetchLoader
from kuangchao_core.data.sampler import ResumableBatchSampler
from kuangchao_core.data.shapes import make_shape_set
from kuangchao_core.data.tokenizer import ByteTokenizer

SLOW, STEP = 0.03, 0.08


def test_ordered_whatever_the_pool_size_and_bounded():
    finished, live, peak, lock = [], [0], [0], threading.Lock()

    def work(i: int) -> int:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.001 * (12 - i % 12))
        with lock:
            live[0] -= 1
            finished.append(i)
        if i == 7:
            raise ValueError("bad item 7")
        return i * i

    reference = list(ordered_map(work, range(24), workers=0))
    assert [v for v, _ in reference] == [i * i if i != 7 else None for i in range(24)]
    assert isinstance(reference[7][1], ValueError) and all(e is None for i, (_, e) in enumerate(reference) if i != 7)
    for workers in (1, 3, 6):
        finished.clear()
        peak[0] = 0
        got = list(ordered_map(work, range(24), workers=workers, depth=4))
        assert [v for v, _ in got] == [v for v, _ in reference], workers
        assert peak[0] <= min(4, workers)
        if workers > 1:
            assert finished != sorted(finished)  # control: they did finish out of order


@pytest.fixture(scope="module")
def shape_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    make_shape_set(root, num_train=16, num_heldout=0, seed=3)
    return build_image_dataset(root / "train.jsonl", ByteTokenizer(), 255, 16, 32, 96)


class SlowData:
    """The image dataset with ``SLOW`` seconds of preparation per micro-batch (decoding stood in by a sleep)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def collate(self, indices):
        time.sleep(SLOW)
        return self.ds.collate(indices)


def _waits(ds, depth: int) -> dict:
    sampler = ResumableBatchSampler(len(ds), micro_batch_size=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0)
    wait = DataWait()
    with PrefetchLoader(SlowData(ds), sampler, depth=depth) as loader:
        steps = []
        for _ in range(5):
            batch = wait.measure(loader.next_step)
            assert batch[0]["pixel_values"].shape == (4, 3, 32, 32)
            t0 = time.perf_counter()
            time.sleep(STEP)  # the step's compute
            steps.append(time.perf_counter() - t0 + wait.last)
    return wait.summary(steps)


def test_data_wait_hidden_by_prefetch(shape_dataset):
    hidden = _waits(shape_dataset, depth=2)
    assert hidden["mean_s"] < SLOW / 2 and hidden["share"] < 0.2, hidden
    exposed = _waits(shape_dataset, depth=0)  # control: no prefetch, every step waits for its batch
    assert exposed["mean_s"] >= SLOW and exposed["share"] > SLOW / (SLOW + STEP) * 0.9, exposed
