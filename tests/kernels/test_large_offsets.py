"""Byte offsets past 2^31 must use int64 index math (an int32 overflow would segfault the interpreter)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch
    from tutti.kernels import PagedLayout, triton_kernels, reference

    # MLA-like (B, N, C) bytes with an odd C: forces 1-byte words, so byte offsets reach the index math as is.
    N, C = 16, 4095
    B = (2**31) // (N * C) + 3
    buf = torch.empty((B, N, C), dtype=torch.uint8)
    assert buf.numel() > 2**31 + 2 * N * C
    lay = PagedLayout.from_tensor(buf, ("block", "token", "dim"))
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[B - 1, 0], [B - 3, B - 2]], dtype=torch.int32)
    for b in ids.reshape(-1).tolist():
        buf[b] = torch.randint(0, 256, (N, C), dtype=torch.uint8, generator=g)
    S = lay.segment_bytes(2 * N)
    out = torch.full((2, S), 0xAB, dtype=torch.uint8)
    triton_kernels.gather([buf], lay, ids, out)
    want = torch.zeros_like(out)
    reference.gather([buf], lay, ids, want)
    assert torch.equal(out, want), "gather past 2 GiB differs"
    assert torch.equal(out[0, : N * C], buf[B - 1].reshape(-1)), "gather read the wrong block"
    # scatter chunk 0 over the last blocks, in the other order
    triton_kernels.scatter([buf], lay, torch.tensor([[B - 2, B - 1]]), out[:1])
    assert torch.equal(buf[B - 2], want[0, : N * C].reshape(N, C)), "scatter past 2 GiB wrote wrong bytes"
    assert torch.equal(buf[B - 1], want[0, N * C : 2 * N * C].reshape(N, C))
    assert torch.equal(buf[B - 3].reshape(-1), want[1, : N * C]), "scatter touched a block it should not"
    print("OK")
    """
)


def test_offsets_past_2gib_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
