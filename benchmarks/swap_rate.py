"""How fast the disk tier can move a bucket's swap file through the page cache, and what limits it.

The disk tier's step reads each disk bucket's file into a staging slot and writes it back ([Note: disk tier]). On a
machine whose page cache holds the swap files, both are memory copies done by `pread`/`pwrite` on the I/O threads.
Buffered writes to one file serialise on its inode lock on Linux filesystems, so a pool of threads writing one
bucket's chunks may run at one thread's rate. This measures, in the offload folder:
- `raw`: `threads` threads writing, then reading back (the pages cached), `--gib` in 16 MiB chunks spread over
  `files` files (chunk i in file i % files), in GB/s;
- `staging`: the engine's own `DiskStaging` (its slots, its I/O threads, its files): `--buckets` buckets of
  `--bucket-gib` each scheduled, acquired and released dirty in order, as one step of the tier, in GB/s of reads plus
  writes, for each I/O thread count and each count of pieces a bucket's file is cut into.

    python3 benchmarks/swap_rate.py [--folder DIR] [--gib 4] [--buckets 8] [--bucket-gib 1] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accelerate_roundpipe.config import RoundPipeConfig  # noqa: E402
from accelerate_roundpipe.runtime.disk import BucketLayout, TensorSpec, bucket_file, open_swap  # noqa: E402
from benchmarks.records import emit  # noqa: E402

CHUNK = 16 * 2**20


def filesystem_of(folder: str) -> str:
    """The type of the filesystem `folder` is on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) >= 3 and os.path.realpath(folder).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def raw_rates(folder: str, nbytes: int, threads: int, files: int) -> tuple[float, float]:
    """(write, read) GB/s of `nbytes` in CHUNK pieces over `files` files by `threads` threads (reads hot)."""
    buffer = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = bucket_file.byte_view(buffer)
    paths = [os.path.join(folder, f"raw{i}") for i in range(files)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
    chunks = [(i, start) for i, start in enumerate(range(0, nbytes, CHUNK))]

    def write(item):
        i, start = item
        bucket_file.write_at(fds[i % files], view[start:start + CHUNK], (i // files) * CHUNK, paths[i % files])

    def read(item):
        i, start = item
        bucket_file.read_at(fds[i % files], view[start:start + CHUNK], (i // files) * CHUNK, paths[i % files])

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, chunks))  # a first pass allocates the pages: not timed
            start = time.perf_counter()
            list(pool.map(write, chunks))
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            list(pool.map(read, chunks))
            read_s = time.perf_counter() - start
    finally:
        for fd, path in zip(fds, paths):
            os.close(fd)
            os.unlink(path)
    return nbytes / 1e9 / write_s, nbytes / 1e9 / read_s


def staging_rate(folder: str, buckets: int, bucket_bytes: int, io_threads: int, pieces: int, slots: int = 3) -> float:
    """GB/s of reads plus writes of one step of `buckets` disk buckets through the engine's staging (files hot),
    each bucket's file in `pieces` equal pieces ([Note: swap files in pieces])."""
    numel = bucket_bytes // 4
    splits = tuple(numel * i // pieces // 1024 * 1024 for i in range(1, pieces))
    layouts = {k: BucketLayout.of([TensorSpec("optim", numel, torch.float32)], splits) for k in range(buckets)}
    staging = open_swap(folder, layouts, slots, io_threads=io_threads, timeout_s=600.0)
    try:
        image = torch.randint(0, 256, (layouts[0].nbytes,), dtype=torch.uint8)
        for k in range(buckets):
            staging.files[k].write_range(image, 0, image.numel())
        best = 0.0
        for _ in range(2):  # the first round faults the slots' pages in
            start = time.perf_counter()
            staging.schedule(range(buckets))
            for k in range(buckets):
                views = staging.acquire(k)
                views["optim"].add_(1.0)  # a stand-in for the step: every page read and dirtied
                staging.release(k, dirty=True)
            staging.flush()
            seconds = time.perf_counter() - start
            best = max(best, 2 * buckets * layouts[0].nbytes / 1e9 / seconds)
        return best
    finally:
        staging.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", default=None, help="where the files go (default: the engine's offload_dir)")
    parser.add_argument("--gib", type=float, default=4.0, help="bytes of each raw measurement, GiB")
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--bucket-gib", type=float, default=1.0)
    parser.add_argument("--io-threads", default="4,8", help="the staging's I/O thread counts to measure")
    parser.add_argument("--pieces", default="1,8", help="the swap files' piece counts to measure")
    parser.add_argument("--raw", default="1x1,8x1,8x8,16x16", help="raw (threads x files) shapes to measure")
    parser.add_argument("--out", default=None, help="a JSON-lines file the records are appended to")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = args.folder or RoundPipeConfig().resolved_offload_dir
    os.makedirs(base, exist_ok=True)
    fs = filesystem_of(base)
    nbytes = int(args.gib * 2**30) // CHUNK * CHUNK
    with tempfile.TemporaryDirectory(dir=base, prefix="swap-rate-") as folder:
        for threads, files in (tuple(int(n) for n in shape.split("x")) for shape in args.raw.split(",")):
            write, read = raw_rates(folder, nbytes, threads, files)
            print(f"raw    threads {threads:2d} files {files:2d}: write {write:6.2f} GB/s, read {read:6.2f} GB/s "
                  f"({fs}, {nbytes / 2**30:.1f} GiB)", flush=True)
            emit({"kind": "swap_raw", "threads": threads, "files": files, "write_gbps": round(write, 3),
                  "read_gbps": round(read, 3), "nbytes": nbytes, "filesystem": fs}, args.out)
    for pieces in (int(p) for p in args.pieces.split(",")):
        for threads in (int(t) for t in args.io_threads.split(",")):
            rate = staging_rate(base, args.buckets, int(args.bucket_gib * 2**30), threads, pieces)
            print(f"staging io_threads {threads:2d} pieces {pieces}: {rate:6.2f} GB/s of reads + writes "
                  f"({args.buckets} buckets of {args.bucket_gib:g} GiB, 3 slots, {fs})", flush=True)
            emit({"kind": "swap_staging", "io_threads": threads, "pieces": pieces, "gbps": round(rate, 3),
                  "buckets": args.buckets, "bucket_bytes": int(args.bucket_gib * 2**30), "filesystem": fs}, args.out)

if __name__ == "__main__":
    main()
