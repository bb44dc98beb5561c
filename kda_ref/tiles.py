"""The chunk grid: which tokens form which tile (chunk), in the production order.

A sequence of length n has ceil(n / C) chunks (an empty sequence has none).  Tiles are
the chunks of all sequences in order; tile t covers tokens
``[tile_start[t], tile_start[t] + tile_len[t])`` of the packed token axis, and rows
``i >= tile_len[t]`` are its tail.  Everything here is index bookkeeping (int64,
built vectorised with torch on the device of the data).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TileGrid:
    C: int
    Ttot: int
    seq_bos: torch.Tensor       # [N]    first token of each sequence
    seq_len: torch.Tensor       # [N]    length of each sequence
    seq_tile_off: torch.Tensor  # [N+1]  prefix offsets of each sequence's tiles
    tile_seq: torch.Tensor      # [tiles] sequence of each tile
    tile_start: torch.Tensor    # [tiles] first token of each tile
    tile_len: torch.Tensor      # [tiles] valid rows Lc of each tile (1..C)
    token_index: torch.Tensor   # [tiles, C] token of each row; Ttot (a zero row) on tail rows

    @property
    def tiles(self) -> int:
        return int(self.tile_seq.numel())

    @property
    def N(self) -> int:
        return int(self.seq_len.numel())

    @property
    def row_mask(self) -> torch.Tensor:
        """[tiles, C] bool: True on valid rows."""
        return torch.arange(self.C, device=self.tile_len.device)[None, :] < self.tile_len[:, None]

    def seq_grid(self) -> torch.Tensor:
        """[N, NCmax] tile index of chunk c of sequence n, -1 past the sequence's last chunk."""
        nch = self.seq_tile_off[1:] - self.seq_tile_off[:-1]
        ncmax = int(nch.max()) if nch.numel() else 0
        c = torch.arange(ncmax, device=nch.device)[None, :]
        return torch.where(c < nch[:, None], self.seq_tile_off[:-1, None] + c, torch.full_like(c, -1))

    @property
    def full(self) -> bool:
        """Every tile full (tiles * C == Ttot): token_index is then arange(Ttot) as [tiles, C]."""
        return self.tiles * self.C == self.Ttot

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Packed [Ttot, HV, D] (or [Ttot, HV]) -> head-major tiles [HV, tiles, C, D] (or
        [HV, tiles, C]); tail rows are zero."""
        perm = (2, 0, 1) + tuple(range(3, x.dim() + 1))
        if self.full:
            return x[: self.Ttot].reshape((self.tiles, self.C) + tuple(x.shape[1:])).permute(*perm).contiguous()
        pad = x.new_zeros((1,) + tuple(x.shape[1:]))
        xt = torch.cat([x, pad])[self.token_index]          # [tiles, C, HV, ...]
        return xt.permute(*perm).contiguous()

    def scatter(self, xt: torch.Tensor) -> torch.Tensor:
        """Head-major tiles [HV, tiles, C, D] -> packed [Ttot, HV, D] (tail rows dropped)."""
        HV, D = xt.shape[0], xt.shape[-1]
        if self.full:
            return xt.permute(1, 2, 0, 3).reshape(self.Ttot, HV, D)
        out = xt.new_zeros(self.Ttot + 1, HV, D)
        out[self.token_index.reshape(-1)] = xt.permute(1, 2, 0, 3).reshape(-1, HV, D)
        return out[: self.Ttot]


def tile_grid(bounds, C: int, Ttot: int, device=None) -> TileGrid:
    """The chunk grid of sequences ``bounds = [(bos, eos)]`` for chunk size C."""
    if C < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {C!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    b = torch.tensor([bo for bo, _ in bounds], dtype=torch.long, device=dev).reshape(-1)
    e = torch.tensor([eo for _, eo in bounds], dtype=torch.long, device=dev).reshape(-1)
    n_len = e - b
    nch = (n_len + C - 1) // C
    off = torch.zeros(len(bounds) + 1, dtype=torch.long, device=dev)
    off[1:] = torch.cumsum(nch, 0)
    tiles = int(off[-1])
    tile_seq = torch.repeat_interleave(torch.arange(len(bounds), device=dev), nch)
    c_in_seq = torch.arange(tiles, device=dev) - off[tile_seq]
    tile_start = b[tile_seq] + c_in_seq * C
    tile_len = torch.minimum(torch.full_like(tile_start, C), e[tile_seq] - tile_start)
    rows = torch.arange(C, device=dev)[None, :]
    token_index = torch.where(rows < tile_len[:, None], tile_start[:, None] + rows,
                              torch.full_like(rows, Ttot))
    return TileGrid(C=C, Ttot=Ttot, seq_bos=b, seq_len=n_len, seq_tile_off=off, tile_seq=tile_seq,
                    tile_start=tile_start, tile_len=tile_len, token_index=token_index)
