"""Mask builders against hand-written references, and FlexAttention against the dense path."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from diffusers_causal_kv import block_causal_mask, chunk_schedule, teacher_forcing_mask


def _frames(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row.replace(" ", "")] for row in rows])


def test_block_causal_uneven_schedule():
    mask = block_causal_mask(5, [1, 2, 2], frame_tokens=1)
    assert torch.equal(mask.allowed, _frames([
        "1 0 0 0 0",
        "1 1 1 0 0",
        "1 1 1 0 0",
        "1 1 1 1 1",
        "1 1 1 1 1",
    ]))


def test_int_schedule_gives_the_remainder_to_the_first_chunk():
    mask = block_causal_mask(5, 2, frame_tokens=1)
    assert mask.chunk_sizes == (3, 2)
    assert torch.equal(mask.allowed, _frames([
        "1 1 1 0 0",
        "1 1 1 0 0",
        "1 1 1 0 0",
        "1 1 1 1 1",
        "1 1 1 1 1",
    ]))
    assert block_causal_mask(21, 4, frame_tokens=1).chunk_sizes == (5, 4, 4, 4, 4)


def test_dense_expands_frames_to_tokens():
    mask = block_causal_mask(2, 1, frame_tokens=2)
    assert torch.equal(mask.dense(), _frames([
        "1 1 0 0",
        "1 1 0 0",
        "1 1 1 1",
        "1 1 1 1",
    ]))
    assert mask.seq_len == 4


def test_window_and_sink():
    # Window of 4 with 1 sink frame, chunks of 2: the chunk [4, 6) sees the sink (frame 0) and frames 3..5.
    mask = block_causal_mask(6, 2, frame_tokens=1, window_frames=4, sink_frames=1)
    assert torch.equal(mask.allowed, _frames([
        "1 1 0 0 0 0",
        "1 1 0 0 0 0",
        "1 1 1 1 0 0",
        "1 1 1 1 0 0",
        "1 0 0 1 1 1",
        "1 0 0 1 1 1",
    ]))
    # Without a sink the window slides: chunk [4, 6) sees frames 2..5 only.
    mask = block_causal_mask(6, 2, frame_tokens=1, window_frames=4)
    assert torch.equal(mask.allowed[4:], _frames(["0 0 1 1 1 1"] * 2))
    # A window that is not a multiple of the chunk size: chunk [3, 6) with window 5 sees frames 1..5.
    mask = block_causal_mask(6, 3, frame_tokens=1, window_frames=5)
    assert torch.equal(mask.allowed[3:], _frames(["0 1 1 1 1 1"] * 3))


def test_teacher_forcing():
    mask = teacher_forcing_mask(4, 2, frame_tokens=1)
    assert mask.num_frames == 8
    assert torch.equal(mask.allowed, _frames([
        # clean 0..3 | noisy 0..3
        "1 1 0 0  0 0 0 0",
        "1 1 0 0  0 0 0 0",
        "1 1 1 1  0 0 0 0",
        "1 1 1 1  0 0 0 0",
        "0 0 0 0  1 1 0 0",
        "0 0 0 0  1 1 0 0",
        "1 1 0 0  0 0 1 1",
        "1 1 0 0  0 0 1 1",
    ]))


def test_teacher_forcing_with_window():
    # Noisy chunk [4, 6) with a window of 4 sees clean frames 2..3 (not 0..1) and itself.
    mask = teacher_forcing_mask(6, 2, frame_tokens=1, window_frames=4)
    assert torch.equal(mask.allowed[6 + 4], _frames(["0 0 1 1 0 0  0 0 0 0 1 1"])[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(window_frames=2, sink_frames=2), "window_frames > sink_frames"),
    (dict(window_frames=0), "window_frames > sink_frames"),
    (dict(window_frames=3, sink_frames=2), "does not fit the window"),
    (dict(sink_frames=1), "sink_frames needs window_frames"),
])
def test_bad_window(kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_causal_mask(6, 2, frame_tokens=1, **kwargs)


def test_bad_schedule_and_tokens():
    with pytest.raises(ValueError, match="adding up to the 6 latent frames"):
        block_causal_mask(6, [2, 2], frame_tokens=1)
    with pytest.raises(ValueError, match="frame_tokens must be a positive int"):
        block_causal_mask(6, 2, frame_tokens=0)


@pytest.mark.parametrize("num_frames", range(1, 23))
def test_bad_schedule_error_suggests_a_schedule_that_fits(num_frames):
    with pytest.raises(ValueError, match="must be positive ints adding up to") as caught:
        chunk_schedule(num_frames, [num_frames + 1])
    suggestion = str(caught.value).split("; e.g. ", 1)[1].split(" for ", 1)[0].rstrip(".")
    sizes = eval(suggestion)  # e.g. "[3] + [3] * 2"
    assert sum(sizes) == num_frames and chunk_schedule(num_frames, sizes) == sizes


def test_bad_schedule_error_without_frames_says_so():
    with pytest.raises(ValueError, match="no frames to split"):
        chunk_schedule(0, [1])


@pytest.mark.parametrize("mask", [
    block_causal_mask(5, [1, 2, 2], frame_tokens=12),
    block_causal_mask(6, 2, frame_tokens=24, window_frames=4, sink_frames=1),
    teacher_forcing_mask(4, [1, 3], frame_tokens=16),
], ids=repr)
def test_flex_block_mask_agrees_with_dense(mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, mask.seq_len, 12, generator=g) for _ in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())
    flex = flex_attention(q, k, v, block_mask=mask.block_mask())
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    assert mask.block_mask() is mask.block_mask()  # built once per device
