"""An S3 bucket through boto3 (docs/design.md §30): what the checkpoints and the data read
and write, and every failure as a StorageError naming the object.

boto3 rather than s3fs/fsspec: its default credential chain (environment, shared files,
SSO, instance and container roles) and `AWS_ENDPOINT_URL` (MinIO, Ceph, R2, GCS's
interoperability endpoint) come with the client; botocore's retry modes back off on
throttling, 5xx and dropped connections; s3transfer splits large files into parts uploaded
and downloaded in parallel. fsspec would add a layer over the same client.

Each object carries the CRC-32 and size of the bytes uploaded as user metadata
(`x-amz-meta-megalite-crc32`, `-size`): a HEAD confirms an object is the one written (a
publish waits for every rank's), and a download is checked against them before use.
"""

import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

from megalite.atomic_write import atomic_path
from megalite.errors import ConfigError, StorageError

MAX_ATTEMPTS = 8
"""Per request, botocore's "standard" mode: exponential backoff with jitter, up to 20 s,
on throttling, 5xx and dropped connections (~1 minute of a store's trouble in all)."""
PART_BYTES = 64 * 2**20
"""Multipart above this, in parts of this size; s3transfer retries a part, not the file."""
CONCURRENCY = 8
"""Parts (or files) in flight per rank."""
_CRC, _SIZE = "megalite-crc32", "megalite-size"


class S3Url(NamedTuple):
    bucket: str
    key: str  # no leading or trailing "/"

    @classmethod
    def parse(cls, url: str) -> "S3Url":
        bucket, _, key = str(url).removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"{url}: expected s3://bucket/prefix")
        return cls(bucket, key.strip("/"))

    def join(self, *names: str) -> "S3Url":
        return S3Url(self.bucket, "/".join([p for p in (self.key, *names) if p]))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


class ObjectRecord(NamedTuple):
    """What was uploaded: the bytes' count and CRC-32."""
    size: int
    crc32: str


def file_record(path: Path) -> ObjectRecord:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            crc = zlib.crc32(chunk, crc)
    return ObjectRecord(path.stat().st_size, f"{crc:08x}")


def _boto3():
    try:
        import boto3
        import botocore
    except ImportError as error:
        raise ConfigError("s3:// paths need boto3, which is not installed: "
                          "pip install megalite[s3]  (or pip install boto3)") from error
    return boto3, botocore


