"""Package metadata for hvd_train: the library, the model zoo and the `hvd-train` console script.

Install with `mpi_scripts/install.sh` (it also builds Horovod against the installed TensorFlow);
the pinned dependencies live in requirements/, so that pip never resolves TensorFlow on its own.
"""

from setuptools import find_packages, setup

setup(
    name="hvd_train",
    version="0.1.0",
    description="Distributed training for Keras on Horovod, on Keras 3 and Keras 2",
    python_requires=">=3.10",
    packages=find_packages(include=["hvd_train", "hvd_train.*", "models", "models.*"]),
    install_requires=["numpy", "PyYAML"],
    extras_require={"test": ["pytest"], "dev": ["pytest", "ruff"]},
    entry_points={"console_scripts": ["hvd-train=hvd_train.cli:main"]},
)
