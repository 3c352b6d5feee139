"""What a checkpoint save costs beyond the filesystem: rank 0's sha256 of every file (``checkpoint_files``).

``save_checkpoint`` records the size and sha256 of every file of a checkpoint, hashed on rank 0 after
all ranks wrote theirs, and ``verify_checkpoint`` hashes them again on resume. So a save takes
(bytes / write bandwidth) + (bytes / rank 0's hash rate). This script measures that rate with the
product's own ``core.files.sha256_file`` against a plain read of the same file in 1 MiB blocks (the
baseline: what the read alone costs), both from the page cache, interleaved, best of ``--repeat``,
and prints the ratio; and the write + fsync rate of the file system under ``--dir``.

    python benchmarks/checkpoint_hash.py --mb 1024 --repeat 3 --dir /tmp
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.files import sha256_file  # noqa: E402


def _read(path: Path) -> int:
    n = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            n += len(block)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="File size in MiB.")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="Where the test file is written (and removed).")
    args = ap.parse_args()
    size = args.mb << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "state.bin"
        block = os.urandom(1 << 20)
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            for _ in range(args.mb):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        write_s = time.perf_counter() - t0
        _read(path)  # into the page cache
        hash_s, read_s = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            sha256_file(path)
            hash_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            _read(path)
            read_s.append(time.perf_counter() - t)
    gbs = lambda s: size / s / 1e9  # noqa: E731
    print(f"file {args.mb} MiB under {args.dir}")
    print(f"write + fsync        {gbs(write_s):6.2f} GB/s ({write_s:.2f} s)")
    print(f"sha256_file (ours)   {gbs(min(hash_s)):6.2f} GB/s (best of {args.repeat}: {', '.join(f'{s:.2f}' for s in hash_s)} s)")
    print(f"plain read (baseline){gbs(min(read_s)):6.2f} GB/s (best of {args.repeat}: {', '.join(f'{s:.2f}' for s in read_s)} s)")
    print(f"hash / read time     {min(hash_s) / min(read_s):6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
