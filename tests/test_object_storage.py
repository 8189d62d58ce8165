"""Object-storage paths (docs/design.md, "Checkpoints and data in object storage"): a URL
whose scheme megalite does not speak is refused by name, never taken as a local path."""

import sys

import pytest

from megalite.arguments import parse_args
from megalite.errors import ConfigError
from megalite.object_storage.s3 import S3Store
from megalite.training import pretrain
from megalite.validation import validate_args

from tests.helpers import BASE_FLAGS, flags_with, load_tool, without

UNSUPPORTED = ["gs://bucket/run", "msc://profile/run", "hdfs://namenode/run"]


@pytest.mark.parametrize("url", UNSUPPORTED)
@pytest.mark.parametrize("flag", ["--save", "--load", "--data-path"])
def test_an_unsupported_scheme_is_refused_naming_flag_and_scheme(flag, url):
    extra = ["--tokenizer-type", "NullTokenizer"] if flag == "--data-path" else []
    flags = without(BASE_FLAGS, "--mock-data") if flag == "--data-path" else BASE_FLAGS
    scheme = url.split(":")[0]
    with pytest.raises(ConfigError, match=f"{flag} {url}: {scheme}:// is not supported"):
        validate_args(parse_args([*flags, *extra, flag, url]))


def test_the_node_local_checkpoint_directory_takes_no_url():
    with pytest.raises(ConfigError, match="--non-persistent-local-ckpt-dir s3://b/x: s3:// is "
                                          "not supported here \\(expected a local path\\)"):
        validate_args(parse_args(flags_with("--save", "ckpt", "--non-persistent-save-interval", "2",
                  "--non-persistent-ckpt-type", "local",
                  "--non-persistent-local-ckpt-dir", "s3://b/x")))


def test_pretrain_with_an_unsupported_save_url_exits_before_training(tmp_path, monkeypatch,
                                                                    capsys):
    """The report of issue 44: `--save s3://ckpt/run` trained and wrote ./s3:/ckpt/run."""
    monkeypatch.chdir(tmp_path)
    assert pretrain(flags_with("--save", "gs://ckpt/run", train_iters=1)) == 2
    assert "--save gs://ckpt/run: gs:// is not supported" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_preprocess_refuses_an_unsupported_output_url(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a b"}\n')
    preprocess = load_tool("preprocess_data")
    with pytest.raises(ConfigError, match="--output-prefix gs://b/corpus: gs:// is not "
                                          "supported"):
        preprocess.get_args(["--input", str(source), "--output-prefix", "gs://b/corpus",
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])


def test_without_boto3_an_s3_path_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # what `import boto3` then raises
    with pytest.raises(ConfigError, match=r"pip install megalite\[s3\]"):
        S3Store()
