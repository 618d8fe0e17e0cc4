#!/usr/bin/env python3
"""A training step's GPU memory without a GPU: the step runs on meta tensors (shapes only) while
`Trace` records every storage an op creates and when it dies, and `replay` feeds that sequence to
a model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings:
no max_split_size, no expandable segments), which gives torch.cuda.max_memory_allocated and
max_memory_reserved. Used by bench/hf_bert_replay.py and bench/litgpt_peak.py --meta.

What a trace misses, so each user supplies it: kernel workspaces (cuBLAS's, one per handle:
`workspace`), memory an op allocates inside its CUDA kernel and frees before returning, and
device-specific op choices (CUDA's fused dropout, SDPA's flash kernels: the user's model code
calls what the CUDA run would).

The allocator model: requests rounded to 512 B; up to 1 MiB from 2 MiB segments, up to 10 MiB
from 20 MiB segments, larger ones from their own segment rounded to 2 MiB; best fit among cached
blocks of the request's pool; a block split when more than 1 MiB (large pool) or 512 B (small)
would remain; neighbours merged on free; whole cached segments released and the request retried
when the device is full.
"""
import bisect
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 2**20


class Block:
    __slots__ = ("size", "ptr", "small", "prev", "next", "free")

    def __init__(self, size, ptr, small):
        self.size, self.ptr, self.small = size, ptr, small
        self.prev = self.next = None
        self.free = False


class CachingAllocator:
    """CUDACachingAllocator's block pools on one stream: peak allocated and reserved bytes."""

    def __init__(self, capacity):
        self.pools = {True: [], False: []}  # per pool, free blocks sorted by (size, ptr)
        self.capacity = capacity
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.top = 0  # next segment address
        self.releases = 0

    def _insert(self, b):
        bisect.insort(self.pools[b.small], (b.size, b.ptr, b))

    def _remove(self, b):
        pool = self.pools[b.small]
        pool.pop(bisect.bisect_left(pool, (b.size, b.ptr)))

    def _release_cached(self):  # release_cached_blocks: whole free segments go back to CUDA
        for small, pool in self.pools.items():
            keep = [e for e in pool if e[2].prev or e[2].next]
            self.reserved -= sum(e[0] for e in pool if not (e[2].prev or e[2].next))
            self.pools[small] = keep

    def malloc(self, nbytes):
        size = 512 if nbytes < 512 else 512 * math.ceil(nbytes / 512)
        small = size <= MIB
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            b = pool.pop(i)[2]
        else:
            seg = 2 * MIB if small else 20 * MIB if size < 10 * MIB else 2 * MIB * math.ceil(size / (2 * MIB))
            if self.reserved + seg > self.capacity:
                self._release_cached()
                self.releases += 1
                if self.reserved + seg > self.capacity:
                    raise MemoryError(f"out of memory at {self.reserved / 2**30:.2f} GiB reserved")
            b = Block(seg, self.top, small)
            self.top += seg
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = b.size - size
        if rest >= 512 if small else rest > MIB:  # should_split
            r = Block(rest, b.ptr + size, small)
            r.free, r.prev, r.next = True, b, b.next
            if b.next:
                b.next.prev = r
            b.next, b.size = r, size
            self._insert(r)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b

    def release(self, b):
        self.allocated -= b.size
        b.free = True
        for n in (b.prev, b.next):  # try_merge_blocks
            if n is not None and n.free:
                self._remove(n)
                if n is b.prev:
                    b.ptr, b.prev = n.ptr, n.prev
                    if n.prev:
                        n.prev.next = b
                else:
                    b.next = n.next
                    if n.next:
                        n.next.prev = b
                b.size += n.size
        self._insert(b)


class Trace(TorchDispatchMode):
    """Every new storage an op returns is an allocation; its death (weakref) the free."""

    def __init__(self):
        super().__init__()
        self.events, self.live, self.n = [], {}, 0

    def existing(self, tensors):
        """Storages made before the trace (weights built outside it): their views are not allocations."""
        for t in tensors:
            self.live.setdefault(t.untyped_storage()._cdata, 0)

    def track(self, t):
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or st.nbytes() == 0:
            return
        self.n += 1
        k = self.n
        self.live[key] = k
        self.events.append(("a", k, st.nbytes()))

        def gone():
            if self.live.get(key) == k:
                del self.live[key]
            self.events.append(("f", k))
        weakref.finalize(st, gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.track(t)
        return out


def replay(events, capacity):
    alloc, blocks = CachingAllocator(capacity), {}
    for e in events:
        if e[0] == "a":
            blocks[e[1]] = alloc.malloc(e[2])
        elif e[1] in blocks:
            alloc.release(blocks.pop(e[1]))
    return alloc


def workspace(nbytes: int) -> torch.Tensor:
    """A kernel library's workspace, allocated as the library would (inside a Trace: recorded)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


def cublas_workspace_bytes(gpu: str) -> int:
    """PyTorch's cuBLAS workspace per handle (CublasHandlePool.cpp): 32 MiB on sm_90, else 8 MiB + 128 KiB."""
    return 32 * MIB if gpu.upper().startswith(("H100", "H200", "H800", "GH200")) else 8 * MIB + 128 * 1024


def cuda_dropout(x, p=0.5, training=True, inplace=False):
    """F.dropout as CUDA runs it (the fused kernel: the output and a 1-byte mask); on meta
    tensors F.dropout would keep a noise tensor of the input's dtype instead."""
    return torch.native_dropout(x, p, training)[0] if training and p > 0 else x


class FlashSDPA(torch.autograd.Function):
    """What SDPA's flash / cuDNN / memory-efficient kernels keep and make on the GPU, on meta
    tensors: the output and an fp32 log-sum-exp [B, H, T] saved with q, k, v (and the additive
    bias the memory-efficient kernel is given for a mask); the backward makes q, k and v's
    gradients."""

    @staticmethod
    def forward(ctx, q, k, v, bias=None):
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