class S3Store:
    """One boto3 client (thread-safe: the async writer and download threads share it).
    `S3Store.shared()` is the process's, made once (a client takes ~0.2 s to build) for
    each AWS_* environment (a test changes it)."""

    _shared: dict[tuple, "S3Store"] = {}

    @classmethod
    def shared(cls) -> "S3Store":
        key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
        if key not in cls._shared:
            cls._shared[key] = cls()
        return cls._shared[key]

    def __init__(self):
        boto3, botocore = _boto3()
        self._errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                        boto3.exceptions.Boto3Error)
        # AWS_MAX_ATTEMPTS / AWS_RETRY_MODE, where set, as for any AWS client.
        retries = {"max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", MAX_ATTEMPTS)),
                   "mode": os.environ.get("AWS_RETRY_MODE", "standard")}
        config = botocore.config.Config(retries=retries, max_pool_connections=2 * CONCURRENCY)
        self.client = boto3.session.Session().client("s3", config=config)
        self.transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
            max_concurrency=CONCURRENCY)

    def _failed(self, what: str, url: S3Url, error: Exception) -> StorageError:
        code = getattr(error, "response", {}).get("Error", {}).get("Code")
        hint = {"NoCredentialsError": " (no credentials: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where a role provides them)",
                "InvalidAccessKeyId": " (the access key is not known to the store)",
                "SignatureDoesNotMatch": " (the secret key is wrong)",
                "AccessDenied": " (the credentials may not do this)",
                "NoSuchBucket": " (create the bucket first)"}
        name = code or type(error).__name__
        return StorageError(f"cannot {what} {url}: {error}{hint.get(name, '')}")

    @contextmanager
    def _failing(self, what: str, url: S3Url) -> Iterator[None]:
        """The block's client errors as _failed's StorageError."""
        try:
            yield
        except self._errors as error:
            raise self._failed(what, url, error) from error

    def upload(self, path: Path, url: S3Url) -> ObjectRecord:
        record = file_record(path)
        metadata = {_CRC: record.crc32, _SIZE: str(record.size)}
        with self._failing("upload to", url):
            self.client.upload_file(str(path), url.bucket, url.key, Config=self.transfer,
                                    ExtraArgs={"Metadata": metadata})
        return record

    def put(self, url: S3Url, data: bytes) -> None:
        """A small object in one request (S3 replaces an object whole: a reader sees the
        old or the new)."""
        with self._failing("write", url):
            self.client.put_object(Bucket=url.bucket, Key=url.key, Body=data,
                                   Metadata={_CRC: f"{zlib.crc32(data):08x}",
                                             _SIZE: str(len(data))})

    def head(self, url: S3Url) -> ObjectRecord | None:
        """The object's size and recorded CRC-32 ("" if none), or None if absent."""
        try:
            reply = self.client.head_object(Bucket=url.bucket, Key=url.key)
        except self._errors as error:
            if getattr(error, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return None
            raise self._failed("read", url, error) from error
        return ObjectRecord(reply["ContentLength"], reply.get("Metadata", {}).get(_CRC, ""))

    def version(self, url: S3Url) -> str:
        """What identifies the object's current bytes (size, ETag, recorded CRC-32): a
        cached copy whose version matches needs no download."""
        with self._failing("read", url):
            reply = self.client.head_object(Bucket=url.bucket, Key=url.key)
        return f"{reply['ContentLength']} {reply.get('ETag', '')} " \
               f"{reply.get('Metadata', {}).get(_CRC, '')}"

    def get(self, url: S3Url) -> bytes | None:
        """A small object's bytes, checked against its CRC-32; None if absent."""
        try:
            reply = self.client.get_object(Bucket=url.bucket, Key=url.key)
            data = reply["Body"].read()
        except self._errors as error:
            if getattr(error, "response", {}).get("Error", {}).get("Code") == "NoSuchKey":
                return None
            raise self._failed("read", url, error) from error
        expected = reply.get("Metadata", {}).get(_CRC)
        if expected is not None and f"{zlib.crc32(data):08x}" != expected:
            raise StorageError(f"{url}: its bytes do not match the CRC-32 recorded when it was "
                               f"written ({expected}): a damaged read or object")
        return data

    def get_range(self, url: S3Url, start: int, length: int) -> bytes:
        """`length` bytes from `start` (an HTTP range request)."""
        with self._failing("read", url):
            reply = self.client.get_object(Bucket=url.bucket, Key=url.key,
                                           Range=f"bytes={start}-{start + length - 1}")
            data = reply["Body"].read()
        if len(data) != length:
            raise StorageError(f"{url}: asked for {length} bytes at {start}, got {len(data)}")
        return data

    def download(self, url: S3Url, path: Path) -> ObjectRecord:
        """The object into `path` (whole or not at all), checked against the size and
        CRC-32 recorded when it was uploaded."""
        expected = self.head(url)
        if expected is None:
            raise StorageError(f"{url} does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, f".{os.getpid()}.part") as tmp:
            # download_fileobj, not download_file: that one names its temporary file from
            # Python's global `random`, whose state a checkpoint saves.
            with self._failing("download", url), open(tmp, "wb") as f:
                self.client.download_fileobj(url.bucket, url.key, f, Config=self.transfer)
            got = file_record(tmp)
            if got.size != expected.size or (expected.crc32 and got.crc32 != expected.crc32):
                raise StorageError(f"{url}: downloaded {got.size} bytes of CRC-32 {got.crc32}, "
                                   f"but it was written as {expected.size} bytes of CRC-32 "
                                   f"{expected.crc32 or '(none recorded)'}")
        return got

    def list_names(self, url: S3Url, directories: bool) -> list[str]:
        """The names directly under `url` (as if a directory): its sub-"directories" (common
        prefixes) or its objects."""
        prefix = url.key + "/" if url.key else ""
        names = []
        for page in self._pages(url, prefix, "/"):
            if directories:
                names += [p["Prefix"][len(prefix):].rstrip("/")
                          for p in page.get("CommonPrefixes", [])]
            else:
                names += [o["Key"][len(prefix):] for o in page.get("Contents", [])]
        return sorted(names)

    def delete_under(self, url: S3Url) -> int:
        """Every object under `url`/ (a "directory"); returns how many."""
        keys = [o["Key"] for page in self._pages(url, url.key + "/", None)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes 1000 keys a request
            with self._failing("delete objects under", url):
                self.client.delete_objects(Bucket=url.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        return len(keys)

    def delete(self, url: S3Url) -> None:
        with self._failing("delete", url):
            self.client.delete_object(Bucket=url.bucket, Key=url.key)

    def _pages(self, url: S3Url, prefix: str, delimiter: str | None) -> Iterator[dict]:
        args = {"Bucket": url.bucket, "Prefix": prefix}
        if delimiter:
            args["Delimiter"] = delimiter
        with self._failing("list", url):
            yield from self.client.get_paginator("list_objects_v2").paginate(**args)
