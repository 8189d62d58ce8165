"""Indexed datasets in a bucket (`--data-path s3://bucket/corpus_text_document`, docs/design.md
§30): each prefix's `.idx` and `.bin` are downloaded once per node into
--object-storage-cache-path (by the node's first process, the others waiting) and memory-
mapped from there, so the samples are those of the same files on disk, in the same order.
The `.bin` is cached whole rather than read by ranged requests: a sample is a few KB, and a
request per sample costs a round trip that a whole-file transfer pays once
(benchmarks/object_storage_throughput.py measures both). `tools/preprocess_data.py
--output-prefix s3://...` writes locally, then uploads `.bin` before `.idx`."""

from pathlib import Path

from megalite.object_storage.paths import is_object_url, mirror_path, node_share
from megalite.object_storage.s3 import S3Store, S3Url

SUFFIXES = (".bin", ".idx")  # uploaded in this order: an .idx names a whole .bin


def cached(prefix: str, cache: str | None) -> str:
    """The local prefix of `prefix` (itself when it is a path)."""
    return str(mirror_path(prefix, cache)) if is_object_url(prefix) else prefix


def download(prefix: str, cache: str | None) -> None:
    """`prefix`'s files into the cache, unless the copies there are of the same objects
    (their size, ETag and CRC-32, kept in a `.version` file beside each)."""
    store, local = S3Store.shared(), Path(cached(prefix, cache))
    for suffix in SUFFIXES:
        url, path = S3Url.parse(prefix + suffix), Path(str(local) + suffix)
        version, record = store.version(url), Path(f"{path}.version")
        if path.is_file() and record.is_file() and record.read_text() == version:
            continue
        store.download(url, path)
        record.write_text(version)


def localize(prefixes: list[str], cache: str | None, barrier) -> list[str]:
    """Every rank: `prefixes` with each s3:// one replaced by its copy in this node's cache,
    downloaded by the node's first process while the others wait in `barrier`."""
    remote = [p for p in prefixes if is_object_url(p)]
    if not remote:
        return prefixes
    # torch imported here, not at the top: tools/preprocess_data.py uploads through this
    # module, and loading torch would double the tool's memory (its test holds it below the
    # input's size).
    import torch.distributed as dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if node_share(rank, world)[0] == 0:
        for prefix in remote:
            download(prefix, cache)
    barrier()
    return [cached(p, cache) for p in prefixes]


def upload(local_prefix: str, prefix: str) -> None:
    """A preprocessed dataset's files to the bucket, `.bin` first."""
    store = S3Store.shared()
    for suffix in SUFFIXES:
        store.upload(Path(local_prefix + suffix), S3Url.parse(prefix + suffix))
