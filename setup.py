from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="A small, readable, Megatron-style GPT pretraining codebase on torch.distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megalite", "megalite.*"]),
    package_data={"megalite.cost": ["prices.yaml"]},  # tools/estimate_cost.py's price table
    # torch >= 2.8 for FSDP2's set_gradient_divide_factor / set_force_sum_reduction_for_comms
    # (distributed/fsdp.py sums gradients over DP with them; tests/test_fsdp_flags.py).
    install_requires=["torch>=2.8", "numpy", "sentencepiece", "tensorboard", "PyYAML"],
    extras_require={
        "flash": ["flash-attn>=2.5"],
        "hf": ["tokenizers>=0.15", "transformers>=4.45"],
        "plot": ["matplotlib"],  # tools/plot_schedule.py, tools/check_cluster.py's charts
        # tools/preprocess_data.py inputs (megalite/data/document_sources.py): Parquet and
        # Arrow files, zstd-compressed JSONL; `datasets` only writes save_to_disk test inputs.
        "parquet": ["pyarrow>=14"],
        "zstd": ["zstandard"],
        "datasets": ["datasets"],
        "wandb": ["wandb"],  # --wandb-project
        "ray": ["ray>=2.9"],  # tools/ray_launch.py (megalite/ray_launch.py)
        "s3": ["boto3"],  # s3:// --save, --load, --data-path (megalite/object_storage/)
        # dev holds every optional dependency a test exercises, so CI runs them all.
        "dev": ["pytest>=7", "tokenizers>=0.15", "transformers>=4.45", "pyarrow>=14",
                "zstandard", "datasets", "wandb", "ray>=2.9", "boto3", "moto[server]"],
    },
)
