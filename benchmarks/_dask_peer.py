"""The Dask peer of the sort and word count suites (``pip install 'dask[dataframe,distributed]'``).

    python benchmarks/_dask_peer.py sort TOTAL_RECORDS WORKERS
    python benchmarks/_dask_peer.py wordcount TOTAL_WORDS WORKERS

What a Dask user on one machine runs: a ``distributed.LocalCluster`` of W single-threaded worker
processes. The input is generated in W partitions on the workers and persisted before the clock starts
(as for the other implementations, generating it is not timed).

* sort: a dask DataFrame of the sort suite's records, keys and values as ``latin-1`` strings (Dask turns
  object columns into Arrow strings, which must be text; latin-1 keeps the bytes' order), then
  ``sort_values("key")``, each output partition summarized on its worker (count, checksum, order,
  first/last key) - the 1 GB result never travels to the client.
* wordcount: a dask Bag of the demo's generated words, ``frequencies()`` computed to the client.

Prints ``DASK {json}``.
"""

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _summary_frame(part):
    import pandas as pd

    from _sort_data import summarize
    return pd.DataFrame([summarize(zip(part["key"].tolist(), part["value"].tolist()), text=True)])


def _records_frame(rank: int, world: int, total: int):
    import pandas as pd

    from _sort_data import generate
    recs = generate(rank, world, total)
    return pd.DataFrame({"key": [k.decode("latin-1") for k, _ in recs],
                         "value": [v.decode("latin-1") for _, v in recs]})


def run_sort(client, total: int, workers: int) -> dict:
    import dask.dataframe as dd
    from dask import delayed
    from distributed import wait

    meta = _records_frame(0, 1, 1).iloc[:0]
    df = dd.from_delayed([delayed(_records_frame)(r, workers, total) for r in range(workers)], meta=meta)
    df = df.persist()
    wait(df)
    n = int(df.map_partitions(len).compute().sum())
    summary_meta = {"n": "int64", "crc": "int64", "sorted": "bool", "first": "object", "last": "object"}
    t = time.perf_counter()
    out = df.sort_values("key").map_partitions(_summary_frame, meta=summary_meta).compute()
    dt = time.perf_counter() - t
    parts = [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
             for row in out.to_dict("records")]
    return {"seconds": dt, "n": n, "parts": parts}


def run_wordcount(client, total: int, workers: int) -> dict:
    import dask.bag as db
    from dask import delayed
    from distributed import wait

    from wordcount import generated_words
    bag = db.from_delayed([delayed(generated_words)(r, workers, total) for r in range(workers)])
    bag = bag.persist()
    wait(bag)
    n = bag.count().compute()
    t = time.perf_counter()
    counts = dict(bag.frequencies().compute())
    dt = time.perf_counter() - t
    return {"seconds": dt, "words": n, "counts": counts}


def main() -> None:
    kind, total, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from distributed import Client, LocalCluster
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                           local_directory=os.environ.get("DASK_LOCAL_DIR"))
    client = Client(cluster)
    try:
        out = (run_sort if kind == "sort" else run_wordcount)(client, total, workers)
    finally:
        client.close()
        cluster.close()
    print("DASK " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "examples"))
    main()
