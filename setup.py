from setuptools import find_packages, setup

setup(
    name="glm53",
    version="0.1.0",
    description="Pure-PyTorch reference and training library for GLM-5.3-Flash (transformers' glm5_next)",
    packages=find_packages(include=["glm53", "glm53.*"]),
    package_data={"glm53": ["training/data/*.txt"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "safetensors", "einops"],
    extras_require={
        "test": ["pytest", "hypothesis", "transformers==5.23.0", "expecttest", "pillow", "av"],
        "vl": ["pillow", "av"],  # image decoding (glm53.vision.media) and video files through PyAV
    },
)
