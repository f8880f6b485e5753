"""fastopt: fused, exact, layout-agnostic optimizers for PyTorch.

`kernels/` (Triton) installs as `fastopt.kernels` (a top-level `kernels` would clash with a PyPI package).
"""
from setuptools import setup

TEST = [
    "pytest>=8",
    "pytest-xdist>=3.2",  # --dist worksteal
    "numpy",
    "triton>=3.6",
    "transformers>=4.40",
    "accelerate",  # transformers' Trainer (tests/test_hf_trainer.py)
    "came-pytorch==0.1.3",
    "galore-torch==1.0",
    "bitsandbytes>=0.45",
    "ninja",
    "tqdm",
    "matplotlib",
]

setup(
    name="fastopt",
    version="0.1.0",
    description="Fused, exact, layout-agnostic memory-efficient optimizers for PyTorch",
    python_requires=">=3.10",
    packages=[
        "fastopt",
        "fastopt.reference",
        "fastopt.optim",
        "fastopt.distributed",
        "fastopt.kernels",
        "fastopt.csrc",
    ],
    # csrc/ ships as data (fastopt/csrc/ once installed): fastopt.ext compiles it just in time.
    package_dir={"fastopt.kernels": "kernels", "fastopt.csrc": "csrc"},
    package_data={"fastopt": ["data/*"], "fastopt.csrc": ["*.h", "*.cuh", "*.cpp", "*.cu"]},
    install_requires=["torch>=2.10", "numpy"],
    extras_require={
        "triton": ["triton>=3.6"],
        "ext": ["ninja"],
        "demo": ["tqdm", "matplotlib", "ninja"],
        "bench": ["tqdm", "matplotlib", "ninja", "triton>=3.6"],
        "test": TEST,
    },
)
