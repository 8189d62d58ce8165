"""Datasets in a bucket (docs/design.md §30), against moto's S3 server process:
tools/preprocess_data.py --output-prefix s3://... uploads a dataset of the corpus's
documents, and training from --data-path s3://... (cached under --object-storage-cache-path)
logs the losses of training from the same files on disk."""

import contextlib
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.training import pretrain
from megalite.training_log import parse_log

from tests.helpers import download_objects, flags_with, without

pytestmark = pytest.mark.slow  # an S3 server process; preprocessing's worker pool

ROOT = Path(__file__).resolve().parent.parent
FLAGS = without(flags_with("--tokenizer-type", "NullTokenizer", "--log-interval", "1",
                           "--eval-iters", "0", "--num-workers", "0", vocab_size=60,
                           make_vocab_size_divisible_by=None, hidden_size=32, seq_length=16,
                           micro_batch_size=2, global_batch_size=4, train_iters=3),
                "--mock-data")


def losses(*flags) -> list[float]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pretrain([*FLAGS, *flags]) == 0
    return [log["lm_loss"] for log in parse_log(out.getvalue())]


def test_preprocess_into_a_bucket_and_train_from_it(tmp_path, s3_bucket):
    """The bucket's dataset holds the corpus's documents, each with its end-of-document, and
    training from it logs the losses of training from a copy of its files on disk."""
    rng = random.Random(0)
    documents = [[rng.randrange(60) for _ in range(rng.randrange(5, 40))] for _ in range(60)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(map(str, d))}) + "\n"
                              for d in documents))
    url = f"{s3_bucket}/data/corpus"
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(corpus), "--tokenizer-type", "NullTokenizer", "--vocab-size", "60",
                    "--append-eod", "--output-prefix", url], check=True, capture_output=True)
    local = download_objects(f"{s3_bucket}/data", tmp_path / "disk") / "corpus_text_document"
    dataset = IndexedDataset(local)
    assert [dataset[i].tolist() for i in range(len(dataset))] == [d + [60] for d in documents]
    on_disk = losses("--data-path", str(local), "--data-cache-path", str(tmp_path / "indices1"))
    from_bucket = losses("--data-path", f"{url}_text_document", "--object-storage-cache-path",
                         str(tmp_path / "objects"), "--data-cache-path",
                         str(tmp_path / "indices2"))
    assert len(on_disk) == 3 and from_bucket == on_disk
