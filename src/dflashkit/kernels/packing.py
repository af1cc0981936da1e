"""The codes of a q4_1 / q8_0 `RowLinear` laid out as the packed kernels read them: qlinear.cpp's groups of 16 rows
(8-bit activations) and plinear.cpp's records per band of 32 rows (exact codes). Layout only: no arithmetic, so
the bits a layer computes do not depend on it."""

from __future__ import annotations

import torch


def pack_codes(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`RowLinear.packed` for `w`, a q4_1 / q8_0 `RowLinear` (kernels/__init__.py, which imports this module: not
    imported here): qlinear's layout (8-bit activations), or plinear's records (exact codes; `_records`)."""
    n, k = w.shape
    nb, groups = k // 32, -(-n // 16)
    if w.exact_codes:  # plinear: bands of two groups (an odd count gets a group of zero rows)
        groups += groups % 2
    pad = groups * 16 - n

    def rows(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [groups * 16, ...], zeros past N
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [N, blocks] -> [groups, blocks, 16]
        return rows(t.view(n, nb)).view(groups, 16, nb).permute(0, 2, 1).contiguous()

    if w.kind == "q4_1":
        b = w.codes.view(n, nb, 16)
        q = rows(torch.cat([b & 0x0F, b >> 4], dim=-1))  # [rows, blocks, 32] in element order
        # element 8 p + 4 h + e of row r -> chunk p, byte 4 r + e, nibble h (low h = 0)
        q = q.view(groups, 16, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [g, b, p, h, r, e]
        codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).contiguous().view(-1)
        if w.exact_codes:
            return _records(codes, [per_row(w.scale), per_row(w.minimum)], groups, nb)
        return codes, per_row(w.scale), per_row(w.minimum)
    if w.kind == "q8_0":
        q = rows(w.codes.view(n, nb, 32))  # int8
        if w.exact_codes:  # plinear.cpp: pair i of a block, byte 2 r + h = q[r][2 i + h]; no correction term there
            codes = q.view(groups, 16, nb, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(-1).view(torch.uint8)
            return _records(codes, [per_row(w.scale)], groups, nb)
        codes = q.view(groups, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1).view(torch.uint8)
        corr = (128 * w.codes.view(n, nb, 32).to(torch.int32).sum(-1)).to(torch.int32)
        return codes, per_row(w.scale), per_row(corr)
    raise ValueError(f"8-bit activations need q4_1 / q8_0 weights, not {w.kind}")


def _records(codes: torch.Tensor, scales: list[torch.Tensor], groups: int,
             nb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """plinear's layout (plinear.cpp): per band of two groups and block one record, the two groups' codes, then each
    scale tensor's (d, then Q4_1's m) two groups' 16 values in fp16. codes: [groups, blocks, bytes] flat; scales: fp32
    [groups, blocks, 16]. The fp16 values are the GGUF's own (its blocks store d and m in fp16), so widening them
    back in the kernel gives the same fp32; a layer whose scales are not fp16 values cannot run there (checked, not
    rounded: rounding would change its bits)."""
    halves = [t.half() for t in scales]
    if not all(torch.equal(h.float(), t) for h, t in zip(halves, scales)):
        raise ValueError("exact codes (plinear) need scales that are fp16 values, as GGUF Q4_1 / Q8_0 blocks store "
                         "them; this layer's are not: read it with 8-bit activations (with_int8_acts) or as bf16")
    bands = groups // 2
    parts = [codes.view(bands, 2, nb, -1).transpose(1, 2)]  # [bands, blocks, 2 groups, code bytes]
    parts += [h.view(bands, 2, nb, 16).transpose(1, 2).contiguous().view(torch.uint8) for h in halves]
    records = torch.cat([p.reshape(bands, nb, -1) for p in parts], dim=-1).contiguous().view(-1)
    empty = torch.empty(0, dtype=torch.float32)
    return records, empty, empty
