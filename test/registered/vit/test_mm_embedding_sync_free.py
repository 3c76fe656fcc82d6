"""The multimodal embedding path without a device sync after the vision tower (patch mm_embedding_sync_free).

Real sglang 0.5.17 `mm_utils.embed_mm_inputs` on CPU tensors: batches of requests with images,
text-only requests between them and chunked prefill (extend ranges that start or end inside an
image), a tower stand-in that returns one distinct row per patch. Checked: the host count equals
the device mask's count, the patched embedding equals the unpatched one bit for bit, no
`Tensor.item()` runs when the counts agree, and a disagreement still takes sglang's own path.
mm_utils's `torch`: torch's names, an `as_tensor` equal to torch's, and the pinned copy only for
Python int lists bound for CUDA outside a capture (on the GPU: test_mm_embedding_sync_free_cuda.py).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sglang.srt.managers import mm_utils
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalInputs
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext.vit.mm_embedding import tokens_in_extend
from sglang_ext.registry import PATCH_NAMES

from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

THIS_PATCH = "mm_embedding_sync_free"
VOCAB, HIDDEN = 64, 8


class Tower:
    """`get_image_feature` stand-in: row j of an item is item.pad_value + j (in every column)."""

    def __init__(self):
        self.calls = 0

    def get_image_feature(self, items):
        self.calls += 1
        rows = [torch.arange(it.tokens, dtype=torch.float32).unsqueeze(1).expand(-1, HIDDEN) + it.pad_value
                for it in items]
        return torch.cat(rows)


def make_batch(rng: random.Random, n_requests: int):
    """(mm_inputs_list, prefix_lens, extend_lens, input_ids) of one extend batch; some requests text-only."""
    mm_inputs, prefix_lens, extend_lens, ids = [], [], [], []
    pad = VOCAB + 1000
    for _ in range(n_requests):
        seq, items = [], []
        for _ in range(rng.randint(0, 3)):
            seq += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            tokens = rng.choice([4, 9, 16, 25])
            item = MultimodalDataItem(modality=Modality.IMAGE, pad_value=pad, offsets=[(len(seq), len(seq) + tokens - 1)])
            item.hash = pad
            item.set("tokens", tokens)
            items.append(item)
            seq += [pad] * tokens
            pad += 1
        seq += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
        prefix = rng.randrange(len(seq))  # chunked prefill: the extend range may start inside an image
        end = rng.randint(prefix + 1, len(seq))
        if items:
            mm_inputs.append(MultimodalInputs(mm_items=items))
            prefix_lens.append(prefix)
            extend_lens.append(end - prefix)
        ids += seq[prefix:end]
    return mm_inputs, prefix_lens, extend_lens, torch.tensor(ids)


def embed(batch, tower):
    mm_inputs, prefix_lens, extend_lens, ids = batch
    mm_utils.init_mm_embedding_cache(0)
    embeds, _ = mm_utils.embed_mm_inputs(mm_inputs_list=mm_inputs, extend_prefix_lens=prefix_lens,
                                         extend_seq_lens=extend_lens, input_ids=ids.clone(),
                                         input_embedding=torch.nn.Embedding(VOCAB, HIDDEN), multimodal_model=tower)
    return embeds


@pytest.fixture
def sync_free(ext_patches):
    statuses = ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH))
    if statuses:  # plugin mode (the patched tree returns {})
        assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
    return statuses


def count_items(monkeypatch):
    calls = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or original(self))
    return calls


@pytest.mark.parametrize("seed", range(40))
def test_host_count_equals_the_device_mask(seed):
    mm_inputs, prefix_lens, extend_lens, ids = make_batch(random.Random(seed), 5)
    pads = [it.pad_value for m in mm_inputs for it in m.mm_items]
    mask = mm_utils._get_multimodal_mask(ids, torch.tensor(pads or [-1]))
    items_size, offsets = [0], []
    for m in mm_inputs:
        items_size.append(items_size[-1] + len(m.mm_items))
        offsets.append([o for it in m.mm_items for o in it.offsets])
    assert tokens_in_extend(items_size, prefix_lens, extend_lens, offsets) == int(mask.sum())


@pytest.mark.parametrize("seed", range(12))
def test_patched_embedding_is_bitwise_the_original_and_takes_no_item(seed, monkeypatch, ext_patches):
    torch.manual_seed(0)
    batch = make_batch(random.Random(seed), 6)
    reference = embed(batch, Tower())
    ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH))
    items = count_items(monkeypatch)
    torch.manual_seed(0)
    patched = embed(batch, Tower())
    assert torch.equal(patched, reference)
    if batch[0]:
        assert items == [], "Tensor.item() ran on the patched path"


def test_without_a_matching_host_count_sglangs_own_check_runs(sync_free, monkeypatch):
    """Called outside get_embedding_and_mask, or with a host count other than the rows (EVS pruning,
    placeholders moved): sglang's own check with its sync, here its error for too few rows."""
    adapter = ext_core("vit.mm_embedding")
    embedding = torch.arange(8.0).reshape(4, 2)
    mask = torch.tensor([True, True, False, True, True, True]).unsqueeze(-1)
    logger = logging.getLogger("test_mm_embedding_sync_free")
    for host_count in (None, 5):
        items = count_items(monkeypatch)
        token = adapter._host_count.set(host_count)
        try:
            with pytest.raises(RuntimeError, match="Insufficient multimodal embedding length"):
                mm_utils._adjust_embedding_length(embedding, mask, logger)
        finally:
            adapter._host_count.reset(token)
        assert items, "sglang's mask.sum().item() ran"
    items = count_items(monkeypatch)
    token = adapter._host_count.set(4)
    try:
        assert mm_utils._adjust_embedding_length(embedding, mask, logger) is embedding
    finally:
        adapter._host_count.reset(token)
    assert items == []


def test_mm_utils_sees_torchs_names_and_an_as_tensor_equal_to_torchs(sync_free):
    proxy = mm_utils.torch
    assert proxy is not torch and type(proxy).__name__ == "TorchForMmUtils"
    assert proxy.zeros is torch.zeros and proxy.Tensor is torch.Tensor and proxy.cuda is torch.cuda
    for data, kwargs in (([3, 5], {}), ([3, 5], {"device": "cpu"}), ((7,), {"dtype": torch.int32}),
                         ([1.5, 2.0], {}), ([True, False], {}), ([], {}), (torch.arange(3), {"device": "cpu"})):
        got, want = proxy.as_tensor(data, **kwargs), torch.as_tensor(data, **kwargs)
        assert torch.equal(got, want) and (got.dtype, got.device) == (want.dtype, want.device), (data, kwargs)


def test_only_python_int_lists_bound_for_cuda_skip_the_wait(sync_free, monkeypatch):
    adapter = ext_core("vit.mm_embedding")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for data, device in (([151655, 151656], "cuda"), ((3,), torch.device("cuda", 0)), ([3], "cuda:1")):
        assert adapter.copies_without_a_wait(data, device), (data, device)
    for data, device in (([3], "cpu"), ([3], None), ([3.0], "cuda"), ([True], "cuda"), ([], "cuda"),
                         (torch.tensor([3]), "cuda"), ([3, 4.0], "cuda")):
        assert not adapter.copies_without_a_wait(data, device), (data, device)
    copies = []
    monkeypatch.setattr(adapter, "pinned_copy", lambda *args: copies.append(args) or "pinned")
    assert mm_utils.torch.as_tensor([4, 2], device="cuda") == "pinned" and copies == [([4, 2], None, "cuda")]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # a capture: torch's own copy
    assert not adapter.copies_without_a_wait([4, 2], "cuda")
