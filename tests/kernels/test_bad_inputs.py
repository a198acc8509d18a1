"""Every bad argument raises a ValueError naming it, before anything is launched."""

import pytest
import torch

import tutti.kernels as K
from tutti.kernels import conformance as C


@pytest.fixture
def setup():
    case = C.make_case("hnd", torch.float16, 16, num_blocks=8)
    ids = torch.tensor([[1, 2], [3, 4]])
    out = torch.zeros((2, 2, case.layout.segment_bytes(32)), dtype=torch.uint8)
    return case, ids, out


@pytest.mark.parametrize("variant", ["triton", "torch"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_bad_arguments(setup, variant, op):
    case, ids, out = setup
    f = getattr(K, op)
    lay, caches = case.layout, case.caches
    snapshot = C.storage_bytes(case)

    def bad(match, *, caches=caches, layout=lay, ids=ids, seg=out, **kw):
        with pytest.raises(ValueError, match=match):
            f(caches, layout, ids, seg, variant=variant, **kw)

    bad("layout=dict", layout={})
    bad("non-empty sequence", caches=[])
    bad(r"caches\[1\] has shape", caches=[caches[0], caches[1][:4]])
    bigger = C.make_case("hnd", torch.float16, 16, num_blocks=16).layout
    bad("storage holds only", layout=bigger)
    bad("block_ids.dtype=torch.float32", ids=ids.float())
    bad(r"block_ids.shape=\(4,\)", ids=ids.reshape(-1))
    bad("block_ids.device=meta", ids=ids.to("meta"))
    bad(r"values in \[2, 8\]: expected manager block ids in \[0, 8\)", ids=ids * 2)
    bad(r"values in \[-1, 2\]", ids=ids - 2)
    bad(r"in \[0, 4\) .*kernel_blocks_per_block=2", kernel_blocks_per_block=2)
    bad("kernel_blocks_per_block=0", kernel_blocks_per_block=0)
    name = "out" if op == "gather" else "src"
    bad(f"{name}.dtype=torch.int8", seg=out.view(torch.int8))
    bad(rf"{name}.shape=\(1, 2, 4096\): expected \(2, 2, S>=4096\)", seg=out[:1])
    bad(rf"{name}.shape=\(2, 2, 2048\): expected \(2, 2, S>=4096\)", seg=out[:, :, :2048])
    bad(rf"{name}.shape=\(2, 4096\): expected \(L=2", seg=out[0])
    bad("last dim contiguous", seg=out.transpose(1, 2).contiguous().transpose(1, 2))
    if variant == "triton":
        bad("max_programs=0", max_programs=0)
    for before, after in zip(snapshot, C.storage_bytes(case)):
        assert torch.equal(before, after)  # nothing was written


def test_unknown_variant(setup):
    case, ids, out = setup
    with pytest.raises(ValueError, match="variant='nope': unknown"):
        K.gather(case.caches, case.layout, ids, out, variant="nope")
