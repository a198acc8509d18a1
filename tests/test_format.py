"""tutti.format: the one place that sizes, offsets and pads segments (docs/format.md)."""

from tutti import format as fmt
from tutti.engine.build import Geometry
from tutti.kernels import PagedLayout


def test_segments_are_padded_to_4_kib_and_laid_back_to_back():
    assert fmt.SEGMENT_ALIGN == 4096
    assert fmt.segment_bytes(256, 4096) == 256 * 4096  # already aligned: no padding
    assert fmt.segment_bytes(3, 1000) == 4096 and fmt.segment_bytes(5, 1000) == 8192
    assert fmt.slot_bytes(32, 8192) == 32 * 8192 and fmt.segment_offset(3, 8192) == 3 * 8192
    assert fmt.token_span(2, 5, 100) == (200, 500)


def test_every_layer_of_the_stack_asks_it():
    g = Geometry(model="m", cache_dtype="bfloat16", chunk_tokens=48, block_size=16, num_layers=3,
                 num_heads=2, content_bytes=100)
    assert g.segment_bytes == fmt.segment_bytes(48, 200) and g.slot_bytes == fmt.slot_bytes(3, g.segment_bytes)
    assert g.fingerprint().format_version == fmt.FORMAT_VERSION
    import torch

    layout = PagedLayout.from_tensor(torch.zeros(4, 16, 2, 50, dtype=torch.uint8), ("block", "token", "head", "dim"))
    assert layout.segment_bytes(48) == fmt.segment_bytes(48, layout.token_bytes)
