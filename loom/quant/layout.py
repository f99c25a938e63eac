"""loom's packed weight layouts: every quantized format is repacked, exactly, into one of these, so kernels
exist only for them.

Two layouts, both row-major over the output rows n < N and grouped along the input k < K, and one arrangement
of the first for loom's AVX-512 VNNI kernels:

- `q4g`: 4-bit unsigned codes in blocks of 32, one scale (and min) per group of `group_size` values (32, as
  GGUF's Q4_0 / Q4_1 / Q4_K, or a larger multiple of 32 dividing K, as GPTQ's and AWQ's groups of 64 or 128: a
  decode step then reads 4 + 32 / group_size bits a weight instead of 5). `qweight` uint8 [N, K // 2]: each block
  is 16 bytes, and byte i of a block holds element i in its low nibble and element i + 16 in its high nibble (the
  order of GGUF's Q4_0 / Q4_1 blocks, so those repack as copies). The kernels compute with a group's scale and
  min in each of its blocks exactly what they compute with the weight expanded to groups of 32.
- `q8g`: 8-bit signed codes in groups of `group_size` (16, or a multiple of 32 up to K). `qweight` int8 [N, K].
- `q4gr16` (and `q8gr16`, the same for q8g with groups of 16 or 32: 8 words per block of 32): q4g's bytes
  with every 16 rows interleaved (N a multiple of 16), as the kernels' 16-row groups
  read them, one weight row per 32-bit lane (loom/kernels/csrc/qgemm.c, "16 weight rows per vector"): for rows
  16 g .. 16 g + 15, block b, word j < 4 (bytes 4j .. 4j+3 of the row's 16-byte block), the 16 rows'
  words lie side by side; scales and mins likewise, [g][group][16 rows]. The tensors keep q4g's shapes ([N, K // 2],
  [N, K // 32]) and bytes; only their order differs (`interleave_rows16` / `deinterleave_rows16`). Made at load
  (PackedLinearMethod) where the kernels have the groups, so that every row count runs one summation order.

Both: `scales` float16 [N, K // group_size], `mins` float16 [N, K // group_size] or None, and

    W[n, g * group_size + j] = float32(scales[n, g]) * q[n, g * group_size + j] + float32(mins[n, g])

(mins taken as 0 when None), computed in float32 (the product of a float16 and a code of at most 8 bits is
exact in float32, so W is one rounding of the exact value, the same rounding as gguf's dequantization).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("q4g", "q8g", "q4gr16", "q8gr16")
INTERLEAVED = {"q4gr16": "q4g", "q8gr16": "q8g"}  # 16-row interleaved layout -> its row-major layout
Q4_LAYOUTS = ("q4g", "q4gr16")  # 4-bit codes, two per byte


@dataclass(slots=True)
class PackedWeight:
    """A weight matrix [N, K] in one of loom's layouts (see the module docstring)."""

    layout: str  # one of LAYOUTS
    qweight: torch.Tensor  # q4g / q4gr16: uint8 [N, K // 2]; q8g / q8gr16: int8 [N, K]
    scales: torch.Tensor  # float16 [N, K // group_size]
    mins: torch.Tensor | None  # float16 [N, K // group_size], or None (symmetric codes)
    group_size: int  # values per scale: a multiple of 32 for q4g; 16 or a multiple of 32 for q8g

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.qweight, torch.Tensor) or self.qweight.dim() != 2:
            raise ValueError(f"{self.layout} qweight must be a 2-D tensor [N, K{' // 2' if self.layout in Q4_LAYOUTS else ''}]")
        n = self.qweight.shape[0]
        q4 = self.layout in Q4_LAYOUTS
        k = self.qweight.shape[1] * (2 if q4 else 1)
        want_dtype = torch.uint8 if q4 else torch.int8
        if self.layout == "q8gr16" and (self.group_size not in (16, 32) or n % 16):
            raise ValueError(f"q8gr16 needs groups of 16 or 32 and a multiple of 16 rows, got {self.group_size}, N={n}")
        if self.qweight.dtype != want_dtype or self.qweight.dim() != 2:
            raise ValueError(f"{self.layout} qweight must be {want_dtype} [N, K{' // 2' if k != self.qweight.shape[1] else ''}]")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if q4 and self.group_size % 32:
            raise ValueError(f"{self.layout} has groups of a multiple of 32, got {self.group_size}")
        if self.layout == "q4gr16" and n % 16:
            raise ValueError(f"q4gr16 needs a multiple of 16 rows, got N={n}")
        if self.group_size != 16 and (self.group_size % 32 or self.group_size > k) or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} must be 16 or a multiple of 32 dividing K={k}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (t.dtype != torch.float16 or tuple(t.shape) != (n, k // self.group_size)):
                raise ValueError(f"{name} must be float16 [{n}, {k // self.group_size}]")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the matrix it holds."""
        n, cols = self.qweight.shape
        return n, cols * 2 if self.layout in Q4_LAYOUTS else cols

    @property
    def label(self) -> str:
        """The layout and its groups for logs: "q8gr16/32", "q8g/channel", "q4gr16" (q4g's groups of 32 unsaid),
        "q4g/128"."""
        g = self.group_size
        if self.layout in Q4_LAYOUTS and g == 32:
            return self.layout
        return f"{self.layout}/{'channel' if g == self.shape[1] else g}"

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read for one pass over the matrix."""
        total = self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2
        return total + (self.mins.numel() * 2 if self.mins is not None else 0)

    def to(self, device: torch.device | str) -> PackedWeight:
        """The same matrix with every tensor on `device` (a file's blocks are read on the CPU; a CUDA model's
        packed weights must live on its GPU)."""
        return PackedWeight(self.layout, self.qweight.to(device), self.scales.to(device),
                            None if self.mins is None else self.mins.to(device), self.group_size)

    def rows(self, index: torch.Tensor | slice) -> PackedWeight:
        """The packed rows `index` (a permutation, a slice), same layout: rows are independent. Of an interleaved
        weight (q4gr16, q8gr16), the rows in its row-major layout (gathered lane by lane: an embedding lookup
        from a tied LM head's matrix)."""
        if self.layout in INTERLEAVED:
            n = self.shape[0]
            # the row ids (a lookup's tensor as is; a slice's range, not an arange over all N rows each call)
            ids = torch.arange(*index.indices(n), device=self.qweight.device) if isinstance(index, slice) else index
            g, lane = ids // 16, ids % 16
            words = self.qweight.view(torch.int32).view(n // 16, -1, 16)[g, :, lane]  # [len(ids), words per row]

            def side(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.view(n // 16, -1, 16)[g, :, lane].contiguous()

            # words per block (4 or 8) are already in row order inside each [block][word] pair
            return PackedWeight(INTERLEAVED[self.layout], words.contiguous().view(self.qweight.dtype),
                                side(self.scales), side(self.mins), self.group_size)
        return PackedWeight(self.layout, self.qweight[index].contiguous(), self.scales[index].contiguous(),
                            None if self.mins is None else self.mins[index].contiguous(), self.group_size)

    def cols(self, start: int, stop: int) -> PackedWeight:
        """The columns [start, stop) of the matrix, same layout (a tensor-parallel rank's input range).

        Raises:
            ValueError: start or stop not on a group boundary (a group's codes share one scale).
        """
        _row_major(self)
        g = self.group_size
        if start % g or stop % g or not 0 <= start < stop <= self.shape[1]:
            raise ValueError(f"columns [{start}, {stop}) of a {self.layout} matrix with groups of {g} and "
                             f"K={self.shape[1]}: a split must fall on group boundaries")
        per_byte = 2 if self.layout == "q4g" else 1
        q = self.qweight[:, start // per_byte : stop // per_byte].contiguous()
        gs = slice(start // self.group_size, stop // self.group_size)
        return PackedWeight(self.layout, q, self.scales[:, gs].contiguous(),
                            None if self.mins is None else self.mins[:, gs].contiguous(), self.group_size)


def _row_major(w: PackedWeight) -> None:
    if w.layout in INTERLEAVED:
        raise ValueError(f"a {w.layout} weight's rows are interleaved: take deinterleave_rows16(w) first")


def interleavable(w: PackedWeight) -> bool:
    """Whether interleave_rows16 takes `w`: q4g (any groups), or q8g with groups of 16 or 32, N a multiple of 16."""
    return w.shape[0] % 16 == 0 and (w.layout == "q4g" or (w.layout == "q8g" and w.group_size in (16, 32)))


def interleave_rows16(w: PackedWeight) -> PackedWeight:
    """A q4g weight, or a q8g one with groups of 16 or 32, [N, K] (N a multiple of 16) in its 16-row interleaved
    arrangement (q4gr16, q8gr16; module docstring): the same bytes, reordered. Runs on any device.

    Raises:
        ValueError: another layout or group, or N not a multiple of 16.
    """
    if w.layout not in ("q4g", "q8g") or (w.layout == "q8g" and w.group_size not in (16, 32)):
        raise ValueError(f"interleave_rows16 takes a q4g weight or a q8g one with groups of 16 or 32, got "
                         f"{w.layout!r} with groups of {w.group_size}")
    n, k = w.shape
    if n % 16:
        raise ValueError(f"interleave_rows16 needs a multiple of 16 rows, got N={n}")
    g, words = n // 16, w.qweight.shape[1] // 4  # 32-bit words per row
    packed = w.qweight.view(torch.int32).view(g, 16, words // (4 if w.layout == "q4g" else 8), -1)
    packed = packed.permute(0, 2, 3, 1).contiguous()

    def side(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(g, 16, -1).transpose(1, 2).contiguous().view(t.shape)

    layout = "q4gr16" if w.layout == "q4g" else "q8gr16"
    return PackedWeight(layout, packed.view(w.qweight.dtype).view(w.qweight.shape), side(w.scales), side(w.mins),
                        w.group_size)


def deinterleave_rows16(w: PackedWeight) -> PackedWeight:
    """The row-major weight a q4gr16 or q8gr16 weight holds (the inverse of interleave_rows16).

    Raises:
        ValueError: not an interleaved layout.
    """
    if w.layout not in INTERLEAVED:
        raise ValueError(f"deinterleave_rows16 takes a q4gr16 or q8gr16 weight, got {w.layout!r}")
    n = w.shape[0]
    g, words = n // 16, w.qweight.shape[1] // 4
    per_block = 4 if w.layout == "q4gr16" else 8
    packed = w.qweight.contiguous().view(torch.int32).view(g, words // per_block, per_block, 16)
    packed = packed.permute(0, 3, 1, 2).contiguous()

    def side(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous().view(g, -1, 16).transpose(1, 2).contiguous().view(t.shape)

    return PackedWeight(INTERLEAVED[w.layout], packed.view(w.qweight.dtype).view(w.qweight.shape), side(w.scales),
                        side(w.mins), w.group_size)


def unpack_codes(packed: PackedWeight) -> torch.Tensor:
    """The integer codes q [N, K] int16 (q4g, q4gr16: 0..15; q8g, q8gr16: -128..127), in row-major order."""
    if packed.layout in INTERLEAVED:
        packed = deinterleave_rows16(packed)
    if packed.layout == "q8g":
        return packed.qweight.to(torch.int16)
    n, half = packed.qweight.shape
    groups = packed.qweight.view(n, half // 16, 16).to(torch.int16)
    return torch.cat([groups & 0xF, groups >> 4], dim=2).reshape(n, half * 2)


def dequantize(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix W [N, K] the layout defines, in float32 arithmetic, then cast to `dtype` (reference
    implementation; runs on any device)."""
    if packed.layout in INTERLEAVED:
        packed = deinterleave_rows16(packed)
    n, k = packed.shape
    groups = k // packed.group_size
    q = unpack_codes(packed).view(n, groups, packed.group_size).float()
    w = q * packed.scales.float().unsqueeze(-1)
    if packed.mins is not None:
        w = w + packed.mins.float().unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def pack_q4g(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> PackedWeight:
    """codes [N, K] integers 0..15, scales / mins float16 [N, K // group_size] -> q4g PackedWeight with groups of
    group_size = K // scales.shape[1] (ValueError unless a multiple of 32 dividing K)."""
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"q4g packs blocks of 32 codes: K={k} is not a multiple of 32")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError(f"4-bit codes must lie in 0..15, got {int(codes.min())}..{int(codes.max())}")
    groups = scales.shape[1]
    if not groups or k % groups:
        raise ValueError(f"{groups} scale columns do not divide K={k} into groups")
    c = codes.to(torch.uint8).view(n, k // 32, 2, 16)
    qweight = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return PackedWeight("q4g", qweight, scales.contiguous(), None if mins is None else mins.contiguous(), k // groups)
