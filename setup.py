from setuptools import find_packages, setup

setup(
    name="glm53",
    version="0.1.0",
    description="Pure-PyTorch reference and training library for GLM-5.3-Flash (transformers' glm5_next)",
    packages=find_packages(include=["glm53", "glm53.*"]),
    package_data={"glm53": ["training/data/*.txt"]},
    entry_points={"console_scripts": ["glm53 = glm53.__main__:main"]},
    python_requires=">=3.11",  # tomllib (run.toml)
    # tokenizers: --data with a tokenizer.json; tqdm: the progress bar of `glm53 train`
    install_requires=["torch>=2.6", "safetensors", "einops", "tokenizers", "tqdm"],
    extras_require={
        # transformers tokenizers (tokenizer_config.json, chat templates), parquet, `datasets` datasets
        "data": ["transformers==5.23.0", "pyarrow", "datasets"],
        "vl": ["pillow", "av"],  # image decoding (glm53.vision.media) and video files through PyAV
        "tensorboard": ["tensorboard"],
        # everything the tests import (transformers is the numerical oracle, peft the adapter-file oracle), plus
        # pytest-xdist (the suite runs on two workers), benchmarks/plot_run.py and the formatter/linter .ci/run calls
        # (ruff pinned: the format check must not move with a new release)
        "test": ["pytest", "pytest-xdist", "hypothesis", "transformers==5.23.0", "expecttest", "peft", "pyarrow", "datasets", "pillow",
                 "av", "tensorboard", "matplotlib", "ruff==0.17.6"],
    },
)
